"""With one data-parallel rank, ZeRO-1/2's coalesced gradient "reduction" is copies: make it one.

At the exit of ``engine.coalesce_grad_reduction()`` DeepSpeed 0.19 runs
``engine._flush_coalesced_reduction_zero12``: every parameter's gradient is copied into a reduction
bucket, the bucket is all-reduced (over one rank), copied into the partition buffer, and the
optimizer's ``step()`` then flattens the per-parameter gradients into a new flat tensor — three
full-model copies, a collective and a per-parameter Python walk through the bucket code, for a sum
over one rank (the average by a world of 1 is the identity). Measured with cProfile at world 1, K = 4,
micro-batch 8 (bench/accumulation.py's model): the flush and the flatten were ~8 % of a step's CPU
time, most of what kept the gradient cache behind OpenCLIP-style accumulation on one rank.

With one rank the partition is the whole parameter group, and the flat gradient that ``step()``
wants is the parameters' ``.grad`` laid end to end in the group's order (the layout of the flat
16-bit weights, checked below). ``install_local_flush`` replaces the engine's flush with one copy of
each ``.grad`` into a flat buffer kept across steps, handed to ``step()`` through the interface
DeepSpeed's own step reads for a pre-flattened partition (``averaged_gradients[i].flat_partition``);
the list itself holds per-parameter views of that buffer, which is what the gradient norm and
``deepspeed.utils.safe_get_full_grad`` read. Same numbers, bit for bit (tests/dist/test_local_flush.py).

Anything outside the plain case (more than one rank, offload, a separate gradient-accumulation dtype,
fp16 overflow checks, MoE, Muon, round-robin padding, a layout that is not the parameters end to end)
keeps DeepSpeed's flush.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _FlatGrads(list):
    """``averaged_gradients[i]``: per-parameter views (norm, safe_get_full_grad) + the flat partition (step)."""

    flat_partition: torch.Tensor


def _group_world(opt, i: int) -> int:
    pg = opt.real_dp_process_group[i]
    return dist.get_world_size(group=pg) if dist.is_initialized() else 1


def _layout(opt, i: int) -> list[tuple[int, int]] | None:
    """(offset, numel) of every parameter of group i in its flat 16-bit buffer, if they lie end to end."""
    params = opt.bit16_groups[i]
    flat = opt.bit16_groups_flat[i]
    if list(map(id, opt.params_in_partition[i])) != list(map(id, params)) or opt.first_offset[i] != 0:
        return None
    out, expected = [], 0
    for p in params:
        offset = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
        if offset != expected or not p.data.is_contiguous():
            return None
        out.append((offset, p.numel()))
        expected += p.numel()
    return out if expected <= int(opt.partition_size[i]) else None


def local_flush_supported(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    needed = (
        "_flush_coalesced_reduction_zero12",
        "_get_preflattened_grad_partition",
    )
    if engine.zero_optimization_stage() not in (1, 2) or not all(hasattr(engine, n) or hasattr(opt, n) for n in needed):
        return False
    try:
        plain = (
            not opt.cpu_offload
            and not opt.use_grad_accum_attribute
            and not getattr(opt, "use_separate_grad_accum", False)
            and opt.dtype != torch.float16
            and not getattr(opt, "has_moe_layers", False)
            and getattr(opt, "gradient_predivide_factor", 1.0) == 1.0
            and not any(any(pads) for pads in opt.round_robin_bit16_padding)
            and not any(getattr(p, "use_muon", False) for g in opt.bit16_groups for p in g)
        )
        return (
            plain
            and all(_group_world(opt, i) == 1 for i in range(len(opt.bit16_groups)))
            and all(_layout(opt, i) is not None for i in range(len(opt.bit16_groups)))
        )
    except AttributeError:  # another DeepSpeed optimizer class: keep its own flush
        return False


def install_local_flush(engine) -> None:
    """Replace the engine's ZeRO-1/2 coalesced flush by one copy per gradient (call only if supported)."""
    opt = engine.optimizer
    buffers, views = [], []
    for i, params in enumerate(opt.bit16_groups):
        # zeros: the alignment padding after the last parameter is never written and must stay 0
        flat = torch.zeros(int(opt.partition_size[i]), dtype=opt.dtype, device=opt.bit16_groups_flat[i].device)
        buffers.append(flat)
        views.append([flat.narrow(0, off, n).view(p.shape) for p, (off, n) in zip(params, _layout(opt, i))])

    def flush(optimizer) -> None:  # the signature of DeepSpeedEngine._flush_coalesced_reduction_zero12
        for i, params in enumerate(optimizer.bit16_groups):
            for p, v in zip(params, views[i]):
                if p.grad is None:  # unused in this step's graph: its gradient is zero
                    v.zero_()
                else:
                    v.copy_(p.grad)
                p.grad = None  # as DeepSpeed's epilogue leaves it: the gradient lives in the partition now
            grads = _FlatGrads(views[i])
            grads.flat_partition = buffers[i]
            optimizer.averaged_gradients[i] = grads

    engine._flush_coalesced_reduction_zero12 = flush
    engine._dsclip_local_flush = True
