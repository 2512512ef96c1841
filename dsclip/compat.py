"""Every open_clip_train option and what `dsclip train` does with it: the one table.

dsclip promises that an OpenCLIP command line works after changing the program name (and adding
``--deepspeed-config``). This table is the honest record of where that holds. Each OpenCLIP option
(``open_clip_train/params.py``, open_clip_torch 3.3.0) has exactly one row:

- accepted by ``dsclip train`` under the same name:
  ``same`` (OpenCLIP's meaning and default), ``differs`` (OpenCLIP's meaning, but the default or a
  detail differs: the note says which), ``no-op`` (accepted so command lines keep working; the note
  says why nothing needs doing);
- not accepted (``dsclip train`` rejects it as an unknown flag): ``renamed`` (the note names
  dsclip's flag), ``not offered`` (the note says why and what to use instead), ``planned`` (not built
  yet; the note names the issue item).

tests/unit/test_compat.py reads OpenCLIP's own parser and fails for an option missing here, for a
row whose status does not match what ``dsclip train`` accepts, and when README's "Coming from
OpenCLIP" table is not :func:`render_markdown`'s output (``python -m dsclip.compat --write-readme``
rewrites it).
"""

from __future__ import annotations

import argparse
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

# Keyed by OpenCLIP's flag, in the order of OpenCLIP's parser.
OPENCLIP_FLAGS: dict[str, Row] = {
    "--train-data": Row("same", "webdataset shards with brace expansion and `::` sources, or a CSV/TSV file"),
    "--train-data-upsampling-factors": Row("same"),
    "--val-data": Row("same"),
    "--train-num-samples": Row("same"),
    "--val-num-samples": Row("same", "caps the retrieval validation set"),
    "--dataset-type": Row(
        "differs",
        "`auto`, `webdataset`, `csv` as OpenCLIP, plus `demo` (built-in learnable set); `synthetic` is planned "
        "(issue 15 item 6)",
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
    "--imagenet-v2": Row("planned", "issue 15 item 6; use `--zeroshot-data DIR` meanwhile"),
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
        "same", "passed to a DeepSpeed-JSON optimizer that takes it; with AdamW (the default) it is an error"
    ),
    "--warmup": Row("same"),
    "--opt": Row(
        "not offered",
        "dsclip trains with AdamW, or the DeepSpeed JSON's `optimizer` block (Adam, Lamb, OneBitAdam, ...)",
    ),
    "--use-bn-sync": Row("not offered", "dsclip's towers are ViTs: no BatchNorm to synchronise"),
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
    "--model": Row("differs", "default `demo` (OpenCLIP: `RN50`, a ResNet dsclip does not have)"),
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
    "--image-mean": Row("planned", "issue 15 item 2"),
    "--image-std": Row("planned", "issue 15 item 2"),
    "--image-interpolation": Row("planned", "issue 15 item 2"),
    "--image-resize-mode": Row("planned", "issue 15 item 2"),
    "--aug-cfg": Row("planned", "issue 15 item 2"),
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
        "not offered", "the DeepSpeed accelerator picks the device per local rank; choose GPUs with the launcher"
    ),
    "--dist-url": Row("not offered", "the launcher (deepspeed, torchrun, srun) sets the rendezvous in the environment"),
    "--dist-backend": Row("not offered", "DeepSpeed picks nccl on GPUs and gloo on CPUs"),
    "--report-to": Row(
        "same", "`tensorboard`, `wandb`, both (`tensorboard,wandb` or `all`); `metrics.jsonl` is always written"
    ),
    "--wandb-notes": Row("same"),
    "--wandb-project-name": Row("same", "the wandb run id is kept in `RUN/wandb_id`: `--resume` continues the run"),
    "--debug": Row("same", "DEBUG-level logging"),
    "--copy-codebase": Row("same", "copies the dsclip package into `RUN/code`"),
    "--horovod": Row("not offered", "DeepSpeed replaces it"),
    "--ddp-static-graph": Row("no-op", "DeepSpeed, not DDP, reduces the gradients; there is no DDP graph to fix"),
    "--no-set-device-rank": Row(
        "not offered",
        "each rank binds the device valid in its own CUDA_VISIBLE_DEVICES view (one GPU per task works)",
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
        "not offered",
        "put `--logs` on shared storage or sync it with your own tool; checkpoints appear atomically "
        "(`checkpoints/latest` is written last)",
    ),
    "--remote-sync-frequency": Row("not offered", "see `--remote-sync`"),
    "--remote-sync-protocol": Row("not offered", "see `--remote-sync`"),
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
    "--use-bnb-linear": Row("not offered", "bitsandbytes int8 layers do not combine with ZeRO partitioning"),
    "--siglip": Row("same", "ring-exchange sigmoid loss"),
    "--loss-dist-impl": Row(
        "not offered", "dsclip picks the exchange from the loss: `--local-loss`, `--tiled-loss` (ring), `--siglip`"
    ),
}

README_BEGIN = "<!-- compat-table: begin (python -m dsclip.compat --write-readme) -->"
README_END = "<!-- compat-table: end -->"


def counts() -> dict[str, int]:
    out = {s: 0 for s in STATUSES}
    for row in OPENCLIP_FLAGS.values():
        out[row.status] += 1
    return out


def render_markdown() -> str:
    c = counts()
    accepted = sum(c[s] for s in ACCEPTED)
    summary = (
        f"{accepted} of OpenCLIP's {len(OPENCLIP_FLAGS)} training options are accepted by `dsclip train` "
        f"({c['same']} same, {c['differs']} with a different default or detail, {c['no-op']} no-op); "
        f"{c['renamed']} renamed, {c['not offered']} not offered, {c['planned']} planned."
    )
    lines = [summary, "", "| flag | status | note |", "|---|---|---|"]
    for flag, row in OPENCLIP_FLAGS.items():
        note = row.note.replace("|", "\\|")
        lines.append(f"| `{flag}` | {row.status} | {note} |")
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
    p.add_argument("--write-readme", action="store_true", help="rewrite README.md's 'Coming from OpenCLIP' table")
    a = p.parse_args(argv)
    if a.write_readme:
        readme = Path(__file__).resolve().parents[1] / "README.md"
        print(f"{readme}: {'updated' if write_readme(readme) else 'already in sync'}")
    else:
        print(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
