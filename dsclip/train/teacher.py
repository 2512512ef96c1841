"""The frozen teacher of ``--distill-model`` / ``--distill-pretrained`` (OpenCLIP's distillation).

OpenCLIP builds the teacher with ``create_model_and_transforms(distill_model, distill_pretrained)``, puts
it in eval mode and runs it under ``no_grad`` on the student's batch; it assumes the teacher shares the
student's tokenizer and image transforms. dsclip does the same, and checks those assumptions first
(:func:`plan_teacher` raises a one-line ``ConfigError`` before any engine exists and reads no weights):

* the teacher's weights fit its architecture built with the run's tokenizer (vocabulary, EOS/pad ids);
* its text context holds the run's token rows, its image size is the run's;
* its embedding width may differ from the student's: only the N x N logits are compared.

Where the teacher lives, and why: outside the student's DeepSpeed engine, with ``requires_grad=False``,
in the run's compute dtype (bf16 under bf16). Outside that engine it is never trained (no gradient, no
optimizer state, no master weights) and never checkpointed (the engine saves only its own module; the
teacher is rebuilt from the two flags on resume).

* ZeRO-0/1/2: a plain module, whole on every rank. Those stages replicate the student's weights on every
  rank too; a frozen model has no gradients or optimizer state to shard, so there is nothing left that
  partitioning could save without a per-micro-batch all-gather the run did not ask for.
* ZeRO-3: partitioned like the student, in a forward-only ZeRO-3 engine of its own
  (``dsclip.engine.frozen``): each rank holds 1/world of the teacher's weights and its forward gathers
  one layer at a time. This is the "not gathered whole on every rank" the issue asks for: the price is
  an all-gather of the teacher's weights per micro-batch (the same traffic as one student forward).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsclip.checkpoint.pretrained import WeightSource, load_pretrained_into, plan_pretrained, resolve_pretrained
from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import zero_stage
from dsclip.engine.frozen import build_frozen_zero3
from dsclip.losses import LossArgs
from dsclip.model import ModelArgs, create_model, get_model_config


@dataclasses.dataclass
class Teacher:
    """A frozen CLIP: ``teacher(images, tokens)`` -> the model's output dict, computed without a graph.

    ``model`` is a plain module or (ZeRO-3) a forward-only DeepSpeed engine around one."""

    model: nn.Module
    name: str
    partitioned: bool = False

    def to(self, device: torch.device, dtype: torch.dtype) -> Teacher:
        if not self.partitioned:  # a ZeRO-3 engine already placed and cast its partitions
            self.model.to(device=device, dtype=dtype)
        return self

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, tokens: torch.Tensor) -> dict:
        return self.model(image=images.to(next(self.model.parameters()).dtype), text=tokens)

    def describe(self) -> str:
        n = sum(getattr(p, "ds_numel", p.numel()) for p in self.model.parameters())
        where = "partitioned by ZeRO-3 in a forward-only engine" if self.partitioned else "whole on every rank"
        return (
            f"distilling from {self.name} ({n:,} params, frozen, {where}; "
            "outside the student's engine: not trained, not saved)"
        )


@dataclasses.dataclass
class TeacherPlan:
    """A checked teacher (architecture, weights file), built later by :meth:`build` once the engine exists."""

    name: str
    config: dict
    weights: str

    def build(self, ds_config: dict | None = None) -> Teacher:
        """ZeRO-3 (``ds_config`` of stage 3): partitioned in a forward-only engine, collective; otherwise a
        plain module on the CPU in fp32 (``Teacher.to`` moves it) that each rank reads on its own."""
        if ds_config is not None and zero_stage(ds_config) == 3:
            engine = build_frozen_zero3(
                ds_config, lambda: create_model(self.config), lambda m: load_pretrained_into(m, self.weights)
            )
            return Teacher(engine, self.name, partitioned=True)
        # Built on the meta device and materialised empty: every tensor is then copied from the file (the key
        # check covered all of them; the model has no buffers), so no random init runs and no RNG is drawn.
        net = create_model(self.config, device="meta").to_empty(device="cpu")
        load_pretrained_into(net, self.weights)
        net.requires_grad_(False)
        net.eval()  # no dropout / patch dropout: OpenCLIP's dist_model.eval()
        return Teacher(net, self.name)


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


def plan_teacher(loss: LossArgs, model: ModelArgs, tokenizer, student_cfg: dict) -> TeacherPlan | None:
    """Every teacher check, before any work (no weights read); None without ``--distill-model``."""
    if not loss.distill:
        return None
    cfg, weights = teacher_config(loss, model, tokenizer)
    check_teacher_fits(cfg, student_cfg, tokenizer, loss.distill_model)
    return TeacherPlan(loss.distill_model, cfg, weights)


def build_teacher(loss: LossArgs, model: ModelArgs, tokenizer, student_cfg: dict) -> Teacher | None:
    """:func:`plan_teacher` then a plain (not partitioned) teacher on the CPU."""
    plan = plan_teacher(loss, model, tokenizer, student_cfg)
    return None if plan is None else plan.build()
