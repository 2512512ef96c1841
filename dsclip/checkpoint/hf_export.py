"""``dsclip convert --format hf``: a folder ``transformers.CLIPModel.from_pretrained(DIR)`` loads (SigLIP models:
``SiglipModel``), with ``CLIPProcessor.from_pretrained(DIR)`` files where the tokenizer has a transformers equivalent.

Written: ``config.json`` (transformers' own ``CLIPConfig``/``SiglipConfig``), ``model.safetensors`` (streamed one
tensor at a time, as the other formats), and through transformers' ``CLIPProcessor``/``SiglipProcessor.save_pretrained``
the tokenizer files and the image processor (``CLIPImageProcessor`` with the run's image size, mean/std,
interpolation and resize mode: shortest side + centre crop, or squash), plus ``preprocessor_config.json`` for
transformers 4. Tokenizers:

- dsclip's sentencepiece models: ``tokenizer.json`` built from the model (``dsclip.data.hf_tokenizer``), same ids;
- OpenCLIP's BPE (``open_clip:ViT-B-32`` ...): ``CLIPTokenizer`` files built from the ``bpe_simple_vocab_16e6.txt.gz``
  OpenCLIP ships (OpenAI's vocabulary, ``<|startoftext|>``/``<|endoftext|>`` as in OpenAI's files); same ids up to
  the end-of-text token, padding is ``<|endoftext|>`` where OpenCLIP pads with 0 (argmax pooling never reads it);
- a Hugging Face tokenizer OpenCLIP loads (``hf_tokenizer_name`` models, e.g. SigLIP's): saved as it is.

The mapping is dsclip's names (what every ZeRO stage consolidates to, and what OpenCLIP files are read into) ->
transformers', the fused qkv split into q/k/v; the names and shapes are checked against the transformers model the
config builds (on the meta device) before anything is written. What transformers' classes cannot compute is refused
in one line naming it (``hf_unsupported``). Two adjustments keep the numbers dsclip's:

- the logit scale is written clamped to ln(100), as dsclip's forward clamps it (transformers does not clamp);
- transformers' CLIP text tower pools at the *largest id* when ``eos_token_id`` is 2 (its legacy reading), but
  dsclip's sentencepiece tokenizers put EOS at id 2 and pool at its first position. Such a model is written with
  the EOS and UNK ids swapped, in the embedding rows and in the shipped tokenizer alike (``EOS_SWAP``), so that
  ``eos_token_id`` is no longer 2 and transformers pools at the first EOS, exactly as dsclip.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsclip.config_base import ConfigError

LOGIT_SCALE_MAX = math.log(100.0)  # dsclip.model.clip.LOGIT_SCALE_MAX (kept here without importing the model)
HF_LEGACY_ARGMAX_EOS = 2  # transformers' CLIPTextTransformer pools at argmax(input_ids) for this eos_token_id
OPENCLIP_BPE_VOCAB = 49408
PIL_RESAMPLE = {"bicubic": 3, "bilinear": 2}


# --- what transformers can express ------------------------------------------------------------------------------
def is_siglip(cfg: dict) -> bool:
    return cfg.get("init_logit_bias") is not None


def _timm_spec(vcfg: dict) -> dict | None:
    from dsclip.model.timm_vit import timm_vit_spec

    if not vcfg.get("timm_model_name"):
        return None
    return timm_vit_spec(vcfg["timm_model_name"], vcfg["timm_pool"], vcfg["timm_proj"])


def _siglip_vision_differences(vcfg: dict, spec: dict | None) -> list[str]:
    if spec is None:
        return ["OpenCLIP's ViT image tower (a class token and a pre-norm; SiglipModel's tower has neither)"]
    from timm.layers import GELUTanh
    from torch import nn

    out = []
    if spec["class_token"]:
        out.append(f"an image class token (timm:{vcfg['timm_model_name']})")
    if spec["pre_norm"]:
        out.append("an image pre-norm")
    if spec["global_pool"] != "map" or spec["fc_norm"] or not spec["final_norm"]:
        out.append(f"image pooling {spec['global_pool']!r} (SiglipModel pools with its attention head, 'map')")
    if vcfg["timm_proj"] != "none":
        out.append(f"an image projection (timm_proj {vcfg['timm_proj']!r}; SiglipModel has none)")
    if spec["act_layer"] not in (nn.GELU, GELUTanh):
        out.append(f"image activation {spec['act_layer'].__name__}")
    return out


def hf_unsupported(cfg: dict) -> list[str]:
    """What of a resolved dsclip model config transformers' CLIPModel (SigLIP: SiglipModel) cannot compute, in
    words (empty: it exports). Training-only settings (dropouts, patch dropout) change no output and pass."""
    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    out = []
    if v.get("ls_init_value") is not None or t.get("ls_init_value") is not None:
        out.append("layer scale (ls_init_value)")
    if is_siglip(cfg):
        out += _siglip_vision_differences(v, _timm_spec(v))
        if not t["no_causal_mask"]:
            out.append("a causal text mask (SiglipModel's text tower is bidirectional)")
        if t["pool_type"] != "last":
            out.append(f"text pooling {t['pool_type']!r} (SiglipModel pools the last token)")
        return out
    if v.get("timm_model_name"):
        out.append(f"image tower timm:{v['timm_model_name']} (CLIPModel's is OpenCLIP's ViT)")
    if t["no_causal_mask"]:
        out.append("a bidirectional text tower (no_causal_mask; CLIPModel's is causal)")
    if t["pool_type"] not in ("argmax", "eos"):
        out.append(f"text pooling {t['pool_type']!r} (CLIPModel pools at the end-of-text token)")
    if t["proj_bias"]:
        out.append("a text projection with bias")
    return out


def check_exportable(cfg: dict) -> None:
    bad = hf_unsupported(cfg)
    if bad:
        cls = "SiglipModel" if is_siglip(cfg) else "CLIPModel"
        raise ConfigError(
            f"--format hf: transformers' {cls} cannot express this model: {'; '.join(bad)}; "
            "export it with --format open_clip or dsclip instead"
        )


def _act(quick_gelu: bool, act_kwargs: dict | None = None) -> str:
    # transformers' ACT2FN names of dsclip's activations (dsclip.model.blocks.act_layer)
    if quick_gelu:
        return "quick_gelu"
    return "gelu_pytorch_tanh" if (act_kwargs or {}).get("approximate") == "tanh" else "gelu"


def _eps(section: dict, default: float = 1e-5) -> float:
    return float((section.get("norm_kwargs") or {}).get("eps", default))


# --- token ids ---------------------------------------------------------------------------------------------------
@dataclass
class TokenIds:
    """The special ids the exported text tower and tokenizer use, and the id permutation applied to both."""

    eos: int | None
    pad: int | None
    bos: int | None = None
    unk: int | None = None
    swap: tuple[int, int] | None = None  # two token ids exchanged (EOS_SWAP)

    def permute(self, i: int | None) -> int | None:
        if self.swap is None or i is None:
            return i
        a, b = self.swap
        return b if i == a else a if i == b else i


# --- the config --------------------------------------------------------------------------------------------------
def hf_config(cfg: dict, shapes: dict[str, torch.Size], ids: TokenIds, logit_scale: float | None = None):
    """transformers' ``CLIPConfig`` / ``SiglipConfig`` of a resolved dsclip config; ``shapes``: dsclip name -> shape
    (the MLP widths are read from the weights, as transformers sizes them explicitly)."""
    from transformers import CLIPConfig, SiglipConfig

    v, t = cfg["vision_cfg"], cfg["text_cfg"]
    text = {
        "vocab_size": t["vocab_size"],
        "hidden_size": t["width"],
        "intermediate_size": int(shapes["text.blocks.0.mlp.fc1.weight"][0]),
        "num_hidden_layers": t["layers"],
        "num_attention_heads": t["heads"],
        "max_position_embeddings": t["context_length"],
        "hidden_act": _act(cfg["quick_gelu"], t.get("act_kwargs")),
        "layer_norm_eps": _eps(t),
        "pad_token_id": ids.pad,
        "bos_token_id": ids.bos,
        "eos_token_id": ids.eos,
    }
    vision = {
        "hidden_size": v["width"],
        "intermediate_size": int(shapes["visual.blocks.0.mlp.fc1.weight"][0]),
        "num_hidden_layers": v["layers"],
        "num_attention_heads": v["width"] // v["head_width"],
        "image_size": v["image_size"],
        "patch_size": v["patch_size"],
    }
    if is_siglip(cfg):
        spec = _timm_spec(v)
        vision.update(hidden_act="gelu" if spec["act_layer"] is torch.nn.GELU else "gelu_pytorch_tanh")
        vision.update(layer_norm_eps=spec["norm_eps"], vision_use_head=True)
        text.update(projection_size=cfg["embed_dim"])
        return SiglipConfig(text_config=text, vision_config=vision, architectures=["SiglipModel"])
    vision.update(hidden_act=_act(cfg["quick_gelu"]), layer_norm_eps=_eps(v), projection_dim=cfg["embed_dim"])
    text.update(projection_dim=cfg["embed_dim"])
    extra = {} if logit_scale is None else {"logit_scale_init_value": logit_scale}
    return CLIPConfig(
        text_config=text, vision_config=vision, projection_dim=cfg["embed_dim"], architectures=["CLIPModel"], **extra
    )


# --- the tensors -------------------------------------------------------------------------------------------------
@dataclass
class Rule:
    """One transformers tensor: made by ``make`` from the named dsclip tensors."""

    sources: list[str]
    make: Callable[..., torch.Tensor]


def _same(t):
    return t


def _rows(start: int, stop: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t[start:stop]


def _block_rules(src: str, dst: str, width: int) -> dict[str, Rule]:
    """timm Block (fused qkv) -> transformers' encoder layer (q/k/v projections)."""
    rules = {}
    for p in ("weight", "bias"):
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):  # qkv rows: q, k, v (nn.MultiheadAttention's)
            rules[f"{dst}.self_attn.{name}.{p}"] = Rule([f"{src}.attn.qkv.{p}"], _rows(i * width, (i + 1) * width))
        for s, d in (("attn.proj", "self_attn.out_proj"), ("norm1", "layer_norm1"), ("norm2", "layer_norm2")):
            rules[f"{dst}.{d}.{p}"] = Rule([f"{src}.{s}.{p}"], _same)
        for fc in ("fc1", "fc2"):
            rules[f"{dst}.mlp.{fc}.{p}"] = Rule([f"{src}.mlp.{fc}.{p}"], _same)
    return rules


def _ln(src: str, dst: str) -> dict[str, Rule]:
    return {f"{dst}.{p}": Rule([f"{src}.{p}"], _same) for p in ("weight", "bias")}


def _logit_scale(shape: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.clamp(max=LOGIT_SCALE_MAX).reshape(shape)  # dsclip's forward clamps; transformers doesn't


def _embedding_rows(ids: TokenIds) -> Callable[[torch.Tensor], torch.Tensor]:
    if ids.swap is None:
        return _same
    a, b = ids.swap

    def permuted(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t[[a, b]] = t[[b, a]]
        return t

    return permuted


def _text_rules(cfg: dict, ids: TokenIds, siglip: bool) -> dict[str, Rule]:
    t = cfg["text_cfg"]
    rules = {
        "text_model.embeddings.token_embedding.weight": Rule(["text.token_embedding.weight"], _embedding_rows(ids)),
        "text_model.embeddings.position_embedding.weight": Rule(["text.positional_embedding"], _same),
        **_ln("text.ln_final", "text_model.final_layer_norm"),
    }
    for i in range(t["layers"]):
        rules.update(_block_rules(f"text.blocks.{i}", f"text_model.encoder.layers.{i}", t["width"]))
    if not siglip:
        rules["text_projection.weight"] = Rule(["text.text_projection"], torch.t)
    elif t["proj_bias"]:
        rules.update({f"text_model.head.{p}": Rule([f"text.text_projection.{p}"], _same) for p in ("weight", "bias")})
    else:  # a bias-free (width, embed) projection is SiglipModel's head with a zero bias: the same numbers
        rules["text_model.head.weight"] = Rule(["text.text_projection"], torch.t)
        rules["text_model.head.bias"] = Rule(["text.text_projection"], lambda w: torch.zeros_like(w[0]))
    return rules


def _clip_vision_rules(v: dict) -> dict[str, Rule]:
    e = "vision_model.embeddings"
    rules = {
        f"{e}.patch_embedding.weight": Rule(["visual.patch_embed.proj.weight"], _same),
        f"{e}.class_embedding": Rule(["visual.cls_token"], lambda t: t.reshape(-1)),
        f"{e}.position_embedding.weight": Rule(["visual.pos_embed"], lambda t: t.reshape(t.shape[-2:])),
        **_ln("visual.norm_pre", "vision_model.pre_layrnorm"),
        **_ln("visual.norm", "vision_model.post_layernorm"),
        "visual_projection.weight": Rule(["visual.proj"], torch.t),
    }
    for i in range(v["layers"]):
        rules.update(_block_rules(f"visual.blocks.{i}", f"vision_model.encoder.layers.{i}", v["width"]))
    return rules


def _siglip_vision_rules(v: dict) -> dict[str, Rule]:
    e, h, a = "vision_model.embeddings", "vision_model.head", "visual.attn_pool"
    rules = {
        **{f"{e}.patch_embedding.{p}": Rule([f"visual.patch_embed.proj.{p}"], _same) for p in ("weight", "bias")},
        f"{e}.position_embedding.weight": Rule(["visual.pos_embed"], lambda t: t.reshape(t.shape[-2:])),
        **_ln("visual.norm", "vision_model.post_layernorm"),
        # timm's attention pool (separate q and fused kv Linears) is nn.MultiheadAttention's in_proj q, k, v rows
        f"{h}.probe": Rule([f"{a}.latent"], _same),
        **{
            f"{h}.attention.in_proj_{p}": Rule([f"{a}.q.{p}", f"{a}.kv.{p}"], lambda q, kv: torch.cat([q, kv]))
            for p in ("weight", "bias")
        },
        **{f"{h}.attention.out_proj.{p}": Rule([f"{a}.proj.{p}"], _same) for p in ("weight", "bias")},
        **_ln(f"{a}.norm", f"{h}.layernorm"),
        **{
            f"{h}.mlp.{fc}.{p}": Rule([f"{a}.mlp.{fc}.{p}"], _same) for fc in ("fc1", "fc2") for p in ("weight", "bias")
        },
    }
    for i in range(v["layers"]):
        rules.update(_block_rules(f"visual.blocks.{i}", f"vision_model.encoder.layers.{i}", v["width"]))
    return rules


def hf_rules(cfg: dict, ids: TokenIds) -> dict[str, Rule]:
    """transformers name -> how to make it from dsclip's tensors, for an exportable resolved config."""
    siglip = is_siglip(cfg)
    rules = _siglip_vision_rules(cfg["vision_cfg"]) if siglip else _clip_vision_rules(cfg["vision_cfg"])
    rules.update(_text_rules(cfg, ids, siglip))
    rules["logit_scale"] = Rule(["logit_scale"], _logit_scale((1,) if siglip else ()))
    if siglip:
        rules["logit_bias"] = Rule(["logit_bias"], lambda t: t.reshape(1))
    return rules


def _hf_model_shapes(config) -> dict[str, torch.Size]:
    from transformers import CLIPModel, SiglipModel

    cls = SiglipModel if config.model_type == "siglip" else CLIPModel
    with torch.device("meta"):
        model = cls(config)
    return {k: v.shape for k, v in model.state_dict().items()}


def hf_tensors(items, cfg: dict, ids: TokenIds, config) -> list:
    """``items`` (dsclip name, LazyTensor) -> (transformers name, LazyTensor), checked name by name and shape by
    shape against the model transformers builds from ``config``; every dsclip tensor is used."""
    from dsclip.checkpoint.convert import LazyTensor

    src = dict(items)
    rules = hf_rules(cfg, ids)
    used = {s for r in rules.values() for s in r.sources}
    unused, missing = sorted(set(src) - used), sorted(used - set(src))
    if unused or missing:  # a dsclip layout this map does not know: a bug, never a silently dropped weight
        raise RuntimeError(f"dsclip -> transformers map: unused {unused}, missing {missing}")
    cache: dict[str, torch.Tensor] = {}

    def load(name: str) -> torch.Tensor:  # q, k and v come from one fused tensor: read it once
        if name not in cache:
            cache.clear()
            cache[name] = src[name].load()
        return cache[name]

    out = []
    for hf_name, rule in rules.items():
        meta = rule.make(*(torch.empty(src[s].shape, dtype=src[s].dtype, device="meta") for s in rule.sources))
        out.append((hf_name, LazyTensor(meta.shape, meta.dtype, _maker(rule, load))))
    want = _hf_model_shapes(config)
    got = {k: t.shape for k, t in out}
    if got != want:
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        raise RuntimeError(f"dsclip -> transformers map disagrees with transformers' model on {diff[:8]}")
    return out


def _maker(rule: Rule, load: Callable[[str], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: rule.make(*(load(s) for s in rule.sources)).contiguous()


# --- tokenizers --------------------------------------------------------------------------------------------------
@dataclass
class TokenizerSource:
    """Where the model's tokenizer comes from: a dsclip sentencepiece model file, OpenCLIP's BPE, a Hugging Face
    tokenizer object (OpenCLIP's ``hf_tokenizer_name`` models), or nothing known (no tokenizer files)."""

    kind: str  # "spm" | "openclip_bpe" | "hf" | "none"
    path: Path | None = None
    hf: object | None = None
    notes: list[str] = field(default_factory=list)


def tokenizer_from_spec(spec: str, context_length: int) -> TokenizerSource:
    """A run's recorded tokenizer spec (``open_clip:NAME``) -> its source."""
    from dsclip.data.openclip_tokenizer import OpenCLIPTokenizer

    tok = OpenCLIPTokenizer(spec, context_length)
    hf = getattr(tok.tok, "tokenizer", None)
    if hf is not None:
        notes = []
        clean = getattr(getattr(tok.tok, "clean_fn", None), "__name__", "")
        if clean and "whitespace" not in clean:  # OpenCLIP cleans the text before its Hugging Face tokenizer
            notes.append(
                f"OpenCLIP cleans text ({clean.lstrip('_')}) before tokenizer {spec}; the exported tokenizer does not"
            )
        return TokenizerSource("hf", hf=hf, notes=notes)
    if tok.vocab_size == OPENCLIP_BPE_VOCAB:
        return TokenizerSource("openclip_bpe")
    return TokenizerSource("none", notes=[f"tokenizer {spec} has no transformers equivalent: no tokenizer files"])


def token_ids(cfg: dict, source: TokenizerSource) -> TokenIds:
    """The special ids for transformers' config, and EOS_SWAP where dsclip's EOS pooling would be read as argmax."""
    t = cfg["text_cfg"]
    if source.kind == "openclip_bpe":
        # CLIPTokenizer's <|startoftext|> and its padding <|endoftext|> (OpenAI's files); EOS follows the pooling
        ids = TokenIds(eos=None, pad=OPENCLIP_BPE_VOCAB - 1, bos=OPENCLIP_BPE_VOCAB - 2)
    elif source.kind == "spm":
        ids = _spm_ids(source.path)
    else:
        ids = TokenIds(eos=t["eos_id"], pad=t["pad_id"])
    if is_siglip(cfg):  # pools the last token: the ids are the tokenizer's
        ids.eos = t["eos_id"] if ids.eos is None else ids.eos
        ids.pad = t["pad_id"] if ids.pad is None else ids.pad
        return ids
    if t["pool_type"] == "argmax":
        ids.eos = HF_LEGACY_ARGMAX_EOS  # transformers' reading: pool at the largest id, as dsclip's 'argmax'
        ids.pad = t["pad_id"] if ids.pad is None else ids.pad
        return ids
    if t["eos_id"] != HF_LEGACY_ARGMAX_EOS:  # transformers pools at the first eos_token_id, as dsclip's 'eos'
        ids.eos = t["eos_id"]
        ids.pad = t["pad_id"] if ids.pad is None else ids.pad
        return ids
    if source.kind != "spm":
        what = "no tokenizer comes with the weights" if source.kind == "none" else "its tokenizer is not sentencepiece"
        raise ConfigError(
            "--format hf: the text tower pools at eos_id 2, which transformers' CLIP reads as argmax pooling, and "
            f"{what}, so dsclip cannot renumber EOS: export with --format open_clip"
        )
    return _eos_swap(ids, t)


def _spm_ids(path: Path) -> TokenIds:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    pad = sp.pad_id() if sp.pad_id() >= 0 else 0  # dsclip pads with 0 when the model has no pad piece
    bos = sp.bos_id() if sp.bos_id() >= 0 else None
    return TokenIds(eos=sp.eos_id(), pad=pad, bos=bos, unk=sp.unk_id())


def _eos_swap(ids: TokenIds, t: dict) -> TokenIds:
    """EOS_SWAP: EOS (id 2) exchanges ids with the UNK piece (the module docstring says why)."""
    if ids.eos != t["eos_id"]:
        raise ConfigError(f"--format hf: the model pools at eos_id {t['eos_id']}, its tokenizer's EOS is {ids.eos}")
    swapped = TokenIds(eos=ids.eos, pad=ids.pad, bos=ids.bos, unk=ids.unk, swap=(ids.eos, ids.unk))
    swapped.eos, swapped.pad, swapped.bos, swapped.unk = (
        swapped.permute(i) for i in (ids.eos, ids.pad, ids.bos, ids.unk)
    )
    return swapped


def run_tokenizer(run_dir: Path, context_length: int) -> TokenizerSource:
    """The tokenizer a training run recorded (dsclip.checkpoint.ds_checkpoint.record_tokenizer)."""
    from dsclip.checkpoint.ds_checkpoint import TOKENIZER_FILE, TOKENIZER_SPEC_FILE

    if (run_dir / TOKENIZER_FILE).is_file():
        return TokenizerSource("spm", path=run_dir / TOKENIZER_FILE)
    if (run_dir / TOKENIZER_SPEC_FILE).is_file():
        return tokenizer_from_spec(json.loads((run_dir / TOKENIZER_SPEC_FILE).read_text())["tokenizer"], context_length)
    return TokenizerSource("none", notes=[f"{run_dir} records no tokenizer: no tokenizer files written"])


def openclip_bpe_tokenizer(context_length: int):
    """transformers' ``CLIPTokenizer`` with OpenCLIP's BPE: the vocabulary and merges OpenCLIP's SimpleTokenizer
    builds from the ``bpe_simple_vocab_16e6.txt.gz`` open_clip_torch ships (byte symbols, their ``</w>`` forms,
    the merges, then the two specials), the specials named as in OpenAI's files."""
    import gzip

    from transformers import CLIPTokenizer

    try:
        from open_clip.tokenizer import bytes_to_unicode, default_bpe
    except ImportError:
        raise ConfigError("OpenCLIP's BPE vocabulary comes with open_clip_torch: pip install 'dsclip[hf]'") from None

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1]]  # OpenCLIP's slice of the merges file
    symbols = list(bytes_to_unicode().values())
    vocab = [
        *symbols,
        *(s + "</w>" for s in symbols),
        *("".join(m) for m in merges),
        "<|startoftext|>",
        "<|endoftext|>",
    ]
    if len(vocab) != OPENCLIP_BPE_VOCAB:
        raise ConfigError(f"OpenCLIP's BPE file gives {len(vocab)} tokens, expected {OPENCLIP_BPE_VOCAB}")
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=merges, model_max_length=context_length)


def _swapped_spm(path: Path, swap: tuple[int, int], folder: Path) -> Path:
    """The sentencepiece model with two pieces exchanging ids (EOS_SWAP), special ids following them."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.ParseFromString(path.read_bytes())
    a, b = swap
    piece = pb.ModelProto.SentencePiece()
    piece.CopyFrom(proto.pieces[a])
    proto.pieces[a].CopyFrom(proto.pieces[b])
    proto.pieces[b].CopyFrom(piece)
    for name in ("unk_id", "bos_id", "eos_id", "pad_id"):
        i = getattr(proto.trainer_spec, name)
        if i in swap:
            setattr(proto.trainer_spec, name, b if i == a else a)
    out = folder / "swapped.model"
    out.write_bytes(proto.SerializeToString())
    return out


def hf_tokenizer(source: TokenizerSource, ids: TokenIds, context_length: int):
    """A transformers tokenizer object for ``source`` (None: no equivalent)."""
    if source.kind == "openclip_bpe":
        return openclip_bpe_tokenizer(context_length)
    if source.kind == "hf":
        return source.hf
    if source.kind != "spm":
        return None
    from transformers import PreTrainedTokenizerFast

    from dsclip.data.hf_tokenizer import write_hf_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        spm_path = source.path if ids.swap is None else _swapped_spm(source.path, ids.swap, Path(tmp))
        try:
            write_hf_tokenizer(spm_path, tmp, context_length)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return PreTrainedTokenizerFast.from_pretrained(tmp)


def image_processor(cfg: dict, preprocess_cfg: dict):
    """transformers' ``CLIPImageProcessor`` doing dsclip's eval transform (dsclip.data.transforms: resize by the
    shortest side + centre crop, or squash; bicubic unless bilinear), or None for the resize-and-pad mode."""
    from transformers import CLIPImageProcessor

    from dsclip.model.openclip import openclip_model_config

    pre = openclip_model_config(cfg, preprocess_cfg)["preprocess_cfg"]
    size = pre["size"] if isinstance(pre["size"], int) else pre["size"][-1]
    common = {
        "resample": PIL_RESAMPLE["bilinear" if pre["interpolation"] == "bilinear" else "bicubic"],
        "image_mean": list(pre["mean"]),
        "image_std": list(pre["std"]),
        "do_convert_rgb": True,
    }
    if pre["resize_mode"] == "squash":
        return CLIPImageProcessor(size={"height": size, "width": size}, do_center_crop=False, **common)
    if pre["resize_mode"] != "shortest":
        return None
    crop = {"height": size, "width": size}
    return CLIPImageProcessor(size={"shortest_edge": size}, crop_size=crop, do_center_crop=True, **common)


def processor_parts(cfg: dict, preprocess_cfg: dict, source: TokenizerSource, ids: TokenIds):
    """(tokenizer or None, image processor or None, notes on what is missing), built before anything is written."""
    notes = list(source.notes)
    tokenizer = hf_tokenizer(source, ids, cfg["text_cfg"]["context_length"])
    images = image_processor(cfg, preprocess_cfg)
    if images is None:
        notes.append(
            "no image processor: transformers has no resize-longest-side-and-pad (--image-resize-mode longest)"
        )
    if tokenizer is not None and is_siglip(cfg):
        # SigLIP's text tower attends to every position, padding included (no mask), as dsclip and Google's
        # SigLIP: the tokenizer returns no attention_mask, so model(**processor(...)) cannot mask the padding
        tokenizer.model_input_names = ["input_ids"]
        tokenizer.init_kwargs["model_input_names"] = ["input_ids"]
    return tokenizer, images, notes


def save_processor(out: Path, cfg: dict, tokenizer, images) -> None:
    """Tokenizer + image-processor files: ``CLIPProcessor.from_pretrained(out)`` (SigLIP: ``AutoProcessor``)."""
    from transformers import CLIPProcessor, SiglipProcessor

    if images is not None:
        images.save_pretrained(str(out))  # preprocessor_config.json (transformers 4 reads it)
    if tokenizer is not None and images is not None:
        cls = SiglipProcessor if is_siglip(cfg) else CLIPProcessor
        cls(image_processor=images, tokenizer=tokenizer).save_pretrained(str(out))
    elif tokenizer is not None:
        tokenizer.save_pretrained(str(out))


# --- the export --------------------------------------------------------------------------------------------------
def require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("--format hf needs transformers: pip install 'dsclip[hf]'") from None


def export_hf(
    items: list,
    cfg: dict,
    out: Path,
    *,
    preprocess_cfg: dict,
    tokenizer: TokenizerSource,
    say: Callable[[str], None] = print,
) -> Path:
    """Write the transformers folder ``out`` from dsclip-named (name, LazyTensor) ``items`` of the resolved ``cfg``;
    returns the weights path. Refuses (ConfigError, one line) what transformers cannot express, before writing."""
    from dsclip.checkpoint.convert import write_safetensors_streaming

    require_transformers()
    check_exportable(cfg)
    ids = token_ids(cfg, tokenizer)
    config = hf_config(cfg, {k: t.shape for k, t in items}, ids)
    tensors = hf_tensors(items, cfg, ids, config)
    hf_tok, images, notes = processor_parts(cfg, preprocess_cfg, tokenizer, ids)  # fails before writing, if it does
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "model.safetensors"
    write_safetensors_streaming(weights, tensors, {"format": "pt"})  # transformers reads metadata format "pt"
    config.save_pretrained(str(out))
    save_processor(out, cfg, hf_tok, images)
    for note in notes:
        say(f"note: {note}")
    if ids.swap is not None:
        a, b = ids.swap
        say(
            f"note: token ids {a} (EOS) and {b} exchanged in the export's embedding and tokenizer (transformers' CLIP "
            f"reads eos_token_id {HF_LEGACY_ARGMAX_EOS} as argmax pooling); tokenize with the exported tokenizer"
        )
    return weights


# --- from a weights file (--pretrained-style input) --------------------------------------------------------------
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")


def is_weights_input(path: Path) -> bool:
    """A weights file or an export folder (dsclip's, OpenCLIP's local-dir), not a run or a checkpoint."""
    from dsclip.checkpoint.pretrained import WEIGHT_CANDIDATES

    if path.is_file():
        return path.suffix in WEIGHT_SUFFIXES
    return path.is_dir() and any((path / n).is_file() for n in WEIGHT_CANDIDATES)


def _file_config(weights: Path, model_config: str | None) -> tuple[dict, dict]:
    """(resolved model config, preprocess_cfg) of a weights file: ``--model-config``, else the config beside it."""
    from dsclip.model import create_model, get_model_config

    beside = next(
        (weights.parent / n for n in ("open_clip_config.json", "config.json") if (weights.parent / n).is_file()), None
    )
    saved = json.loads(beside.read_text()) if beside else {}
    if model_config:
        p = Path(model_config)
        cfg = json.loads(p.read_text()) if p.is_file() else get_model_config(model_config)
    elif "model_cfg" in saved:
        cfg = saved
    else:
        raise ConfigError(
            f"{weights}: no open_clip_config.json or dsclip config.json beside it: pass --model-config NAME"
        )
    cfg = cfg.get("model_cfg", cfg)
    return create_model(cfg, device="meta").config, saved.get("preprocess_cfg") or {}


def _file_tokenizer(weights: Path, sd: dict, context_length: int) -> TokenizerSource:
    folder = weights.parent
    if (folder / "tokenizer.model").is_file():
        return TokenizerSource("spm", path=folder / "tokenizer.model")
    if (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return TokenizerSource("hf", hf=AutoTokenizer.from_pretrained(str(folder)))
    emb = sd.get("text.token_embedding.weight")
    if emb is not None and emb.shape[0] == OPENCLIP_BPE_VOCAB:
        return TokenizerSource("openclip_bpe")  # OpenCLIP's BPE vocabulary size: what these weights were trained with
    return TokenizerSource("none", notes=[f"no tokenizer beside {weights}: no tokenizer files written"])


def weights_file_items(path: Path, model_config: str | None, dtype: torch.dtype):
    """(dsclip-named LazyTensors, cfg, preprocess_cfg, tokenizer) of a weights file or export folder in dsclip's or
    OpenCLIP's layout (read with weights_only=True), checked key by key against the config's model."""
    from dsclip.checkpoint.convert import LazyTensor
    from dsclip.checkpoint.pretrained import WEIGHT_CANDIDATES
    from dsclip.model.openclip import (
        check_state_dict,
        expected_shapes,
        from_openclip_state_dict,
        is_openclip_state_dict,
        load_openclip_checkpoint,
    )

    weights = path if path.is_file() else next(path / n for n in WEIGHT_CANDIDATES if (path / n).is_file())
    cfg, pre = _file_config(weights, model_config)
    sd = load_openclip_checkpoint(weights)
    if is_openclip_state_dict(sd):
        sd = from_openclip_state_dict(sd, cfg)
    check_state_dict(sd, expected_shapes(cfg), f"weights {weights}")
    items = []
    for k, v in sd.items():
        v = v.to(dtype) if v.is_floating_point() else v
        items.append((k, LazyTensor(v.shape, v.dtype, lambda v=v: v)))
    return items, cfg, pre, _file_tokenizer(weights, sd, cfg["text_cfg"]["context_length"])


def convert_weights_file(path: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype, model_config=None,
                         say: Callable[[str], None] = print) -> Path:  # fmt: skip
    """``dsclip convert FILE --format hf -o OUT``: a weights file (``--pretrained``-style input) -> transformers."""
    items, cfg, pre, tok = weights_file_items(Path(path), model_config, dtype)
    return export_hf(items, cfg, Path(out), preprocess_cfg=pre, tokenizer=tok, say=say)


def export_state_dict(
    state_dict: dict,
    cfg: dict,
    out: str | os.PathLike,
    *,
    preprocess_cfg: dict | None = None,
    tokenizer: TokenizerSource | None = None,
    say: Callable[[str], None] = print,
) -> Path:
    """An in-memory dsclip state dict (``CLIP.state_dict()``) -> the transformers folder ``out``."""
    from dsclip.checkpoint.convert import LazyTensor
    from dsclip.model.config import resolve_model_config
    from dsclip.model.openclip import check_state_dict, expected_shapes

    cfg = resolve_model_config(cfg)
    check_state_dict(state_dict, expected_shapes(cfg), "dsclip state dict")
    items = [(k, LazyTensor(v.shape, v.dtype, lambda v=v: v.detach())) for k, v in state_dict.items()]
    source = tokenizer or TokenizerSource("none", notes=["no tokenizer given: no tokenizer files written"])
    return export_hf(items, cfg, Path(out), preprocess_cfg=preprocess_cfg or {}, tokenizer=source, say=say)
