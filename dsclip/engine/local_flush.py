"""ZeRO-1/2's coalesced gradient reduction on CPU as one flat buffer: one copy, one sum over the ranks.

At the exit of ``engine.coalesce_grad_reduction()`` DeepSpeed 0.19 runs
``engine._flush_coalesced_reduction_zero12``: every parameter's gradient is copied into a reduction
bucket, the bucket is reduced rank by rank (``dist.reduce`` per destination partition, over gloo on
CPU), copied into the partition buffer, and the optimizer's ``step()`` then flattens the per-parameter
gradients into a new flat tensor. Measured with cProfile (bench/utilisation.py's ViT-B-32 step,
micro-batch 8): at one rank the copies and the flatten were ~8 % of a gradient-cache step; at two ranks
on one host the flush, the flatten and gloo's waits were 2.1 of 6.1 CPU-s.

``install_local_flush`` replaces the flush: each ``.grad`` is copied once into a flat buffer kept
across steps and laid out like the flat 16-bit weights (parameters end to end, checked below). With
more than one rank, when every rank is on this host, that buffer is the rank's shared-memory slot
(dsclip/engine/host_shm.py) and the sum is a reduce-scatter through the slots: one barrier, then each
rank sums its own partition of every rank's buffer (``_HostExchange``); otherwise the buffer is divided
by the world size and all-reduced by the process group. This rank's partition is handed to ``step()``
through the interface DeepSpeed's own step reads for a pre-flattened partition
(``averaged_gradients[i].flat_partition``), and the list holds this partition's part of each gradient,
which is what ``deepspeed.utils.safe_get_full_grad`` reads. The gradient norm is taken over the same flat
slice (``_flat_grad_norm``; the inf/NaN check too: dsclip/engine/overflow_check.py reads
``flat_partition``), the step's re-pointing of every parameter at its slice is skipped while they
already are (``_skip_if_views_in_place``), and with the slots the weight all-gather after the step goes
through them too (``_all_gather_dp_groups``). Before the slots, DeepSpeed's shared-memory all-reduce
(``deepspeed.comm.inference_all_reduce``) summed the whole buffer on every rank, twice per step (the
gather as a sum with zeros), busy-waiting for the peer: 9.4 ms of a 0.136 CPU-s demo step at two ranks
(bench/step_profile.py). On a GPU, where only
one rank takes this path, those per-parameter loops were host time the device waited for: ViT-B-32
bf16 on an H200 went from 0.94x to 1.19x open_clip_train's samples/s (bench/README.md, "GPU").
Dividing then summing is DeepSpeed's own order (``average_tensor``), so at one and two ranks every
number is bit for bit DeepSpeed's (tests/dist/test_local_flush.py).

fp16 takes it too (its loss scale and overflow skip act on the same partition DeepSpeed's step reads;
tests/dist/test_local_flush.py, fp16 cases, with the accelerator's fp16 support mocked on CPU).
Anything outside the plain case (offload, a separate gradient-accumulation dtype,
MoE, Muon, round-robin padding, sequence parallelism, a layout that is not the parameters end to end,
more than one rank on a GPU, where NCCL's reduce-scatter is the right tool) keeps DeepSpeed's flush.
"""

from __future__ import annotations

import os
import weakref

import deepspeed.comm as ds_dist
import deepspeed.runtime.zero.stage_1_and_2 as zero12
import torch
import torch.distributed as dist
from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

from dsclip.engine.host_shm import open_host_slots


class _FlatGrads(list):
    """``averaged_gradients[i]``: per-parameter views (norm, safe_get_full_grad) + the flat partition (step)."""

    flat_partition: torch.Tensor


def _group_world(opt, i: int) -> int:
    pg = opt.real_dp_process_group[i]
    return dist.get_world_size(group=pg) if dist.is_initialized() else 1


def _group_rank(opt, i: int) -> int:
    pg = opt.real_dp_process_group[i]
    return dist.get_rank(group=pg) if dist.is_initialized() else 0


def _layout(opt, i: int) -> list[tuple[int, int]] | None:
    """(offset, numel) of every parameter of group i in its flat 16-bit buffer, if they lie end to end
    from offset 0 and DeepSpeed's view of this rank's partition is the one that layout implies."""
    params = opt.bit16_groups[i]
    flat = opt.bit16_groups_flat[i]
    out, expected = [], 0
    for p in params:
        offset = (p.data.data_ptr() - flat.data_ptr()) // flat.element_size()
        if offset != expected or not p.data.is_contiguous():
            return None
        out.append((offset, p.numel()))
        expected += p.numel()
    size, rank = int(opt.partition_size[i]), _group_rank(opt, i)
    if expected > size * _group_world(opt, i):
        return None
    fragments = _partition_fragments(out, rank * size, (rank + 1) * size)
    first_offset = fragments[0][1] - out[fragments[0][0]][0] if fragments else 0
    if [params[k] for k, _, _ in fragments] != list(opt.params_in_partition[i]) or first_offset != opt.first_offset[i]:
        return None
    return out


def _partition_fragments(layout, start: int, end: int) -> list[tuple[int, int, int]]:
    """(parameter index, flat offset, numel) of the part of each parameter inside [start, end)."""
    out = []
    for k, (off, n) in enumerate(layout):
        lo, hi = max(off, start), min(off + n, end)
        if lo < hi:
            out.append((k, lo, hi - lo))
    return out


def _all_ranks_on_this_host(world: int) -> bool:
    # The launcher's count of ranks on this host (deepspeed / torchrun / dsclip's SLURM wrappers set
    # LOCAL_SIZE) is the whole job: the shared-memory slots can reach every rank of the group.
    return os.environ.get("LOCAL_SIZE") == str(world) and dist.get_world_size() == world


# Elements per fp64 block of the gradient norm: large enough that the Python loop is negligible, small
# enough that the fp64 copy of a block stays in cache (CPU). On a GPU each block is four kernel launches
# and the host's launch rate is what bounds the step, so blocks there are 16x larger (ViT-B-32: ~10
# blocks, a 128 MiB fp64 temporary; DeepSpeed's own norm makes a per-parameter fp64 copy of each gradient).
NORM_BLOCK = 1 << 20
NORM_BLOCK_GPU = 1 << 24


def sum_of_squares_fp64(flat: torch.Tensor) -> torch.Tensor:
    """sum(x^2) of a flat tensor, every term squared and summed in float64 (DeepSpeed's norm precision)."""
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for block in flat.split(NORM_BLOCK if flat.device.type == "cpu" else NORM_BLOCK_GPU):
        total += torch.linalg.vector_norm(block.double()).square()
    return total


def _flat_grad_norm(opt, deepspeed_norm):
    """``get_grad_norm_direct`` over the flat partition: DeepSpeed's L2 norm in blocks.

    DeepSpeed's own copies every gradient to float64 (a new tensor per parameter, the size of the
    model in fp64) and takes one norm per parameter: on CPU that was 0.23 s of a ViT-B-32 step, more
    than the AdamW update itself (cProfile, bench/utilisation.py's model). The same float64 arithmetic
    over cache-sized blocks of the flat partition this flush already holds gives the same norm (the
    terms are summed in another order, in float64, then rounded to float32 as DeepSpeed does:
    tests/dist/test_local_flush.py compares the norms for equality). Other norms (inf), or gradients
    that are not this flush's, go to DeepSpeed's method.
    """

    def grad_norm(gradients, params, norm_type=2):
        flat = getattr(gradients, "flat_partition", None)
        if flat is None or float(norm_type) != 2.0:
            return deepspeed_norm(gradients, params, norm_type)
        total = sum_of_squares_fp64(flat).float()
        ds_dist.all_reduce(total, op=dist.ReduceOp.SUM, group=opt.dp_process_group)  # as DeepSpeed's
        opt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
        total = total.pow(0.5)
        mask_nan_or_inf_with_val_inplace(total, device=opt.device)
        return total

    return grad_norm


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
            and not getattr(opt, "has_moe_layers", False)
            and getattr(opt, "gradient_predivide_factor", 1.0) == 1.0
            and getattr(opt, "gradient_average", True)
            and getattr(opt, "sequence_parallel_size", 1) == 1
            and not any(any(pads) for pads in opt.round_robin_bit16_padding)
            and not any(getattr(p, "use_muon", False) for g in opt.bit16_groups for p in g)
        )
        groups = range(len(opt.bit16_groups))
        worlds = {_group_world(opt, i) for i in groups}
        # More than one rank: only on CPU, where one all-reduce of the flat buffer (shared memory) beats
        # DeepSpeed's bucketed per-partition reduces over gloo; on GPUs NCCL's reduce-scatter stays.
        on_cpu = all(opt.bit16_groups_flat[i].device.type == "cpu" for i in groups)
        return (
            plain
            and len(worlds) == 1
            and (worlds == {1} or on_cpu)
            and all(_layout(opt, i) is not None for i in groups)
        )
    except AttributeError:  # another DeepSpeed optimizer class: keep its own flush
        return False


def install_local_flush(engine) -> _HostExchange | None:
    """Replace the engine's ZeRO-1/2 coalesced flush by one copy per gradient into a flat buffer, plus
    (more than one rank) one sum over the ranks of that buffer (call only if supported). Returns the
    shared-memory exchange where the ranks use one (its ``payload`` rides on the flush's barrier)."""
    opt = engine.optimizer
    world = _group_world(opt, 0)
    group = opt.real_dp_process_group[0]
    layouts = [_layout(opt, i) for i in range(len(opt.bit16_groups))]
    sizes = [int(opt.partition_size[i]) for i in range(len(opt.bit16_groups))]
    exchange = None
    if world > 1 and _all_ranks_on_this_host(world):
        exchange = _HostExchange.open(sizes, opt.dtype, group)
    groups = []
    for i, (params, layout) in enumerate(zip(opt.bit16_groups, layouts)):
        size, rank = sizes[i], _group_rank(opt, i)
        # zeros (a new slot is zero-filled too): the alignment padding after the last parameter is never
        # written and must stay 0
        if exchange is not None:
            flat = exchange.grads(i)
        else:
            flat = torch.zeros(size * world, dtype=opt.dtype, device=opt.bit16_groups_flat[i].device)
        copy_to = [flat.narrow(0, off, n).view(p.shape) for p, (off, n) in zip(params, layout)]
        fragments = []  # what DeepSpeed's averaged_gradients holds: this partition's part of each gradient
        for k, off, n in _partition_fragments(layout, rank * size, (rank + 1) * size):
            whole = n == layout[k][1]
            fragments.append(flat.narrow(0, off, n).view(params[k].shape) if whole else flat.narrow(0, off, n))
        groups.append((flat, copy_to, fragments, flat.narrow(0, rank * size, size)))

    def flush(optimizer) -> None:  # the signature of DeepSpeedEngine._flush_coalesced_reduction_zero12
        if exchange is not None:
            exchange.before_writing_grads()
        for i, params in enumerate(optimizer.bit16_groups):
            flat, copy_to, fragments, partition = groups[i]
            dst, src = [], []
            for p, v in zip(params, copy_to):
                if p.grad is None:  # unused in this step's graph: its gradient is zero
                    v.zero_()
                else:
                    dst.append(v)
                    src.append(p.grad)
                p.grad = None  # as DeepSpeed's epilogue leaves it: the gradient lives in the partition now
            # one multi-tensor copy instead of a copy per parameter (302 kernel launches for ViT-B-32 on a GPU,
            # where the host's launch rate bounds the step: bench/README.md, "GPU")
            torch._foreach_copy_(dst, src)
            if world > 1 and exchange is None:
                # DeepSpeed's average: divide, then sum over the ranks (average_tensor); the sum of the same
                # terms, so at two ranks bit for bit DeepSpeed's result
                flat.div_(world)
                dist.all_reduce(flat, group=optimizer.real_dp_process_group[i])
            grads = _FlatGrads(fragments)
            grads.flat_partition = partition
            optimizer.averaged_gradients[i] = grads
        if exchange is not None:  # every group's partition in one exchange (one barrier)
            exchange.reduce_scatter()

    engine._flush_coalesced_reduction_zero12 = flush
    opt._update_model_bit16_weights = _skip_if_views_in_place(opt, opt._update_model_bit16_weights, layouts)
    engine._dsclip_master_aliased = world == 1 and _alias_fp32_master(opt)
    if exchange is not None:
        _HOST_GATHER[opt] = exchange
        zero12.all_gather_dp_groups = _all_gather_dp_groups
    opt.get_grad_norm_direct = _flat_grad_norm(opt, opt.get_grad_norm_direct)
    # which sum the flush does (tests and bench read it): none (one rank), shm (the host's shared-memory
    # slots), or the process group's
    engine._dsclip_local_flush = "none" if world == 1 else "shm" if exchange is not None else "process_group"
    return exchange


def _alias_fp32_master(opt) -> bool:
    """One rank, fp32 weights: make the fp32 "master" partition the model's own flat weights.

    ZeRO-1/2 keep the optimizer's fp32 partition as a copy of the 16-bit flat weights, and copy it back
    into them after every step. With fp32 weights at one rank the two are the same numbers in two
    buffers: a second copy of the model (0.6 GB for ViT-B-32) and a copy of it on every step (~0.05 CPU-s
    of a 4.4 CPU-s ViT-B-32 step; bench/README.md, "Utilisation"). Here the master tensor (the one object
    the torch optimizer and its state know) is re-pointed at the flat weights, and DeepSpeed's fragment
    links (``_hp_mapping``: what safe_get_full_fp32_param and universal checkpoints read and write) are
    rebuilt over it; the step's copy back is then a copy onto itself, which torch skips. Only before the
    first step (no optimizer state yet), and only where the two hold equal values of one dtype. At more
    ranks the master is a slice of the flat buffer, and saving it would write the whole buffer (a view
    saves its storage), so it stays a copy there."""
    masters, parts = opt.single_partition_of_fp32_groups, [g[0] for g in opt.parallel_partitioned_bit16_groups]
    if (  # (no offload here: the flat flush is not installed with it)
        opt._hp_optimizer_states_linked
        or len(opt.optimizer.state) > 0
        or any(m.dtype != p.dtype or m.shape != p.shape or m.device != p.device for m, p in zip(masters, parts))
        or not all(torch.equal(m, p) for m, p in zip(masters, parts))
    ):
        return False
    for master, part in zip(masters, parts):
        master.data = part  # same Parameter object: the torch optimizer's param_groups still hold it
    opt._link_all_hp_params()
    return True


def _skip_if_views_in_place(opt, update, layouts):
    """``_update_model_bit16_weights`` that does nothing when every parameter already is its view.

    ZeRO-1/2's step ends by re-pointing every parameter's ``.data`` at its slice of the flat 16-bit
    buffer ("TODO: we probably don't need this? just to be safe"): two views and a ``.data`` assignment
    per parameter, every step, although the all-gather wrote into that buffer in place. On a GPU that is
    host time the device waits for. The layout was checked at install (parameters end to end); the
    step skips the re-pointing while every parameter's storage still starts where its slice does (what
    DeepSpeed would set), and anything else (a checkpoint load, a ``.data`` set by someone else) takes
    DeepSpeed's method.
    """
    # byte offset of each parameter in its group's flat buffer (the buffer itself may be replaced: a load)
    byte_offsets = [
        [off * opt.bit16_groups_flat[i].element_size() for off, _ in layout] for i, layout in enumerate(layouts)
    ]

    def update_model_bit16_weights(group_index: int) -> None:
        params, offsets = opt.bit16_groups[group_index], byte_offsets[group_index]
        base = opt.bit16_groups_flat[group_index].data_ptr()
        if len(params) != len(offsets) or any(p.data_ptr() != base + o for p, o in zip(params, offsets)):
            update(group_index)

    return update_model_bit16_weights


# After step() every rank holds the update of its own partition and ZeRO-1/2 all-gather the 16-bit flat
# weights (deepspeed.runtime.utils.all_gather_dp_groups, gloo's all_gather on CPU: 0.45 CPU-s per
# ViT-B-32 step at two ranks). For the optimizers whose flush goes through the host's shared-memory slots,
# the gather does too (_HostExchange.all_gather): each rank publishes its partition, one barrier, each
# reads the others'.
_HOST_GATHER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_deepspeed_all_gather_dp_groups = zero12.all_gather_dp_groups


def _all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs):
    exchange = next((x for opt, x in _HOST_GATHER.items() if groups_flat is opt.bit16_groups_flat), None)
    if exchange is None:
        return _deepspeed_all_gather_dp_groups(groups_flat, partitioned_param_groups, dp_process_group, *args, **kwargs)
    exchange.all_gather(partitioned_param_groups)
    return None


# Elements per block of the shared-memory reduction: the block's partial sums stay in cache.
REDUCE_BLOCK = 1 << 18


class _HostExchange:
    """The flush's reduce-scatter and the step's weight all-gather through the host's shared-memory slots
    (dsclip/engine/host_shm.py): rank r's slot holds its whole gradient (every group's flat buffer end to
    end: the flush copies each ``.grad`` straight into it) and then its updated weight partitions.

    reduce-scatter: one barrier, then each rank sums its own partition of every rank's gradient, each
    divided by the world size first as DeepSpeed's average does (at two ranks bit for bit its result:
    the sum of two terms does not depend on their order), into its own slot (no other rank reads that
    part of it). all-gather: each rank copies its updated partition into its slot, one barrier, each
    copies the others' partitions into its flat weights. Each slot is written by its rank only; before a
    rank rewrites a region the others last read, a barrier must lie in between: in a step the other
    exchange's barrier is that one (flush -> gather -> flush), and where a step was skipped (overflow: no
    gather) ``before_writing_grads`` adds it.
    """

    def __init__(self, slots, sizes, group):
        self.slots, self.sizes, self.group = slots, sizes, group
        self.rank, self.world = dist.get_rank(group=group), dist.get_world_size(group=group)
        grads_total = sum(sizes) * self.world
        self.grad_offsets = [sum(sizes[:i]) * self.world for i in range(len(sizes))]
        self.weight_offsets = [grads_total + sum(sizes[:i]) for i in range(len(sizes))]
        self.term = torch.empty(min(REDUCE_BLOCK, max(sizes)), dtype=slots[0].dtype)  # one rank's share, cached
        # regions read since the last barrier: their writer must wait for one before rewriting them
        self.grads_read = self.weights_read = False
        # A small tensor the next flush sums over the ranks in place, with its barrier (an all-reduce is one):
        # the step's reported loss, without a collective of its own (dsclip/train/gradcache.py). The flush
        # sets it back to None, which tells the owner it was summed.
        self.payload: torch.Tensor | None = None

    @classmethod
    def open(cls, sizes: list[int], dtype: torch.dtype, group) -> _HostExchange | None:
        """Collective: the slots for partitions of ``sizes`` (None where the host cannot give them)."""
        world = dist.get_world_size(group=group)
        slots = open_host_slots(sum(sizes) * (world + 1), dtype, group)  # every gradient + this rank's weights
        return None if slots is None else cls(slots, sizes, group)

    def grads(self, i: int) -> torch.Tensor:
        """This rank's flat gradient buffer of group i, in its slot."""
        return self.slots[self.rank].narrow(0, self.grad_offsets[i], self.sizes[i] * self.world)

    def _barrier(self, payload: torch.Tensor | None = None) -> None:
        if payload is None:
            dist.barrier(group=self.group)
        else:  # every rank waits for every other inside it: a barrier that also sums
            dist.all_reduce(payload, group=self.group)
        self.grads_read = self.weights_read = False

    def before_writing_grads(self) -> None:
        if self.grads_read:
            self._barrier()

    def reduce_scatter(self) -> None:
        payload, self.payload = self.payload, None
        self._barrier(payload)  # every rank's gradients are in its slot
        world, rank, own = self.world, self.rank, self.slots[self.rank]
        for i, size in enumerate(self.sizes):
            start = self.grad_offsets[i] + rank * size
            for lo in range(0, size, REDUCE_BLOCK):
                n = min(REDUCE_BLOCK, size - lo)
                acc, term = own.narrow(0, start + lo, n), self.term[:n]
                acc.div_(world)  # in place: no other rank reads this rank's own partition of its slot
                for r in range(world):
                    if r != rank:
                        torch.div(self.slots[r].narrow(0, start + lo, n), world, out=term)
                        acc.add_(term)
        self.grads_read = True

    def all_gather(self, partitioned_param_groups) -> None:
        if self.weights_read:
            self._barrier()
        rank, own = self.rank, self.slots[self.rank]
        for i, parts in enumerate(partitioned_param_groups):
            own.narrow(0, self.weight_offsets[i], self.sizes[i]).copy_(parts[rank])
        self._barrier()  # every rank's updated partition is in its slot
        for i, parts in enumerate(partitioned_param_groups):
            for r, part in enumerate(parts):
                if r != rank:
                    part.copy_(self.slots[r].narrow(0, self.weight_offsets[i], self.sizes[i]))
        self.weights_read = True
