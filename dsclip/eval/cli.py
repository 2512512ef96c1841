"""``dsclip eval``: zero-shot and/or retrieval evaluation of a saved model; results appended to a jsonl.

    dsclip eval --model runs/x/export --zeroshot-data DIR [--zeroshot-templates FILE]
                [--val-data 'shards/{0..9}.tar' | data.csv] [--tokenizer spm.model] [--results results.jsonl]

``--model`` is what ``dsclip.model.load_model`` reads (a folder with model.safetensors + config.json).
The tokenizer defaults to ``tokenizer.model`` next to the weights, else the built-in demo tokenizer.
Works under a launcher too (every rank evaluates its shard; rank 0 prints and writes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dsclip.dist import rank_world

from ..data.config import DataConfig
from ..data.preprocess import INTERPOLATIONS, PREPROCESS_FIELDS, RESIZE_MODES, check_mean_std, preprocess_settings

# torch, the model, the tokenizers and the evaluator are imported in main_eval, after the flags parsed:
# `dsclip eval --help` and a flag error must not load torch and timm (issue #33).

OPENCLIP_BPE_VOCAB = 49408  # OpenCLIP's SimpleTokenizer (OpenAI BPE)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsclip eval", description="Zero-shot classification and retrieval.")
    p.add_argument(
        "--model",
        required=True,
        help="Saved model folder or weights file (dsclip or OpenCLIP); with --pretrained, an architecture name.",
    )
    p.add_argument(
        "--pretrained",
        help="OpenCLIP checkpoint (.pt/.bin/.safetensors, `module.` prefixes and {'state_dict': ...} accepted) "
        "to load into the --model architecture (with OpenCLIP's 49408-token vocabulary the tokenizer defaults "
        "to open_clip:MODEL).",
    )
    p.add_argument("--tokenizer", help="SentencePiece model (default: tokenizer.model beside the weights, or demo).")
    p.add_argument("--zeroshot-data", help="Class-folder dataset DIR/<class>/*.jpg, or 'demo'.")
    p.add_argument(
        "--imagenet-val",
        help="ImageNet validation folder DIR/<wnid>/*.JPEG (OpenCLIP's flag): built-in class names, OpenCLIP prompts.",
    )
    p.add_argument("--imagenet-v2", help=DataConfig.__dataclass_fields__["imagenet_v2"].metadata["help"])
    p.add_argument(
        "--zeroshot-templates",
        help="Prompt templates file, one per line with {c} (default: OpenCLIP "
        "ImageNet templates; demo: the demo prompts).",
    )
    p.add_argument("--val-data", help="Retrieval set: webdataset shards or CSV/TSV.")
    p.add_argument("--val-num-samples", type=int, help="Use at most this many images of --val-data.")
    # The data settings eval shares with training take their defaults and help from DataConfig.
    for name, tp in (
        ("csv_img_key", str),
        ("csv_caption_key", str),
        ("csv_separator", str),
        ("image_key", str),
        ("text_key", str),
        ("json_text_key", str),
        ("demo_eval_samples", int),
    ):
        f = DataConfig.__dataclass_fields__[name]
        p.add_argument("--" + name.replace("_", "-"), type=tp, default=f.default, help=f.metadata["help"])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (eval's own default).")
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument("--force-image-size", type=int)
    # OpenCLIP's preprocessing flags; default: the model folder's preprocess_cfg (dsclip convert writes the run's)
    saved = "Default: the model folder's preprocess_cfg (the run's, from dsclip convert), else "
    p.add_argument("--image-mean", type=float, nargs="+", help=saved + "OpenAI CLIP's. 3 values or 1.")
    p.add_argument("--image-std", type=float, nargs="+", help=saved + "OpenAI CLIP's. 3 values or 1.")
    p.add_argument("--image-interpolation", choices=INTERPOLATIONS, help=saved + "bicubic.")
    p.add_argument("--image-resize-mode", choices=RESIZE_MODES, help=saved + "shortest.")
    p.add_argument("--results", default="results.jsonl", help="Append one JSON record here.")
    return p


def _load_openclip_pretrained(name: str, path: str, device):
    """An OpenCLIP checkpoint in a shipped architecture, with key-set and shape checks (never strict=False)."""
    from ..model import create_model, from_openclip_state_dict, load_openclip_checkpoint

    sd = load_openclip_checkpoint(path)
    vocab = sd.get("token_embedding.weight", sd.get("module.token_embedding.weight"))
    model = create_model(name, vocab_size=None if vocab is None else vocab.shape[0])
    model.load_state_dict(from_openclip_state_dict(sd, model.config))
    return model.to(device).eval()


def preprocess_for(a: argparse.Namespace) -> dict:
    """Image settings for evaluation: the flags, else the ``preprocess_cfg`` saved beside the model
    (``config.json`` / ``open_clip_config.json``, as ``dsclip convert`` writes them), else the defaults."""
    saved: dict = {}
    if not a.pretrained:
        mp = Path(a.model)
        folder = mp if mp.is_dir() else mp.parent
        for name in ("config.json", "open_clip_config.json"):
            if (folder / name).is_file():
                saved = preprocess_settings(json.loads((folder / name).read_text()).get("preprocess_cfg") or {})
                break
    flags = {k: getattr(a, k) for k in PREPROCESS_FIELDS.values() if getattr(a, k) is not None}
    return {**saved, **flags}


def _flag_error(a: argparse.Namespace) -> str | None:
    """What is wrong with the combination of data flags, if anything (each flag alone argparse checked)."""
    if a.imagenet_val and a.zeroshot_data and a.imagenet_val != a.zeroshot_data:
        return "give either --imagenet-val or --zeroshot-data, not both"
    if not (a.zeroshot_data or a.imagenet_val) and not a.val_data and not a.imagenet_v2:
        return "give --zeroshot-data (or --imagenet-val), --imagenet-v2 and/or --val-data"
    return None


def _saved_tokenizer(a: argparse.Namespace) -> str | None:
    """The tokenizer saved beside a dsclip/OpenCLIP model folder: a SentencePiece model, or the
    ``open_clip:`` name ``dsclip convert`` noted in tokenizer.json, or the folder's Hugging Face tokenizer."""
    mp = Path(a.model)
    folder = mp if mp.is_dir() else mp.parent
    if (folder / "tokenizer.model").is_file():
        return str(folder / "tokenizer.model")
    if (folder / "tokenizer.json").is_file():
        note = json.loads((folder / "tokenizer.json").read_text())
        if "tokenizer" in note:  # {"tokenizer": "open_clip:NAME"} written by convert
            return note["tokenizer"]
        if (folder / "open_clip_config.json").is_file():  # a Hugging Face tokenizer of an OpenCLIP export
            return f"open_clip:local-dir:{folder}"
    return None


def _tokenizer(a: argparse.Namespace, cfg: dict):
    """--tokenizer, else the one saved beside the model, else OpenCLIP's BPE for OpenCLIP weights with its
    vocabulary, else the built-in demo tokenizer."""
    from ..data.demo import ensure_demo_tokenizer
    from ..data.openclip_tokenizer import OpenCLIPTokenizer
    from ..data.tokenizer import SentencePieceTokenizer

    ctx = int(cfg["text_cfg"]["context_length"])
    tok_path = a.tokenizer
    if tok_path is None and not a.pretrained:
        tok_path = _saved_tokenizer(a)
    if tok_path is None and a.pretrained and int(cfg["text_cfg"]["vocab_size"]) == OPENCLIP_BPE_VOCAB:
        tok_path = f"open_clip:{a.model}"  # OpenCLIP weights with OpenCLIP's vocabulary: its BPE tokenizer
    if tok_path is None:
        tok_path = ensure_demo_tokenizer(Path.home() / ".cache" / "dsclip")
    if tok_path.startswith("open_clip:"):
        return OpenCLIPTokenizer(tok_path, ctx)
    return SentencePieceTokenizer(tok_path, ctx)


def _data_config(a: argparse.Namespace, pre: dict) -> DataConfig:
    """The evaluation sets and their reading/preprocessing settings, as training's DataConfig holds them."""
    return DataConfig(
        zeroshot_data=a.zeroshot_data,
        imagenet_v2=a.imagenet_v2,
        zeroshot_templates=a.zeroshot_templates,
        val_data=a.val_data,
        val_num_samples=a.val_num_samples,
        csv_img_key=a.csv_img_key,
        csv_caption_key=a.csv_caption_key,
        csv_separator=a.csv_separator,
        image_key=a.image_key,
        text_key=a.text_key,
        json_text_key=a.json_text_key,
        force_image_size=a.force_image_size,
        demo_eval_samples=a.demo_eval_samples,
        workers=a.workers,
        **pre,
    )


def _evaluate(a: argparse.Namespace, pre: dict) -> tuple[dict, float]:
    """Load the model and its tokenizer, run zero-shot and retrieval; the metrics and the seconds spent."""
    import torch

    from ..model.weights import load_model
    from .evaluator import Evaluator

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.pretrained:
        model = _load_openclip_pretrained(a.model, a.pretrained, device)
    else:
        model = load_model(a.model, device=device)
    cfg = model.config
    image_size = cfg["vision_cfg"]["image_size"]
    image_size = image_size[0] if isinstance(image_size, (list, tuple)) else int(image_size)
    tokenizer = _tokenizer(a, cfg)
    dcfg = _data_config(a, pre)
    ev = Evaluator(dcfg, tokenizer=tokenizer, image_size=image_size, batch_size=a.batch_size, device=device)
    t0 = time.time()
    metrics = {**ev.zeroshot(model), **ev.retrieval(model)}
    return metrics, t0


def main_eval(argv: list[str]) -> int:
    """Entry point of ``dsclip eval``; returns the exit code."""
    a = _parser().parse_args(argv)
    problem = _flag_error(a)
    if problem:
        print(f"dsclip eval: error: {problem}", file=sys.stderr)
        return 2
    a.zeroshot_data = a.zeroshot_data or a.imagenet_val

    pre = preprocess_for(a)
    check_mean_std("image-mean", pre.get("image_mean"))  # before any work
    check_mean_std("image-std", pre.get("image_std"))
    from .evaluator import append_results

    try:
        metrics, t0 = _evaluate(a, pre)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"dsclip eval: error: {e}", file=sys.stderr)
        return 2
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model": str(a.model),
        "zeroshot_data": a.zeroshot_data,
        "imagenet_v2": a.imagenet_v2,
        "val_data": a.val_data,
        "seconds": round(time.time() - t0, 2),
        "metrics": metrics,
    }
    if rank_world()[0] == 0:
        for k, v in metrics.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
        print(json.dumps({"results": a.results}))
    append_results(a.results, record)
    return 0
