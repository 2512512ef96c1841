"""Every open_clip_train option and what `dsclip train` does with it: the one table.

dsclip promises that an OpenCLIP command line works after changing the program name (and adding
``--deepspeed-config``). This table is the honest record of where that holds. Each OpenCLIP option has
exactly one row: those of open_clip_torch 3.3.0 (``open_clip_train/params.py``, the release on PyPI,
whose parser tests/unit/test_compat.py reads at run time) in :data:`OPENCLIP_FLAGS`, and those OpenCLIP's
main branch added in :data:`MAIN_FLAGS`. Main is not installable, so its option list is data:
``openclip_main_options.json``, transcribed from main's parser at the commit it names. An option in
both keeps its 3.3.0 row; what main changed in it is in :data:`MAIN_CHANGES`. Statuses:

- accepted by ``dsclip train`` under the same name:
  ``same`` (OpenCLIP's meaning and default), ``differs`` (OpenCLIP's meaning, but the default or a
  detail differs: the note says which), ``no-op`` (accepted so command lines keep working; the note
  says why nothing needs doing);
- not accepted (``dsclip train`` rejects it as an unknown flag): ``renamed`` (the note names
  dsclip's flag), ``not offered`` (the note says why and what to use instead), ``planned`` (not built
  yet; the note names the issue item).

tests/unit/test_compat.py reads OpenCLIP's own parser (and main's list) and fails for an option missing
here, for a row whose status does not match what ``dsclip train`` accepts, and when the table in
docs/coming-from-openclip.md is not :func:`render_markdown`'s output (``python -m dsclip.compat
--write-docs`` rewrites it).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import NamedTuple

ACCEPTED = ("same", "differs", "no-op")
REJECTED = ("renamed", "not offered", "planned")
STATUSES = ACCEPTED + REJECTED


class Row(NamedTuple):
    status: str
    note: str = ""


_LIT = "locked parameters get no gradient and no optimizer state (ZeRO-2/3, gradient cache, checkpointing)"


def _pre(default: str, demo: str) -> str:
    """The note shared by --image-mean/--image-std/--image-interpolation/--image-resize-mode."""
    return (
        f"default {default} (OpenCLIP: the model's preprocess config, the same for models trained from scratch; "
        "a `--pretrained` model's own is not read: pass its values); used for webdataset/CSV training and "
        f"evaluation images ({demo}), written to `dsclip convert`'s `preprocess_cfg` and read by `dsclip eval`"
    )


# Keyed by OpenCLIP's flag, in the order of OpenCLIP's parser.
OPENCLIP_FLAGS: dict[str, Row] = {
    "--train-data": Row("same", "webdataset shards with brace expansion and `::` sources, or a CSV/TSV file"),
    "--train-data-upsampling-factors": Row("same"),
    "--val-data": Row("same"),
    "--train-num-samples": Row("same"),
    "--val-num-samples": Row("same", "caps the retrieval validation set"),
    "--dataset-type": Row(
        "differs",
        "`auto`, `webdataset`, `csv`, `synthetic` as OpenCLIP (synthetic: one black image of the model's size and "
        '"Dummy caption", `--train-num-samples` per epoch, for throughput tests; demo tokenizer unless '
        "`--tokenizer`), plus `demo` (built-in learnable set)",
    ),
    "--dataset-resampled": Row("same"),
    "--csv-separator": Row("same"),
    "--csv-img-key": Row("same"),
    "--csv-caption-key": Row("same"),
    "--imagenet-val": Row(
        "same",
        "an ImageNet validation folder by WordNet id: built-in ImageNet-1k names and OpenCLIP's prompts "
        "(other class folders: `--zeroshot-data`)",
    ),
    "--imagenet-v2": Row(
        "same",
        "a folder that is given (OpenCLIP's location holding `ImageNetV2-matched-frequency/`, or that folder); "
        "never downloaded; reported as `imagenetv2-zeroshot-val-top1/top5`",
    ),
    "--cache-dir": Row("same", "where `--pretrained` tag / `hf-hub:` downloads are cached"),
    "--logs": Row("same"),
    "--log-local": Row("same", "every rank writes `out-RANK.log` in the run folder (else rank 0 writes `out.log`)"),
    "--name": Row("same"),
    "--workers": Row(
        "differs", "default 1 (OpenCLIP: 4): dsclip runs on small CPU machines too; raise it for image decoding"
    ),
    "--batch-size": Row("same", "micro-batch per rank"),
    "--epochs": Row("same"),
    "--epochs-cooldown": Row("same"),
    "--lr": Row("same", "OpenCLIP's ViT default (dsclip's towers are ViTs)"),
    "--beta1": Row("same", "OpenCLIP's ViT default"),
    "--beta2": Row("same", "OpenCLIP's ViT default"),
    "--eps": Row("same", "OpenCLIP's ViT default"),
    "--wd": Row("same", "no decay on biases, norms, embeddings, logit scale/bias, as OpenCLIP"),
    "--momentum": Row(
        "same",
        "passed to a `--opt timm/NAME` or DeepSpeed-JSON optimizer that takes it; with AdamW (the default) it is "
        "an error",
    ),
    "--warmup": Row("same"),
    "--opt": Row(
        "differs",
        "`adamw` or `timm/NAME` (timm's create_optimizer_v2 over dsclip's weight-decay groups) as OpenCLIP, but "
        "a timm optimizer gets `--beta1/--beta2/--eps` (their defaults when not given; OpenCLIP leaves timm's); "
        "refused with a DeepSpeed JSON `optimizer` block or ZeRO-Offload",
    ),
    "--use-bn-sync": Row(
        "no-op", "accepted; dsclip's towers, like OpenCLIP's ViTs, have no BatchNorm to convert to SyncBatchNorm"
    ),
    "--skip-scheduler": Row("same", "learning rate constant at `--lr` (no warm-up), as OpenCLIP"),
    "--lr-scheduler": Row("same"),
    "--lr-cooldown-end": Row("same"),
    "--lr-cooldown-power": Row("same"),
    "--save-frequency": Row("same"),
    "--save-most-recent": Row(
        "same",
        "a checkpoint at every epoch end; the previous one saved only for this is removed (OpenCLIP overwrites "
        "`epoch_latest.pt`); `--resume latest` loads the newest",
    ),
    "--zeroshot-frequency": Row("differs", "default 1 (OpenCLIP: 2): evaluating every epoch is cheap on the demo"),
    "--val-frequency": Row("same"),
    "--resume": Row("same", "`latest` or a checkpoint path (a DeepSpeed tag folder, not a `.pt` file)"),
    "--precision": Row(
        "differs",
        "default `auto` (from the DeepSpeed JSON; OpenCLIP: `amp`). `amp` = DeepSpeed fp16 and `amp_bf16` = "
        "DeepSpeed bf16, both with fp32 master weights; `pure_bf16`/`pure_fp16` are refused (no master-less "
        "mode): use `bf16`",
    ),
    "--model": Row(
        "differs",
        "default `demo` (OpenCLIP: `RN50`, a ResNet dsclip does not have); OpenCLIP's ViT names, from OpenCLIP's "
        "registry where dsclip ships no JSON",
    ),
    "--pretrained": Row(
        "same",
        "an OpenCLIP tag (with `--model`), `open_clip:MODEL/TAG`, `hf-hub:ORG/NAME`, a checkpoint file or a "
        "`dsclip convert` folder; the tokenizer follows the weights unless `--tokenizer`",
    ),
    "--pretrained-image": Row("not offered", "use `--pretrained` with a CLIP checkpoint"),
    "--lock-image": Row("same", _LIT),
    "--lock-image-unlocked-groups": Row(
        "differs", "OpenCLIP's groups; without `--lock-image` it is an error (OpenCLIP ignores it silently)"
    ),
    "--lock-image-freeze-bn-stats": Row("no-op", "accepted; dsclip's ViT towers have no BatchNorm statistics"),
    "--image-mean": Row(
        "differs", _pre("OpenAI mean/std", "and the built-in demo set") + "; 3 values or 1 for all channels"
    ),
    "--image-std": Row(
        "differs", _pre("OpenAI mean/std", "and the built-in demo set") + "; 3 values or 1 for all channels"
    ),
    "--image-interpolation": Row(
        "differs",
        _pre("`bicubic`", "not the built-in demo set, rendered at the model size")
        + "; as OpenCLIP, the plain training crop stays bicubic",
    ),
    "--image-resize-mode": Row(
        "differs", _pre("`shortest`", "not the built-in demo set, rendered at the model size") + "; evaluation only"
    ),
    "--aug-cfg": Row(
        "same",
        "OpenCLIP's keys and transforms (timm's `create_transform` with `use_timm=True`); an unknown key or a "
        "value of the wrong type is an error; saved in the run config (OpenCLIP's preprocess config has no "
        "augmentation); the built-in demo set is not augmented",
    ),
    "--grad-checkpointing": Row("same", "DeepSpeed activation checkpointing (configured by the JSON block)"),
    "--local-loss": Row("same", "needs `--gather-with-grad`, as the gradients are wrong without it"),
    "--gather-with-grad": Row("same"),
    "--force-context-length": Row("same", "also spelled `--context-length`"),
    "--force-image-size": Row(
        "differs", "one integer (square images); the model is rebuilt at that size, position embeddings resampled"
    ),
    "--force-quick-gelu": Row("same", "recorded in the checkpoint's model config, so `dsclip convert` keeps it"),
    "--force-patch-dropout": Row("same"),
    "--force-custom-text": Row(
        "not offered", "dsclip has one text tower; OpenCLIP checkpoints of either layout load with `--pretrained`"
    ),
    "--torchscript": Row("not offered", "export with `dsclip convert --format open_clip` and script it in OpenCLIP"),
    "--torchcompile": Row("same", "compiles every transformer block in place"),
    "--trace": Row("not offered", "export with `dsclip convert --format open_clip` and trace it in OpenCLIP"),
    "--accum-freq": Row(
        "same", "dsclip's gradient cache: gradients equal to one batch of batch × accum × world, as OpenCLIP"
    ),
    "--device": Row(
        "differs",
        "a device type checked against the DeepSpeed accelerator (default: the accelerator's; OpenCLIP: `cuda`, "
        "falling back to CPU with a warning): a mismatch or an index (`cuda:1`) is an error; each rank uses its "
        "local rank's device, so choose GPUs with the launcher",
    ),
    "--dist-url": Row("same", "torch's init_method, given to deepspeed.init_distributed (default `env://`)"),
    "--dist-backend": Row("same", "given to deepspeed.init_distributed; default nccl on CUDA, gloo otherwise"),
    "--report-to": Row(
        "same", "`tensorboard`, `wandb`, both (`tensorboard,wandb` or `all`); `metrics.jsonl` is always written"
    ),
    "--wandb-notes": Row("same"),
    "--wandb-project-name": Row("same", "the wandb run id is kept in `RUN/wandb_id`: `--resume` continues the run"),
    "--debug": Row("same", "DEBUG-level logging; a user error shows its traceback, not only the one line"),
    "--copy-codebase": Row("same", "copies the dsclip package into `RUN/code`"),
    "--horovod": Row("not offered", "DeepSpeed replaces it"),
    "--ddp-static-graph": Row("no-op", "DeepSpeed, not DDP, reduces the gradients; there is no DDP graph to fix"),
    "--no-set-device-rank": Row(
        "no-op",
        "each rank binds the device valid in its own CUDA_VISIBLE_DEVICES view: with one GPU per process (the "
        "flag's use) that is `cuda:0`, what the flag gives in OpenCLIP; with several visible, the local rank's",
    ),
    "--seed": Row("same"),
    "--grad-clip-norm": Row("same"),
    "--lock-text": Row("same", _LIT),
    "--lock-text-unlocked-layers": Row(
        "differs", "OpenCLIP's groups; without `--lock-text` it is an error (OpenCLIP ignores it silently)"
    ),
    "--lock-text-freeze-layer-norm": Row(
        "same", "as OpenCLIP's HF text towers: without it the LayerNorms of locked layers still train"
    ),
    "--log-every-n-steps": Row("same"),
    "--coca-caption-loss-weight": Row("not offered", "dsclip has no CoCa models"),
    "--coca-contrastive-loss-weight": Row("not offered", "dsclip has no CoCa models"),
    "--remote-sync": Row(
        "differs",
        "copies `--logs/NAME` to `URL/NAME/` from a background thread on rank 0: the logs every "
        "`--remote-sync-frequency` s, a checkpoint once it is complete (never one being written; `--keep-last` "
        "applies remotely too); a failing remote is one line and training goes on (OpenCLIP exits when the first "
        "sync fails); `--resume latest` with no local checkpoint downloads the newest remote one and verifies it",
    ),
    "--remote-sync-frequency": Row("same", "default 300 s; a complete checkpoint is synced at once"),
    "--remote-sync-protocol": Row(
        "differs",
        "both through fsspec: `s3` takes s3:// URLs (s3fs; OpenCLIP runs the aws CLI), `fsspec` any fsspec URL "
        "(its package installed); `--resume latest` works with both (OpenCLIP: s3 only)",
    ),
    "--delete-previous-checkpoint": Row("same", "= `--keep-last 1`"),
    "--distill-model": Row(
        "differs",
        "a frozen teacher outside the DeepSpeed engine (not trained, not checkpointed); loss = InfoNCE + "
        "OpenCLIP's distillation term, also with `--accum-freq` > 1 (OpenCLIP: 1 only) and `--local-loss`; "
        "refused with `--siglip`/`--tiled-loss`; the teacher must share the run's tokenizer and image size",
    ),
    "--distill-pretrained": Row(
        "differs",
        "as `--pretrained` (file, folder, OpenCLIP tag, `hf-hub:`); one of the two flags without the other is "
        "an error (OpenCLIP silently trains without a teacher)",
    ),
    "--use-bnb-linear": Row(
        "not offered",
        "bitsandbytes int8 layers do not combine with ZeRO partitioning; to save memory use ZeRO-3 "
        "(`--deepspeed-config zero3_bf16`, or `zero3_offload_bf16`) and `--grad-checkpointing`",
    ),
    "--siglip": Row("same", "ring-exchange sigmoid loss"),
    "--loss-dist-impl": Row(
        "differs",
        "`bidir`, `shift`, `reduce`, `gather`: each gives OpenCLIP's SigLIP loss and gradients, which dsclip's one "
        "exchange (the tiled ring) computes for all four; without `--siglip` it is an error (OpenCLIP ignores it)",
    ),
}

_AUDIO = "dsclip trains image-text CLIP models; it has no audio tower (OpenCLIP main's CLAP)"
_NAFLEX = (
    "dsclip's ViT towers take fixed-size images (one patch size and sequence length per run); NaFlex's "
    "variable resolution needs timm's NaFlexViT and its token-budget loaders, which dsclip does not have"
)
_PAD = (
    "dsclip's tokenizers pad every caption to the context length (fixed-length text, what the text tower's "
    "EOT pooling and the gradient cache's re-forward expect): there is no per-batch padding to cut"
)

# Options OpenCLIP main (4.2.dev) has and open_clip_torch 3.3.0 has not, keyed by main's first option string,
# in the order of main's parser. Their aliases are in openclip_main_options.json and share the row.
MAIN_FLAGS: dict[str, Row] = {
    "--audio-ext": Row("not offered", _AUDIO),
    "--pretrained-audio": Row("not offered", _AUDIO),
    "--audio-fill": Row("not offered", _AUDIO),
    "--audio-trunc": Row("not offered", _AUDIO),
    "--audio-fusion": Row("not offered", _AUDIO),
    "--audio-int16-normalize": Row("not offered", _AUDIO),
    "--audio-zeroshot-dataset": Row("not offered", _AUDIO),
    "--audio-zeroshot-split": Row("not offered", _AUDIO),
    "--audio-zeroshot-audio-key": Row("not offered", _AUDIO),
    "--audio-zeroshot-target-key": Row("not offered", _AUDIO),
    "--audio-zeroshot-class-key": Row("not offered", _AUDIO),
    "--audio-zeroshot-template": Row("not offered", _AUDIO),
    "--audio-zeroshot-workers": Row("not offered", _AUDIO),
    "--audio-zeroshot-multiprocessing-context": Row("not offered", _AUDIO),
    "--audio-multiprocessing-context": Row("not offered", _AUDIO),
    "--image-key": Row(
        "same",
        "`;`-separated member suffixes, the first present wins (main's order `jpg;png;jpeg;webp`); also read by "
        "`--val-data`, `dsclip eval` and `dsclip data write/inspect`; a first shard matching none stops at start-up "
        "with one line naming the suffixes found",
    ),
    "--text-key": Row(
        "differs",
        "main's suffixes, default and precedence (ignored with `--json-text-key`; an empty first member drops the "
        "sample); a member with several lines is several captions, one drawn per step (main: the whole text is one "
        "caption)",
    ),
    "--json-text-key": Row(
        "same",
        "`;`-separated fields, the first non-empty string wins, over `--text-key`; a field holding a list of strings "
        "is several captions (main: strings only)",
    ),
    "--opt-kwargs": Row(
        "not offered",
        "a `timm/NAME` optimizer gets `--lr`, `--wd`, `--beta1/--beta2/--eps` and `--momentum`; other arguments: "
        "a DeepSpeed JSON `optimizer` block (DeepSpeed's optimizers, with their `params`)",
    ),
    "--opt-fallback-list": Row(
        "not offered",
        "dsclip builds no Muon-family parameter split: a `timm/NAME` optimizer gets dsclip's weight-decay groups only",
    ),
    "--text-layer-decay": Row(
        "same", "per text group: `lr * DECAY**d`, d groups below `text_projection`; works with locking and ZeRO-1/2/3"
    ),
    "--image-layer-decay": Row(
        "same",
        "per image group, counted as main counts them; the projection keeps `--lr`; works with locking "
        "and ZeRO-1/2/3; the start-up summary shows the first and last block's lr",
    ),
    "--audio-layer-decay": Row("not offered", _AUDIO),
    "--wd-exclude": Row(
        "not offered",
        "dsclip's no-decay set is fixed (biases, norms, embeddings, logit scale/bias: the `--wd` row); "
        "there is no extra pattern list",
    ),
    "--text-pooler-own-group": Row(
        "not offered",
        "dsclip's text towers pool one token (`pool_type` argmax/eos/last/first): there is no readout pooler module "
        "to group",
    ),
    "--val-retrieval-chunk-size": Row(
        "not offered", "dsclip's retrieval metrics are always exact and chunked (1024 rows a chunk, on the device)"
    ),
    "--val-retrieval-precision": Row(
        "not offered", "dsclip gathers evaluation features in fp32 and scores them in fp32 (main's `fp32`, its default)"
    ),
    "--torchcompile-strategy": Row(
        "not offered",
        "dsclip has one strategy: `--torchcompile` compiles each transformer block in place, inside DeepSpeed's "
        "engine (main's `model`/`task`/`step` compile whole forwards or the step, which the engine owns here)",
    ),
    "--torchcompile-backend": Row(
        "differs", "default `inductor` (main: unset, torch.compile's default, which is inductor)"
    ),
    "--torchcompile-mode": Row(
        "differs",
        "`default` or `max-autotune-no-cudagraphs` (main: any mode, unset by default); CUDA-graph modes "
        "(`reduce-overhead`, `max-autotune`) are refused: the gradient cache re-forwards and ZeRO's hooks run "
        "between blocks",
    ),
    "--fsdp": Row(
        "not offered",
        "DeepSpeed ZeRO replaces FSDP2: ZeRO-3 (`--deepspeed-config zero3_bf16`) shards parameters, gradients "
        "and optimizer state; and dsclip's EMA (`--ema-decay`) is sharded under it, which main's is not with FSDP2",
    ),
    "--fsdp-no-reshard-after-forward": Row(
        "not offered",
        "ZeRO-2 (`zero2_bf16`) keeps whole parameters; under ZeRO-3 the DeepSpeed JSON's "
        "`stage3_max_reuse_distance`/`stage3_param_persistence_threshold` decide what stays gathered",
    ),
    "--fsdp-offload-cpu": Row(
        "not offered", "ZeRO-Offload: `--deepspeed-config zero3_offload_bf16` (or `offload_param` in the JSON)"
    ),
    "--fsdp-checkpoint": Row(
        "not offered",
        "dsclip's checkpoints are always sharded (DeepSpeed's per-rank files, main's `sharded`); "
        "`dsclip convert` writes the single file (main's `full`)",
    ),
    "--log-metric-every-n-steps": Row(
        "not offered",
        "TensorBoard, wandb and metrics.jsonl get scalars every `--log-every-n-steps`, the loss already the "
        "full-batch loss (mean over ranks); lower that for denser curves",
    ),
    "--train-loss-ema-samples": Row(
        "not offered",
        "the console and scalars show the loss averaged over the `--log-every-n-steps` window (full batch, mean "
        "over ranks) and the last step's (`loss_last`); no EMA of the loss is kept",
    ),
    "--use-naflex": Row("not offered", _NAFLEX),
    "--force-naflex-vision": Row("not offered", _NAFLEX),
    "--naflex-num-train-image-tokens": Row("not offered", _NAFLEX),
    "--naflex-patch-sizes": Row("not offered", _NAFLEX),
    "--naflex-patch-size-probs": Row("not offered", _NAFLEX),
    "--naflex-seq-lens": Row("not offered", _NAFLEX),
    "--naflex-seq-len-probs": Row("not offered", _NAFLEX),
    "--naflex-max-tokens-per-batch": Row("not offered", _NAFLEX),
    "--naflex-max-text-tokens": Row("not offered", _NAFLEX),
    "--naflex-batch-divisor": Row("not offered", _NAFLEX),
    "--naflex-loss-scale": Row("not offered", _NAFLEX),
    "--length-bucketing": Row("not offered", _PAD),
    "--bucket-pool": Row("not offered", _PAD),
    "--bucket-chunk": Row("not offered", _PAD),
    "--naflex-pad-multiple": Row("not offered", _AUDIO),
    "--text-pad-multiple": Row("not offered", _PAD),
}

# Options in both whose default or choices main changed: what that means for dsclip (appended to the 3.3.0 row).
MAIN_CHANGES: dict[str, str] = {
    "--dataset-type": "main adds `webdataset-audio` and `synthetic-audio`: not offered (no audio tower)",
    "--precision": "main's default is `amp_bf16`; dsclip's stays `auto`",
    "--opt": "main adds `nadamw` (torch's NAdam with decoupled weight decay): here an error, "
    "the nearest is `timm/nadamw` (timm's NAdamW)",
    "--report-to": "main adds `trackio`: not offered (tensorboard, wandb)",
}

MAIN_OPTIONS_FILE = Path(__file__).with_name("openclip_main_options.json")


@functools.lru_cache(maxsize=1)
def main_options() -> dict:
    """OpenCLIP main's parser as data (openclip_main_options.json): ``{"commit": ..., "options": [...]}``."""
    return json.loads(MAIN_OPTIONS_FILE.read_text())


def main_flags() -> dict[str, dict]:
    """Main's options keyed by their first option string, in main's order."""
    return {o["flag"]: o for o in main_options()["options"]}


def _row(flag: str) -> Row | None:
    if flag in OPENCLIP_FLAGS:
        return OPENCLIP_FLAGS[flag]
    if flag in MAIN_FLAGS:
        return MAIN_FLAGS[flag]
    for o in main_options()["options"]:  # an alias (--visual-layer-decay) shares its option's row
        if flag in o["aliases"]:
            return MAIN_FLAGS.get(o["flag"]) or OPENCLIP_FLAGS.get(o["flag"])
    return None


README_BEGIN = "<!-- compat-table: begin (python -m dsclip.compat --write-docs) -->"
README_END = "<!-- compat-table: end -->"
# the page of the user guide that holds the generated table (README.md links to it)
DOCS_PAGE = "docs/coming-from-openclip.md"


def refusal(flag: str) -> str | None:
    """The one-line refusal of an OpenCLIP option ``dsclip train`` does not accept (its table row's reason
    and replacement), or None when ``flag`` is not such an option."""
    name = flag.split("=", 1)[0]
    row = _row(name)
    if row is None or row.status not in REJECTED:
        return None
    note = row.note
    if note.startswith("see `") and note.endswith("`"):  # "--remote-sync-frequency: see `--remote-sync`"
        note = _row(note[5:-1]).note
    what = {"renamed": "named differently here", "not offered": "not offered", "planned": "not built yet"}
    return f"unknown flag {name}: OpenCLIP's option, {what[row.status]} in dsclip train: {note}".replace("`", "")


def rows() -> list[tuple[str, tuple[str, ...], str, Row]]:
    """Every row of the table: (flag, aliases, OpenCLIP versions that have it, row), in main's parser order
    with 3.3.0's options that main dropped placed after the option that precedes them in 3.3.0."""
    main = main_flags()
    order = list(main)
    prev = None
    for flag in OPENCLIP_FLAGS:
        if flag not in main:
            order.insert(order.index(prev) + 1 if prev else 0, flag)
        prev = flag
    out = []
    for flag in order:
        in_main, in_330 = flag in main, flag in OPENCLIP_FLAGS
        versions = "3.3.0, main" if in_main and in_330 else "main" if in_main else "3.3.0"
        row = OPENCLIP_FLAGS[flag] if in_330 else MAIN_FLAGS[flag]
        if flag in MAIN_CHANGES:
            row = row._replace(note=f"{row.note}; {MAIN_CHANGES[flag]}" if row.note else MAIN_CHANGES[flag])
        out.append((flag, tuple(main[flag]["aliases"]) if in_main else (), versions, row))
    return out


def counts(flags=None) -> dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for row in (OPENCLIP_FLAGS if flags is None else flags).values():
        out[row.status] += 1
    return out


def _summary(what: str, c: dict[str, int], n: int) -> str:
    accepted = sum(c[s] for s in ACCEPTED)
    return (
        f"{what}: {accepted} of {n} accepted by `dsclip train` ({c['same']} same, {c['differs']} with a different "
        f"default or detail, {c['no-op']} no-op); {c['renamed']} renamed, {c['not offered']} not offered, "
        f"{c['planned']} planned."
    )


def render_markdown() -> str:
    m = main_options()
    main = main_flags()
    in_main = {f: r for f, r in OPENCLIP_FLAGS.items() if f in main} | MAIN_FLAGS
    summary = [
        _summary("OpenCLIP 3.3.0 (open_clip_torch on PyPI)", counts(), len(OPENCLIP_FLAGS)),
        _summary(f"OpenCLIP main ({m['version']}, `{m['path']}` at {m['commit'][:7]})", counts(in_main), len(in_main)),
        _summary(f"Options new in main ({len(MAIN_FLAGS)})", counts(MAIN_FLAGS), len(MAIN_FLAGS)),
    ]
    lines = [f"- {s}" for s in summary] + ["", "| flag | OpenCLIP | status | note |", "|---|---|---|---|"]
    for flag, aliases, versions, row in rows():
        note = row.note.replace("|", "\\|")
        names = ", ".join(f"`{f}`" for f in (flag, *aliases))
        lines.append(f"| {names} | {versions} | {row.status} | {note} |")
    return "\n".join(lines)


def readme_block() -> str:
    return f"{README_BEGIN}\n{render_markdown()}\n{README_END}"


def write_readme(path: Path) -> bool:
    """Replace the table between the markers; True if the file changed."""
    text = path.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    new = text[:start] + readme_block() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsclip.compat", description="Print or write the OpenCLIP flag table.")
    p.add_argument(
        "--write-docs",
        "--write-readme",
        dest="write_docs",
        action="store_true",
        help="rewrite the table in docs/coming-from-openclip.md",
    )
    a = p.parse_args(argv)
    if a.write_docs:
        readme = Path(__file__).resolve().parents[1] / DOCS_PAGE
        print(f"{readme}: {'updated' if write_readme(readme) else 'already in sync'}")
    else:
        print(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
