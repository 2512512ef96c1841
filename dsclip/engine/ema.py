"""EMA of the weights, sharded as the fp32 master weights are: each rank averages only the partition it owns.

``--ema-decay D`` keeps ``ema <- ema + (1 - D) * (master - ema)`` (one ``torch._foreach_lerp_`` over this
rank's flat fp32 partitions) after every optimizer step that was applied; a skipped step (fp16 overflow,
non-finite features: ``StepResult.applied`` False) leaves it as it was. Until step ``--ema-start-step`` the
EMA copies the weights instead (timm's ``ModelEmaV3`` ``update_after_step``: decay 0 until then).

Where the partition lives, read in DeepSpeed 0.19.8's source:

- ZeRO-1/2 (``DeepSpeedZeroOptimizer``): ``single_partition_of_fp32_groups[i]``, this rank's slice
  ``[rank * partition_size, (rank + 1) * partition_size)`` of ``bit16_groups_flat[i]``; each parameter is a
  view into that flat buffer (its offset: the difference of the data pointers).
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): ``fp32_partitioned_groups_flat[i]``, the concatenation of the
  ``ds_tensor`` partitions of ``fp16_groups[i]`` in order; parameter ``p`` owns its elements
  ``[rank * partition_numel, ...)``, the last rank's share cut at ``ds_numel``.
- bf16 with ZeRO-0/1 (``BF16_Optimizer``): ``fp32_groups_flat_partition[i]``, the slice of
  ``bf16_groups_flat[i]`` as for ZeRO-1/2.
- bf16/fp16 without ZeRO (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``): refused in one line (a run with
  the EMA hung there; ZeRO-1 costs nothing more than ZeRO-0 in memory).
- fp32 without ZeRO: the parameters themselves are the master weights (not sharded).

Memory: 4 bytes per trainable parameter / world (ZeRO-1/2/3), where the master partition is (GPU, or host
memory under ZeRO-Offload). No gather and no communication per step. ``segments`` maps each rank's flat
EMA back to parameter names, so ``dsclip convert --ema`` reassembles the full weights from the rank files
without DeepSpeed, ``gather_full`` does the same in a running job (collective), and a resume on another
number of ranks cuts each rank's new share out of all the saved files (``load_resharded``).

OpenCLIP main has no EMA flag: ``TrainingTask.setup_ema(decay=0.9999)`` builds a timm ``ModelEmaV3`` of the
whole model on every rank (and asserts it is not combined with FSDP2); timm's own trainer spells it
``--model-ema --model-ema-decay``. dsclip's names are ``--ema-decay`` / ``--ema-start-step`` / ``--eval-ema``.
"""

from __future__ import annotations

import contextlib
from contextlib import nullcontext

import torch

Segment = tuple[str, int, int, int, int]  # (parameter name, first element in it, length, EMA tensor, offset there)
STATE_VERSION = 1


def _ptr_offset(p: torch.Tensor, flat: torch.Tensor) -> int:
    return (p.data_ptr() - flat.data_ptr()) // p.element_size()


def master_layout(engine, names: dict[int, str]) -> tuple[list[torch.Tensor], list[Segment], str]:
    """(this rank's fp32 master tensors, their segments, the kind of optimizer) of a built engine."""
    opt = engine.optimizer
    kind = type(opt).__name__
    segments: list[Segment] = []
    if hasattr(opt, "fp32_partitioned_groups_flat"):  # ZeRO-3
        rank = torch.distributed.get_rank(group=opt.dp_process_group) if opt.dp_process_group else 0
        masters = list(opt.fp32_partitioned_groups_flat)
        for i, params in enumerate(opt.fp16_groups):
            off = 0
            for p in params:
                pn = p.partition_numel()
                first = rank * pn
                length = max(0, min(pn, p.ds_numel - first))
                if length:
                    segments.append((names[id(p)], first, length, i, off))
                off += pn
        return masters, segments, kind
    if hasattr(opt, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        masters, groups, flats = list(opt.single_partition_of_fp32_groups), opt.bit16_groups, opt.bit16_groups_flat
        world = [torch.distributed.get_world_size(group=g) for g in opt.real_dp_process_group]
    elif hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer (bf16, ZeRO-0/1)
        masters, groups, flats = list(opt.fp32_groups_flat_partition), opt.bf16_groups, opt.bf16_groups_flat
        world = [torch.distributed.get_world_size(group=g) for g in opt.real_dp_process_group]
    else:  # no ZeRO, fp32: the parameters are the master weights
        masters = [p for g in opt.param_groups for p in g["params"]]
        if any(id(p) not in names for p in masters):  # a wrapper whose master layout is not read above
            raise ValueError(
                f"--ema-decay with DeepSpeed's {kind} (bf16/fp16 without ZeRO) is not supported: use ZeRO-1/2/3 "
                "(e.g. --deepspeed-config zero2_bf16)"
            )
        return masters, [(names[id(p)], 0, p.numel(), i, 0) for i, p in enumerate(masters)], kind
    for i, (params, flat) in enumerate(zip(groups, flats)):
        psize = flat.numel() // world[i]
        lo = torch.distributed.get_rank(group=opt.real_dp_process_group[i]) * psize
        for p in params:
            o = _ptr_offset(p, flat)
            start, end = max(o, lo), min(o + p.numel(), lo + psize)
            if end > start:
                segments.append((names[id(p)], start - o, end - start, i, start - lo))
    return masters, segments, kind


class ShardedEMA:
    """The EMA of this rank's fp32 master partition (see the module docstring)."""

    def __init__(self, engine, decay: float, start_step: int = 0):
        self.engine, self.decay, self.start_step = engine, decay, start_step
        names = {id(p): n for n, p in engine.module.named_parameters()}
        masters, self.segments, self.kind = master_layout(engine, names)
        self.shapes = {
            n: list(getattr(p, "ds_shape", p.shape)) for n, p in engine.module.named_parameters() if p.requires_grad
        }
        self.ema = [m.detach().clone(memory_format=torch.contiguous_format) for m in masters]
        self.step = 0  # the optimizer step the EMA last took in

    def masters(self) -> list[torch.Tensor]:
        # fetched at every use: a checkpoint load may re-seat DeepSpeed's partitions
        return master_layout(self.engine, {id(p): n for n, p in self.engine.module.named_parameters()})[0]

    @torch.no_grad()
    def restart(self) -> None:
        """The EMA := the master weights as they are now (a resume whose checkpoint holds no usable EMA)."""
        torch._foreach_copy_(self.ema, [m.detach() for m in self.masters()])

    @torch.no_grad()
    def update(self, step: int, applied: bool) -> bool:
        """After optimizer step ``step`` (1-based); a step that was not applied changes nothing."""
        if not applied:
            return False
        masters = [m.detach() for m in self.masters()]
        if step <= self.start_step:
            torch._foreach_copy_(self.ema, masters)
        else:
            torch._foreach_lerp_(self.ema, masters, 1.0 - self.decay)  # ema += (1 - D) (w - ema), one fused op
        self.step = step
        return True

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ema)

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "decay": self.decay,
            "start_step": self.start_step,
            "step": self.step,
            "kind": self.kind,
            "ema": [t.detach().cpu() for t in self.ema],
            "segments": list(self.segments),
            "shapes": self.shapes,
        }

    def load_state_dict(self, state: dict) -> None:
        """Bit for bit, onto the same layout (same model, groups, world size); anything else is refused."""
        saved = [tuple(s) for s in state["segments"]]
        if saved != list(self.segments) or [t.numel() for t in state["ema"]] != [t.numel() for t in self.ema]:
            raise ValueError(
                "the checkpoint's EMA was saved with another parameter layout (world size, ZeRO stage, locking or "
                "layer-decay groups differ); resume with the same settings, or without --ema-decay"
            )
        with torch.no_grad():
            for dst, src in zip(self.ema, state["ema"]):
                dst.copy_(src)
        self.step = int(state["step"])

    def load_resharded(self, states: list[dict]) -> None:
        """A checkpoint saved on another number of ranks (every rank's state, read from the shared tag): the
        full EMA is reassembled by parameter name and this rank copies out the elements its new partition
        owns, so the values are the saved ones bit for bit. Transiently one full fp32 copy in host memory."""
        full = {n: t.reshape(-1) for n, t in assemble(states).items()}
        missing = sorted({name for name, *_ in self.segments} - set(full))
        if missing:
            raise ValueError(
                f"the checkpoint's EMA has no {missing[0]} (it was trained with other locking); resume with the "
                "checkpoint's --lock-* flags, or without --ema-decay"
            )
        with torch.no_grad():
            for name, first, length, i, off in self.segments:
                self.ema[i][off : off + length].copy_(full[name][first : first + length])
        self.step = int(states[0]["step"])

    def gather_full(self) -> dict[str, torch.Tensor]:
        """The full EMA weights by parameter name on every rank (collective over the data-parallel world)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return assemble([self.state_dict()])
        states = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(states, self.state_dict())
        return assemble(states)


@contextlib.contextmanager
def swapped_into(ema: ShardedEMA):
    """``--eval-ema``: the module holds the EMA weights inside the block, its own weights again after it
    (collective: the EMA is gathered, and under ZeRO-3 each parameter is written through
    ``GatheredParameters``, which re-partitions it, persisted small parameters included). Costs one gather
    of the EMA per evaluation, never per step."""
    import deepspeed

    full = ema.gather_full()
    params = [(n, p) for n, p in ema.engine.module.named_parameters() if n in full]
    saved: dict[str, torch.Tensor] = {}

    def write(values: dict[str, torch.Tensor], keep: bool) -> None:
        for name, p in params:
            ctx = deepspeed.zero.GatheredParameters([p], modifier_rank=0) if hasattr(p, "ds_id") else nullcontext()
            with torch.no_grad(), ctx:
                if keep:
                    saved[name] = p.detach().clone()
                p.data.copy_(values[name].view(p.shape))

    write(full, keep=True)
    try:
        yield
    finally:
        write(saved, keep=False)


def assemble(states: list[dict]) -> dict[str, torch.Tensor]:
    """Full fp32 EMA tensors from every rank's :meth:`ShardedEMA.state_dict` (offline: ``dsclip convert --ema``)."""
    shapes = states[0]["shapes"]
    flat = {n: torch.zeros(int(torch.Size(s).numel()), dtype=torch.float32) for n, s in shapes.items()}
    covered = dict.fromkeys(flat, 0)
    for st in states:
        for name, first, length, i, off in st["segments"]:
            flat[name][first : first + length] = st["ema"][i][off : off + length].float()
            covered[name] += length
    missing = [n for n, c in covered.items() if c != flat[n].numel()]
    if missing:
        raise ValueError(f"EMA shards cover {missing[0]} only partly: a rank's EMA file is missing")
    return {n: t.view(shapes[n]) for n, t in flat.items()}
