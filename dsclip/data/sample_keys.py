"""Which members of a webdataset sample are its image and its caption: ``--image-key``, ``--text-key``,
``--json-text-key`` with OpenCLIP main's names, defaults and precedence.

The reference is OpenCLIP main's ``open_clip_train/data.py`` (``get_wds_dataset``, ``FilterValidSample``,
``JsonCaptionExtractor``, ``FilterNonEmptyText``; mlfoundations/open_clip at 000ca0a, the commit
dsclip/openclip_main_options.json transcribes, unchanged in this respect through 89fb801):

* every key is a ``;``-separated list of member suffixes in priority order; the image is the first listed
  suffix the sample has (webdataset's ``rename`` takes the first present key);
* ``--json-text-key`` set: the caption comes from the ``.json`` member only, its first field in the listed
  order whose value is a non-empty string; ``--text-key`` is then ignored ("Takes precedence over
  --text-key");
* otherwise the caption is the first listed ``--text-key`` member the sample has; an empty one, or one that
  is not UTF-8, drops the sample (main does not fall back to the next suffix);
* a sample without an image member or a caption source is dropped.

dsclip's additions, which change nothing for a sample main reads: a text member with several lines is several
captions (one drawn per step, as dsclip always did), a ``.json`` field holding a list of strings is several
captions, and suffixes are compared lower-case (tar member suffixes are lower-cased when read, as main does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

DEFAULT_IMAGE_KEY = "jpg;png;jpeg;webp"  # OpenCLIP main's DEFAULT_IMAGE_KEY, in its order
DEFAULT_TEXT_KEY = "txt"
_IMAGE_LIKE = ("jpg", "jpeg", "png", "webp", "tif", "tiff", "bmp", "gif", "ppm", "pgm", "image", "img")


def split_keys(keys: str | None) -> tuple[str, ...]:
    """``"jpg; png"`` -> ("jpg", "png"): main's ``_split_wds_keys`` (blank parts dropped), lower-cased."""
    return tuple(p.strip().lower() for p in (keys or "").split(";") if p.strip())


@dataclass(frozen=True)
class SampleKeys:
    """Maps a raw sample ({suffix: bytes}) to its image bytes and captions. Picklable (loader workers)."""

    image_key: str = DEFAULT_IMAGE_KEY
    text_key: str = DEFAULT_TEXT_KEY
    json_text_key: str | None = None

    def __post_init__(self):
        for flag, value in (("--image-key", self.image_key), ("--text-key", self.text_key)):
            if not split_keys(value):
                raise ValueError(f"{flag} {value!r} names no member suffix (e.g. {flag} jpg;png)")
        if self.json_text_key is not None and not split_keys(self.json_text_key):
            raise ValueError(f"--json-text-key {self.json_text_key!r} names no field (e.g. --json-text-key caption)")

    @property
    def image_suffixes(self) -> tuple[str, ...]:
        return split_keys(self.image_key)

    @property
    def text_suffixes(self) -> tuple[str, ...]:
        """The members a caption is read from: ``json`` alone when --json-text-key is set (main's precedence)."""
        return ("json",) if self.json_text_key else split_keys(self.text_key)

    @property
    def json_fields(self) -> tuple[str, ...]:
        return tuple(p.strip() for p in (self.json_text_key or "").split(";") if p.strip())

    def signature(self) -> str:
        """What a shard index records (dsclip.data.tar_index): an index made under other keys is rebuilt."""
        return json.dumps([self.image_key, self.text_key, self.json_text_key])

    def image(self, sample: dict) -> bytes | None:
        for ext in self.image_suffixes:
            if ext in sample:
                return sample[ext]
        return None

    def text_member(self, sample: dict) -> str | None:
        """The suffix the caption is read from (the first listed one present), or None."""
        return next((ext for ext in self.text_suffixes if ext in sample), None)

    def undecodable(self, sample: dict) -> str | None:
        """What is wrong with a caption member that is not UTF-8 (None when it is, or there is none)."""
        ext = self.text_member(sample)
        if ext is None or self.json_text_key:  # a .json that is not UTF-8 fails json.loads: no caption
            return None
        try:
            sample[ext].decode("utf-8")
        except UnicodeDecodeError as e:
            return f".{ext}: byte 0x{sample[ext][e.start]:02x} at offset {e.start} is not UTF-8"
        return None

    def captions(self, sample: dict) -> list[str]:
        """The sample's captions (empty: none, the sample is dropped)."""
        ext = self.text_member(sample)
        if ext is None:
            return []
        if self.json_text_key:
            return _json_captions(sample[ext], self.json_fields)
        text = sample[ext].decode("utf-8", errors="replace")
        return [ln.strip() for ln in text.splitlines() if ln.strip()]

    def mismatch(self, samples: list[dict], where: str) -> str | None:
        """One line when none of ``samples`` (the first of a shard) has an image or a caption under these keys:
        the suffixes found and the flag that would read them; None when at least one sample matches."""
        if not samples or any(self.image(s) is not None and self.captions(s) for s in samples):
            return None
        found = sorted({k for s in samples for k in s if not k.startswith("__")})
        names = ", ".join(f".{k}" for k in found)
        if not any(self.image(s) is not None for s in samples):
            images = [k for k in found if k in _IMAGE_LIKE]
            fix = f"--image-key {';'.join(images)}" if images else "--image-key SUFFIX (the image member's suffix)"
            return f"{where}: no member matches --image-key {self.image_key} (members found: {names}); pass {fix}"
        fields = sorted({f for s in samples for f in _json_string_fields(s.get("json"))})
        if self.json_text_key and "json" not in found:
            return (
                f"{where}: --json-text-key {self.json_text_key} reads the .json member, and these samples have "
                f"none (members found: {names}); pass --text-key SUFFIX instead of --json-text-key"
            )
        if self.json_text_key:
            return (
                f"{where}: no .json field {self.json_text_key} holds a caption (string fields found: "
                f"{', '.join(fields) or 'none'}); pass --json-text-key FIELD"
            )
        fixes = [f"--text-key {k}" for k in found if k not in _IMAGE_LIKE + self.image_suffixes + ("json",)]
        if fields:  # a caption in the .json: name its likeliest field
            fixes.append(f"--json-text-key {next((f for f in ('caption', 'text') if f in fields), fields[0])}")
        return (
            f"{where}: no caption under --text-key {self.text_key} (members found: {names}); "
            f"pass {' or '.join(fixes) or '--text-key SUFFIX'}"
        )


def _load_json(data) -> dict:
    try:
        meta = json.loads(data)
    except (ValueError, TypeError):  # main's JsonCaptionExtractor: unparsable -> no caption
        return {}
    return meta if isinstance(meta, dict) else {}


def _json_string_fields(data) -> list[str]:
    return [k for k, v in _load_json(data).items() if isinstance(v, str) and v.strip()] if data else []


def _json_captions(data: bytes, fields: tuple[str, ...]) -> list[str]:
    """Main's JsonCaptionExtractor: the first listed field whose value is a non-empty string (stripped);
    dsclip also takes a field holding a list of strings as several captions."""
    meta = _load_json(data)
    for f in fields:
        v = meta.get(f)
        if isinstance(v, str) and v.strip():
            return [v.strip()]
        if isinstance(v, list):
            caps = [c.strip() for c in v if isinstance(c, str) and c.strip()]
            if caps:
                return caps
    return []


DEFAULT_KEYS = SampleKeys()
