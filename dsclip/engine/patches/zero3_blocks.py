"""ZeRO-3: each leaf block fetched, prefetched and released by two hooks of dsclip's, in place of DeepSpeed's four.

The shipped ZeRO-3 JSONs make each transformer block one ZeRO-3 leaf (one coalesced gather per block). On
every forward DeepSpeed still runs four hooks on each block: a forward pre-hook (its coordinator's trace
bookkeeping, a per-parameter walk of the fetch queue, the prefetch), a post-hook (the release, with a walk of
the trace for the reuse distance), and two that wrap the block's outputs and inputs in autograd functions to
learn when its backward starts and ends. With every tensor resident, so that nothing is gathered at all, those
hooks alone cost 0.29 of ZeRO-2's host time per step at ViT-H-14's depth (K = 1) and 0.34 with the gradient
cache (bench/results/zero3-resident_cpu2_2026-12-05.md): host time a GPU waits for, and no DeepSpeed setting
removes it.

This patch takes DeepSpeed's four hooks off each leaf block and gives it one forward pre-hook and one
post-hook, working per block (what DeepSpeed's leaf fetch gathers: all of the block's parameters that are not
available; what its release drops: the non-persistent ones):

- **gather**: before the block's forward, and when its backward starts (a hook on its output's gradient).
- **reduce, then release**: the block's backward has ended when the gradient of its input exists (a hook on
  that input; a block with trainable weights whose input does not require grad gets a fresh leaf input that
  does, as dsclip/engine/input_grads.py does for frozen towers). There the hook calls DeepSpeed's own
  gradient-reduction hook for the block (DeepSpeed registers it as the block's full backward hook, which
  torch would call at that same moment through autograd functions wrapped around the block's inputs and
  outputs on every forward; the patch takes it off the block and calls it itself), then releases the weights.
  The weights are also released after a forward without a graph, and after a forward with a graph unless its
  backward comes within ``stage3_max_reuse_distance`` (DeepSpeed's rule: the elements of the blocks used in
  between) or a prefetch has already reached it.
- **prefetch**: the order of block uses (forward, then backward) is recorded per kind of unit (with and
  without a graph, as dsclip's zero3_traces separates them; a unit runs from one root forward to the next, as
  DeepSpeed's trace does). Once recorded, each use starts one coalesced gather of the next blocks, up to
  ``stage3_prefetch_bucket_size`` elements, holding at most ``stage3_max_live_parameters`` gathered. A unit
  that deviates from its record stops prefetching and records again, as DeepSpeed's trace invalidation does.
- **GPU**: gathers and their waits run on DeepSpeed's all-gather stream and the compute stream waits for it
  after each block's wait, as DeepSpeed's ``fetch_sub_module`` does (tests/unit/test_zero3_blocks_rules.py
  checks the calls against a recording accelerator; the overlap itself is for a GPU run to measure).
- **nothing left behind**: at each root forward and before the optimizer step releases every parameter,
  gathers still in flight are waited for and every block gathered by these hooks is released (an exception
  in the middle of a forward leaves nothing gathered for the next one).

What is computed does not change: a block's weights are the same gathered tensors, and DeepSpeed's own
reduction hook reduces its gradients. tests/dist/test_zero3_blocks.py checks the run bit for bit against
DeepSpeed's hooks (K = 1 and 2, a frozen tower, evaluation forwards in between, small reuse and live limits,
activation checkpointing) and what each rule is for. The other modules keep DeepSpeed's hooks and coordinator.

With activation checkpointing, a block's forward recomputed inside its backward (torch's non-reentrant
checkpoint, as dsclip runs it under ZeRO-3) is told apart as DeepSpeed does (autograd's current graph task):
the block, gathered when its backward started, is only made sure of; it is neither a use nor released.

Where it does not apply, DeepSpeed's hooks stay: blocks compiled with ``--torchcompile``, parameter offload,
ZeRO++ (hpZ, quantized weights), DeepSpeed's fast leaf sharding, and frozen parameters without dsclip's
input-grad hooks (dsclip/engine/input_grads.py).
"""

from __future__ import annotations

from collections import Counter

import torch

from dsclip.engine.fingerprint import unwrap
from dsclip.engine.input_grads import input_grads_covered

NAME = "zero3_blocks"
SUMMARY = "ZeRO-3: each leaf block fetched, prefetched and released by two dsclip hooks instead of DeepSpeed's four"
# 0.19.2 is left out: there the two-rank runs with partitioned block weights did not reproduce DeepSpeed's
# gradients (tests/dist/test_zero3_blocks.py), so its fingerprints are not listed and DeepSpeed's hooks run
VERIFIED = ("0.19.8",)
STAGES = (3,)
_O = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload."
_C = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
_I = "deepspeed.runtime.zero.partition_parameters:"
TARGETS = {
    _O + "_register_deepspeed_module": frozenset({"4eede10c50d5"}),  # the four hooks taken off
    _O + "partition_all_parameters": frozenset({"b5a95f70abee"}),  # wrapped: our leftovers are settled first
    _C + "fetch_sub_module": frozenset({"77fc1f959e5d"}),  # the fetch, wait and stream rules followed
    _C + "release_sub_module": frozenset({"8b6ade55f009"}),  # the release rules followed
    # the leaf blocks' full backward hook: DeepSpeed's gradient reduction, which this patch calls itself
    "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks": frozenset(
        {"2169caabf983"}
    ),
    # what the hooks call on each parameter: ``all_gather_coalesced`` and ``partition`` are functions
    # DeepSpeed defines per parameter inside _convert_to_deepspeed_param (its fingerprint covers both), and
    # what they run; zero3_release replaces ``partition`` but hands every other case to these
    _I + "Init._convert_to_deepspeed_param": frozenset({"109d5ce0cfbc"}),
    _I + "Init._partition": frozenset({"0608009311cf"}),
    _I + "Init._partition_param": frozenset({"27e1b17a9064"}),
    _I + "free_param": frozenset({"96cebaaa6607"}),
    _I + "AllGatherCoalescedHandle.wait": frozenset({"bc6d1f20613a"}),  # the gather's handle, waited on
    _I + "MultipleAllGatherHandles.wait": frozenset({"cc6235fb305a"}),  # the same, parameters of several groups
    _C + "__init__": frozenset({"9c88f61b821b"}),  # the settings read (prefetch bucket, live, reuse, stream)
    "deepspeed.utils:z3_leaf_module": frozenset({"d9b3d0db99ba"}),  # which modules are the leaf blocks
}
_P = "_PartitionedParameterCoordinator__"  # the coordinator's name-mangled settings
DEEPSPEED_HOOKS = frozenset(
    {"_pre_forward_module_hook", "_post_forward_module_hook", "_pre_backward_module_hook", "_post_backward_module_hook"}
)
REDUCE_HOOK = "reduce_leaf_module_grads"  # DeepSpeedZeroOptimizer_Stage3.create_reduce_and_remove_grad_hooks
SETTINGS = ("prefetch_bucket_sz", "max_n_available_params", "max_reuse_dist_in_numel", "allgather_stream")


def leaf_blocks(module) -> list:
    from deepspeed.utils import z3_leaf_module

    return [m for m in module.modules() if z3_leaf_module(m)]


def deepspeed_hooks(module) -> list[tuple[dict, int]]:
    """(hook dict, id) of DeepSpeed's four per-module ZeRO-3 hooks on ``module``."""
    return [
        (hooks, hook_id)
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for hook_id, hook in hooks.items()
        if getattr(unwrap(hook), "__name__", "") in DEEPSPEED_HOOKS
    ]


def applies(engine) -> bool:
    try:
        opt = engine.optimizer
        offload = opt.parameter_offload
        coordinator = offload.param_coordinator
        modules = list(engine.module.modules())
        blocks = leaf_blocks(engine.module)
        return (
            engine.zero_optimization_stage() == 3
            and bool(blocks)
            and getattr(offload, "module", None) is engine.module
            and all(hasattr(coordinator, _P + s) for s in SETTINGS)
            and not opt.offload_param  # CPU / NVMe parameter offload: DeepSpeed swaps shards in for its fetches
            and engine.zero_hpz_partition_size() <= 1  # ZeRO++ hpZ: secondary partitions
            and not coordinator.zero_quantized_weights  # ZeRO++ qwZ: quantized gathers
            and not getattr(coordinator, "zero_quantized_nontrainable_weights", False)
            and not getattr(coordinator, "fast_sharding_for_leaf_module", False)
            and not getattr(offload, "zenflow", False)
            and not engine.is_deepcompile_enabled()  # DeepSpeed's compiler schedules the gathers itself
            # how a checkpointed block's recomputation (its forward inside the backward) is told apart
            and hasattr(torch._C, "_current_graph_task_id")
            and not any(getattr(m, "_compiled_call_impl", None) is not None for m in modules)
            # frozen parameters: every trainable block's input must require grad (its backward's end is
            # taken from that input's gradient)
            and input_grads_covered(engine.module)
            and all(len(deepspeed_hooks(b)) == 4 for b in blocks)
            # at most one full backward hook per block, DeepSpeed's gradient reduction (none on a frozen block),
            # and no backward pre-hook
            and all(
                [getattr(unwrap(h), "__name__", "") for h in b._backward_hooks.values()] in ([REDUCE_HOOK], [])
                and not b._backward_pre_hooks
                for b in blocks
            )
            and all(hasattr(p, "ds_status") for b in blocks for p in b.parameters())
            and blocks_own_their_parameters(engine.module, blocks)
        )
    except AttributeError:
        return False


def modules_inside(blocks) -> set[int]:
    """ids of the blocks and of every module inside them."""
    return {id(m) for b in blocks for m in b.modules()}


def blocks_own_their_parameters(model, blocks) -> bool:
    """No parameter of a block is also a parameter of a module outside it (tied weights): such a parameter's
    gathers and releases would have to be shared with DeepSpeed's coordinator."""
    inside = modules_inside(blocks)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return not any(
        id(p) in in_blocks
        for m in model.modules()
        if id(m) not in inside
        for p in m._parameters.values()
        if p is not None
    )


def install(engine) -> None:
    offload = engine.optimizer.parameter_offload
    hooks = BlockHooks(offload.param_coordinator, leaf_blocks(engine.module))
    for block in hooks.blocks:
        for hook_dict, hook_id in deepspeed_hooks(block):
            del hook_dict[hook_id]
        # DeepSpeed's gradient reduction for the block, called from the block's input-gradient hook (the moment
        # torch would call it) instead of through torch's wrapping of the block's inputs and outputs
        for hook_id, reduce in list(block._backward_hooks.items()):
            del block._backward_hooks[hook_id]
            hooks.blocks[block].reduce = reduce
        block.register_forward_pre_hook(hooks.before_forward)
        block.register_forward_hook(hooks.after_forward)
    # before DeepSpeed's own root pre-hook (its reset_step): a unit's leftovers are ours to settle
    engine.module.register_forward_pre_hook(hooks.start_unit, prepend=True)
    deepspeed_release_all = offload.partition_all_parameters

    def partition_all_parameters():
        hooks.settle()  # nothing of ours in flight when DeepSpeed releases (and checks) every parameter
        return deepspeed_release_all()

    offload.partition_all_parameters = partition_all_parameters
    offload.dsclip_block_hooks = hooks  # for tests and bench/


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (DeepSpeed's test for a checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class Block:
    """One leaf block: what its fetch gathers (every parameter not available, persistent ones too, as
    DeepSpeed's fetch does) and what its releases drop (the non-persistent ones)."""

    __slots__ = ("module", "params", "partitioned", "numel", "elements", "trains", "reduce")

    def __init__(self, module):
        params = list(dict.fromkeys(module.parameters()))
        self.module = module
        self.params = tuple(params)
        self.trains = any(p.requires_grad for p in params)
        self.reduce = None  # DeepSpeed's gradient-reduction hook for the block, set by install
        self.partitioned = tuple(p for p in params if not p.ds_persist)
        self.numel = sum(p.ds_numel for p in self.partitioned)  # what one gather of it moves
        self.elements = sum(p.ds_numel for p in params)  # what DeepSpeed's reuse distance counts


class Trace:
    """The order of block uses in one kind of unit: (block, is_backward) pairs, recorded once."""

    def __init__(self):
        self.uses: list[tuple[Block, bool]] = []
        self.complete = False
        self.keep: frozenset[Block] = frozenset()  # kept from forward to backward (within the reuse distance)
        self.backward_at: dict[Block, int] = {}  # index of the block's backward use

    def restart(self) -> None:
        self.__init__()

    def freeze(self, max_reuse_distance: int) -> None:
        self.complete = True
        self.backward_at = {b: i for i, (b, backward) in enumerate(self.uses) if backward}
        keep = set()
        for i, (b, backward) in enumerate(self.uses):
            j = self.backward_at.get(b, -1)
            if backward or j < i:
                continue
            # DeepSpeed's rule: the block is kept if it recurs before the uses in between reach the distance
            if sum(u.elements for u, _ in self.uses[i + 1 : j]) < max_reuse_distance:
                keep.add(b)
        self.keep = frozenset(keep)


class BlockHooks:
    def __init__(self, coordinator, modules):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self.accelerator = get_accelerator()
        self.not_available = ZeroParamStatus.NOT_AVAILABLE
        self.available = ZeroParamStatus.AVAILABLE
        self.window = getattr(coordinator, _P + "prefetch_bucket_sz")
        self.max_live = getattr(coordinator, _P + "max_n_available_params")
        self.max_reuse = getattr(coordinator, _P + "max_reuse_dist_in_numel")
        self.stream = getattr(coordinator, _P + "allgather_stream")
        self.blocks = {m: Block(m) for m in modules}
        self.traces = {True: Trace(), False: Trace()}  # by grad enabled
        self.unit: Trace | None = None  # the trace the current unit follows or records
        self.cursor = 0  # uses so far in this unit
        self.horizon = 0  # uses considered for prefetch so far in this unit
        self.deviated = False
        self.inflight: dict[Block, object] = {}  # block -> its gather's handle (a shared handle: the first
        # wait completes it, the others return at once)
        self.gathered: set[Block] = set()  # gathered or in flight by these hooks, not yet released
        self.held = 0  # their elements
        self.peak_held = 0
        self.counts: Counter = Counter()  # gathers, prefetched blocks, releases by where (tests and bench/)

    # units ---------------------------------------------------------------------------------------------------
    def start_unit(self, module, args) -> None:
        previous = self.unit
        if previous is not None:
            if not previous.complete:
                if previous.uses:
                    previous.freeze(self.max_reuse)
            elif self.deviated:
                previous.restart()  # record again
                self.counts["restarts"] += 1
        self.settle()
        self.unit = self.traces[torch.is_grad_enabled()]
        self.cursor = self.horizon = 0
        self.deviated = False

    def settle(self) -> None:
        """Release every block we hold, waiting first for its gather if still in flight (every block in flight
        is held: gather() holds it)."""
        for block in list(self.gathered):
            self.release(block, "leftover")

    # the hooks -----------------------------------------------------------------------------------------------
    def before_forward(self, module, args) -> None:
        block = self.blocks[module]
        if in_backward():
            # activation checkpointing recomputes the block's forward for its backward, which has started (and
            # gathered it): not a use of its own, no hooks (the recomputed graph's gradients never flow back)
            self.ensure(block)
            self.counts["recomputes"] += 1
            return
        self.use(block, backward=False)
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        changed = False
        if not x.requires_grad and block.trains and x.is_floating_point():
            # the block's backward must end on a gradient of its input (dsclip/engine/input_grads.py's reason):
            # a fresh leaf; the weight gradients are the same numbers
            x, changed = x.detach().requires_grad_(True), True
        if x.requires_grad:
            # the gradient of the block's input exists once the block's backward is done: reduce its gradients
            # (DeepSpeed's hook, where torch would have called it), then release its weights
            x.register_hook(lambda grad, block=block: self.backward_ended(block, grad))
        return (x, *args[1:]) if changed else None

    def after_forward(self, module, args, out) -> None:
        block = self.blocks[module]
        if in_backward():
            return  # a recomputation: the weights stay for the backward that asked for it
        if not torch.is_grad_enabled():
            self.release(block, "forward")
            return
        if not isinstance(out, torch.Tensor):
            return  # an output we cannot hook: kept for the backward, released at its end or the unit's
        if not out.requires_grad:
            self.release(block, "forward")  # no backward runs through this block
            return
        out.register_hook(lambda grad, block=block: self.backward_starts(block))
        if not self.kept_for_backward(block):
            self.release(block, "forward")

    def backward_starts(self, block: Block) -> None:
        self.use(block, backward=True)

    def backward_ended(self, block: Block, grad) -> None:
        if block.reduce is not None:
            block.reduce(block.module, (grad,), ())  # DeepSpeed's reads the block's parameters' .grad only
            self.counts["reduced"] += 1
        self.release(block, "backward")

    # fetch, prefetch, release --------------------------------------------------------------------------------
    def use(self, block: Block, backward: bool) -> None:
        trace = self.unit
        following = trace is not None and trace.complete and not self.deviated
        if trace is not None and not trace.complete:
            trace.uses.append((block, backward))
        elif following and (self.cursor >= len(trace.uses) or trace.uses[self.cursor] != (block, backward)):
            self.deviated, following = True, False
            self.counts["deviations"] += 1
        self.cursor += 1
        self.ensure(block)
        if following and self.window > 0:
            self.prefetch(trace)

    def ensure(self, block: Block) -> None:
        handle = self.inflight.pop(block, None)
        if handle is None and not any(p.ds_status is self.not_available for p in block.params):
            self.hold(block)  # if gathered by another path (DeepSpeed's GatheredParameters): ours now
            return  # already gathered: nothing to wait for
        # as DeepSpeed's fetch_sub_module: the waits (and their copy-out) on the all-gather stream, then the
        # compute stream waits for it
        with self.accelerator.stream(self.stream):
            if handle is not None:
                handle.wait()
            if any(p.ds_status is self.not_available for p in block.params):
                self.gather([block]).wait()
                self.counts["gathers"] += 1
        if not self.accelerator.resolves_data_dependency():
            self.accelerator.current_stream().wait_stream(self.stream)

    def gather(self, blocks: list[Block]):
        params = [p for b in blocks for p in b.params if p.ds_status is self.not_available]
        with self.accelerator.stream(self.stream):
            handle = params[0].all_gather_coalesced(params)
        for b in blocks:
            self.hold(b)
        return handle

    def hold(self, block: Block) -> None:
        if block not in self.gathered:
            self.gathered.add(block)
            self.held += block.numel
            self.peak_held = max(self.peak_held, self.held)

    def prefetch(self, trace: Trace) -> None:
        uses = trace.uses
        budget = min(self.window, self.max_live - self.held)
        todo, numel = [], 0
        at = max(self.horizon, self.cursor)
        while at < len(uses) and numel < budget:
            b = uses[at][0]
            if b.numel and b not in self.gathered and b not in todo:  # (numel 0: every tensor persistent)
                todo.append(b)
                numel += b.numel
            at += 1
        self.horizon = at
        if todo:
            handle = self.gather(todo)
            for b in todo:
                self.inflight[b] = handle
            self.counts["prefetched"] += len(todo)

    def kept_for_backward(self, block: Block) -> bool:
        trace = self.unit
        if trace is None or not trace.complete or self.deviated:
            return False  # DeepSpeed without a complete trace releases after every use
        return block in trace.keep or trace.backward_at.get(block, len(trace.uses)) < self.horizon

    def release(self, block: Block, where: str) -> None:
        if block not in self.gathered:
            return
        handle = self.inflight.pop(block, None)
        if handle is not None:
            handle.wait()
        for p in block.partitioned:
            # DeepSpeed's __release_param rule: a parameter some other module is using stays
            if p.ds_status is self.available and not p.ds_active_sub_modules:
                p.partition()
        self.gathered.discard(block)
        self.held -= block.numel
        self.counts["released_" + where] += 1
