"""The frozen teacher of ``--distill-model`` / ``--distill-pretrained`` (OpenCLIP's distillation).

OpenCLIP builds the teacher with ``create_model_and_transforms(distill_model, distill_pretrained)``, puts
it in eval mode and runs it under ``no_grad`` on the student's batch; it assumes the teacher shares the
student's tokenizer and image transforms. dsclip does the same, and checks those assumptions first
(:func:`build_teacher` raises a one-line ``ConfigError`` before any engine exists):

* the teacher's weights fit its architecture built with the run's tokenizer (vocabulary, EOS/pad ids);
* its text context holds the run's token rows, its image size is the run's;
* its embedding width may differ from the student's: only the N x N logits are compared.

Where the teacher lives, and why: outside the DeepSpeed engine, as a plain module with
``requires_grad=False``, in the run's compute dtype (bf16 under bf16), whole on every rank. Outside the
engine it is never trained (no gradient, no optimizer state) and never checkpointed (the engine saves
only its own module; the teacher is rebuilt from the two flags on resume). Under ZeRO-3 the student is
partitioned but the teacher is not, on purpose: a frozen model has no gradients or optimizer state to
shard, so the only thing ZeRO-3 could save is (1 - 1/world) of its compute-dtype weights (2 bytes per
parameter in bf16: 0.9 GB for a ViT-L/14 teacher, 2 GB for ViT-H/14) at the price of all-gathering every
teacher weight for every micro-batch, once more per step than the student's own traffic, through a
second DeepSpeed engine (collective forwards on every rank). Gathering whole is therefore what "where it
can be avoided" allows: it is avoided for everything that scales with training (gradients, optimizer
state, master weights), kept for the weights a forward needs anyway. A teacher too large for that
(ViT-bigG as a teacher of a smaller student on small GPUs) would need a ZeRO-3 inference engine; dsclip
does not build one (yet).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsclip.checkpoint.pretrained import WeightSource, load_pretrained_into, plan_pretrained, resolve_pretrained
from dsclip.config_base import ConfigError
from dsclip.losses import LossArgs
from dsclip.model import ModelArgs, create_model, get_model_config


@dataclasses.dataclass
class Teacher:
    """A frozen CLIP: ``teacher(images, tokens)`` -> the model's output dict, computed without a graph."""

    model: nn.Module
    name: str

    def to(self, device: torch.device, dtype: torch.dtype) -> Teacher:
        self.model.to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, tokens: torch.Tensor) -> dict:
        return self.model(image=images.to(next(self.model.parameters()).dtype), text=tokens)

    def describe(self) -> str:
        n = sum(p.numel() for p in self.model.parameters())
        return f"distilling from {self.name} ({n:,} params, frozen, outside the engine: not trained, not saved)"


def teacher_config(loss: LossArgs, model: ModelArgs, tokenizer) -> tuple[dict, str]:
    """(the teacher's resolved architecture, its local weights file); one-line ConfigErrors for what cannot work."""
    name, weights = loss.distill_model, loss.distill_pretrained
    what = f"--distill-model {name} --distill-pretrained {weights}"
    try:
        r = resolve_pretrained(name, weights, model.cache_dir)
        cfg = r.model_cfg if r.model_cfg is not None else get_model_config(r.model)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError; so is an unknown architecture
        raise ConfigError(f"{what}: {str(e).splitlines()[0]}") from None
    if r.quick_gelu:  # OpenAI weights, as open_clip.create_model does for the student
        cfg["quick_gelu"] = True
    # The teacher reads the run's token ids, so it pools and embeds them as the run's tokenizer defines them;
    # weights trained with another vocabulary fail the shape check below.
    cfg = create_model(
        cfg, device="meta", vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
    ).config
    try:
        plan_pretrained(WeightSource(r.path), cfg, name)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"{what}: {str(e).splitlines()[0]} (the teacher must use the run's tokenizer, as in OpenCLIP)"
        ) from None
    return cfg, r.path


def check_teacher_fits(teacher_cfg: dict, student_cfg: dict, tokenizer, name: str) -> None:
    """The teacher sees the student's images and token rows: sizes must agree (embedding widths need not)."""
    t_size, s_size = teacher_cfg["vision_cfg"]["image_size"], student_cfg["vision_cfg"]["image_size"]
    if t_size != s_size:
        raise ConfigError(
            f"--distill-model {name} takes {t_size} px images but the run trains on {s_size} px ones "
            "(--model / --force-image-size): distill from a teacher of the student's image size"
        )
    t_ctx = teacher_cfg["text_cfg"]["context_length"]
    if tokenizer.context_length > t_ctx:
        raise ConfigError(
            f"--distill-model {name} reads at most {t_ctx} tokens but the run's captions have "
            f"{tokenizer.context_length} (--context-length): use --context-length {t_ctx} or a teacher with a "
            "longer context"
        )


def build_teacher(loss: LossArgs, model: ModelArgs, tokenizer, student_cfg: dict) -> Teacher | None:
    """The frozen teacher on the CPU in fp32 (``Teacher.to`` moves it), or None without ``--distill-model``.

    Every check runs before the weights are read; each rank reads the file itself (no collective)."""
    if not loss.distill:
        return None
    cfg, weights = teacher_config(loss, model, tokenizer)
    check_teacher_fits(cfg, student_cfg, tokenizer, loss.distill_model)
    # Built on the meta device and materialised empty: every tensor is then copied from the file (the key
    # check above covers all of them; the model has no buffers), so no random init runs and no RNG is drawn.
    net = create_model(cfg, device="meta").to_empty(device="cpu")
    load_pretrained_into(net, weights)
    net.requires_grad_(False)
    net.eval()  # no dropout / patch dropout: OpenCLIP's dist_model.eval()
    return Teacher(net, loss.distill_model)
