"""Zero-shot prompt templates ("{c}" is the class name), as in OpenCLIP's zero_shot_metadata."""

# OpenAI CLIP's 80 ImageNet prompt templates (OpenCLIP: OPENAI_IMAGENET_TEMPLATES).
OPENAI_IMAGENET_TEMPLATES = (
    "a bad photo of a {c}.",
    "a photo of many {c}.",
    "a sculpture of a {c}.",
    "a photo of the hard to see {c}.",
    "a low resolution photo of the {c}.",
    "a rendering of a {c}.",
    "graffiti of a {c}.",
    "a bad photo of the {c}.",
    "a cropped photo of the {c}.",
    "a tattoo of a {c}.",
    "the embroidered {c}.",
    "a photo of a hard to see {c}.",
    "a bright photo of a {c}.",
    "a photo of a clean {c}.",
    "a photo of a dirty {c}.",
    "a dark photo of the {c}.",
    "a drawing of a {c}.",
    "a photo of my {c}.",
    "the plastic {c}.",
    "a photo of the cool {c}.",
    "a close-up photo of a {c}.",
    "a black and white photo of the {c}.",
    "a painting of the {c}.",
    "a painting of a {c}.",
    "a pixelated photo of the {c}.",
    "a sculpture of the {c}.",
    "a bright photo of the {c}.",
    "a cropped photo of a {c}.",
    "a plastic {c}.",
    "a photo of the dirty {c}.",
    "a jpeg corrupted photo of a {c}.",
    "a blurry photo of the {c}.",
    "a photo of the {c}.",
    "a good photo of the {c}.",
    "a rendering of the {c}.",
    "a {c} in a video game.",
    "a photo of one {c}.",
    "a doodle of a {c}.",
    "a close-up photo of the {c}.",
    "a photo of a {c}.",
    "the origami {c}.",
    "the {c} in a video game.",
    "a sketch of a {c}.",
    "a doodle of the {c}.",
    "a origami {c}.",
    "a low resolution photo of a {c}.",
    "the toy {c}.",
    "a rendition of the {c}.",
    "a photo of the clean {c}.",
    "a photo of a large {c}.",
    "a rendition of a {c}.",
    "a photo of a nice {c}.",
    "a photo of a weird {c}.",
    "a blurry photo of a {c}.",
    "a cartoon {c}.",
    "art of a {c}.",
    "a sketch of the {c}.",
    "a embroidered {c}.",
    "a pixelated photo of a {c}.",
    "itap of the {c}.",
    "a jpeg corrupted photo of the {c}.",
    "a good photo of a {c}.",
    "a plushie {c}.",
    "a photo of the nice {c}.",
    "a photo of the small {c}.",
    "a photo of the weird {c}.",
    "the cartoon {c}.",
    "art of the {c}.",
    "a drawing of the {c}.",
    "a photo of the large {c}.",
    "a black and white photo of a {c}.",
    "the plushie {c}.",
    "a dark photo of a {c}.",
    "itap of a {c}.",
    "graffiti of the {c}.",
    "a toy {c}.",
    "itap of my {c}.",
    "a photo of a cool {c}.",
    "a photo of a small {c}.",
    "a tattoo of the {c}.",
)

# The 7-template subset (OpenCLIP: SIMPLE_IMAGENET_TEMPLATES).
SIMPLE_IMAGENET_TEMPLATES = (
    "itap of a {c}.",
    "a bad photo of the {c}.",
    "a origami {c}.",
    "a photo of the large {c}.",
    "a {c} in a video game.",
    "art of the {c}.",
    "a photo of the small {c}.",
)


def load_templates(path=None) -> list[str]:
    """Templates from a file (one per line with "{c}"; blank and # lines ignored), or the default."""
    if path is None:
        return list(OPENAI_IMAGENET_TEMPLATES)
    with open(path, encoding="utf-8") as f:
        lines = [ln.strip() for ln in f]
    out = [ln for ln in lines if ln and not ln.startswith("#")]
    if not out:
        raise ValueError(f"{path}: no templates")
    bad = [t for t in out if "{c}" not in t]
    if bad:
        raise ValueError(f"{path}: template without '{{c}}': {bad[0]!r}")
    return out
