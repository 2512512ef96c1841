"""zero3_blocks' rules (dsclip/engine/patches/zero3_blocks.py) on a chain of blocks with stand-in ZeRO-3
parameters and a recording accelerator, one process: when each block is gathered, prefetched, waited for
and released, and which stream each call runs on. The stream calls are GPU-only in a real run (on CPU
DeepSpeed's accelerator has no streams); here the accelerator is mocked at that boundary and records them.
tests/dist/test_zero3_blocks.py runs the same hooks in a real two-rank ZeRO-3 engine against DeepSpeed's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

pytest.importorskip("deepspeed")

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

from dsclip.engine.patches import zero3_blocks  # noqa: E402

NA, INFLIGHT, AVAILABLE = ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.INFLIGHT, ZeroParamStatus.AVAILABLE
WIDTH = 4
NUMEL = WIDTH * WIDTH + WIDTH  # one block's gathered elements (its Linear's weight and bias)


class Recorder:
    """The accelerator boundary: which calls ran, in order, and on which stream."""

    def __init__(self):
        self.log: list[tuple] = []
        self.stream_now = "compute"

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.stream_now = self.stream_now, stream
        try:
            yield
        finally:
            self.stream_now = before

    def resolves_data_dependency(self):
        return False

    def current_stream(self):
        recorder = self

        class Current:
            def wait_stream(self, other):
                recorder.log.append(("wait_stream", recorder.stream_now, other))

        return Current()


class Handle:
    def __init__(self, params, recorder):
        self.params, self.recorder, self.done = params, recorder, False

    def wait(self):
        if not self.done:
            self.done = True
            self.recorder.log.append(("wait", self.recorder.stream_now))
            for p in self.params:
                p.ds_status = AVAILABLE


def make_chain(n, recorder):
    blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))
    for i, block in enumerate(blocks):
        for p in block.parameters():
            p.ds_status, p.ds_persist, p.ds_numel, p.block_index = NA, False, p.numel(), i
            p.ds_active_sub_modules = set()

            def gather(params, p=p):
                params = list(params)
                recorder.log.append(("gather", recorder.stream_now, tuple(sorted({q.block_index for q in params}))))
                for q in params:
                    assert q.ds_status is NA
                    q.ds_status = INFLIGHT
                return Handle(params, recorder)

            def partition(p=p):
                assert p.ds_status is AVAILABLE
                p.ds_status = NA
                recorder.log.append(("release", p.block_index))

            p.all_gather_coalesced, p.partition = gather, partition
    return blocks


class Coordinator:  # the four settings zero3_blocks reads from DeepSpeed's coordinator
    def __init__(self, window, max_live, max_reuse):
        p = zero3_blocks._P
        setattr(self, p + "prefetch_bucket_sz", window)
        setattr(self, p + "max_n_available_params", max_live)
        setattr(self, p + "max_reuse_dist_in_numel", max_reuse)
        setattr(self, p + "allgather_stream", "allgather")


def hooked(n, window, max_live=10**9, max_reuse=10**9):
    recorder = Recorder()
    blocks = make_chain(n, recorder)
    hooks = zero3_blocks.BlockHooks(Coordinator(window, max_live, max_reuse), list(blocks))
    hooks.accelerator = recorder
    for block in blocks:
        block.register_forward_pre_hook(hooks.before_forward)
        block.register_forward_hook(hooks.after_forward)
    return blocks, hooks, recorder


def unit(blocks, hooks, grad=True):
    """One unit as a root forward starts it: the chain's forward and, with grad, its backward."""
    with torch.set_grad_enabled(grad):
        hooks.start_unit(None, ())
        x = torch.randn(2, WIDTH, requires_grad=grad)
        for block in blocks:
            x = block(x)
        if grad:
            x.sum().backward()


def released_blocks(log):
    return sorted({e[1] for e in log if e[0] == "release"})


def gathered_blocks(log):
    return [e[2] for e in log if e[0] == "gather"]


def test_recording_unit_gathers_each_use_and_releases_after_each_as_deepspeed_does_without_a_trace():
    blocks, hooks, rec = hooked(4, window=10**9)
    unit(blocks, hooks)
    # no trace yet: nothing prefetched, each block gathered for its forward and again for its backward
    assert gathered_blocks(rec.log) == [(0,), (1,), (2,), (3,), (3,), (2,), (1,), (0,)]
    assert hooks.counts["prefetched"] == 0
    assert hooks.counts["released_forward"] == 4 and hooks.counts["released_backward"] == 4
    assert not hooks.gathered and hooks.held == 0
    # every gather and every wait ran on the all-gather stream; the compute stream waited for it after each
    assert all(e[1] == "allgather" for e in rec.log if e[0] in ("gather", "wait"))
    waits = [i for i, e in enumerate(rec.log) if e[0] == "wait"]
    assert len(waits) == 8 and all(rec.log[i + 1] == ("wait_stream", "compute", "allgather") for i in waits)


def test_complete_trace_prefetches_within_the_window_and_keeps_blocks_for_their_backward():
    blocks, hooks, rec = hooked(4, window=2 * NUMEL)
    unit(blocks, hooks)  # records
    rec.log.clear()
    unit(blocks, hooks)  # follows the record
    # block 0 on demand, then two blocks per prefetch; the backward finds every block still gathered
    # (the reuse distance is large: DeepSpeed's rule keeps them from forward to backward)
    assert gathered_blocks(rec.log) == [(0,), (1, 2), (3,)]
    assert hooks.counts["released_forward"] == 4  # the recording unit's only
    assert released_blocks(rec.log) == [0, 1, 2, 3] and hooks.counts["released_backward"] == 8
    assert hooks.counts["deviations"] == 0 and not hooks.gathered
    # a prefetched block's wait too: on the all-gather stream, the compute stream waiting for it after
    waits = [i for i, e in enumerate(rec.log) if e[0] == "wait"]
    assert len(waits) == 3 and all(rec.log[i] == ("wait", "allgather") for i in waits)
    assert all(rec.log[i + 1] == ("wait_stream", "compute", "allgather") for i in waits)


def test_a_small_reuse_distance_releases_after_the_forward_and_prefetches_for_the_backward():
    blocks, hooks, rec = hooked(4, window=NUMEL, max_reuse=3 * NUMEL)
    unit(blocks, hooks)
    rec.log.clear()
    hooks.start_unit(None, ())
    x = torch.randn(2, WIDTH, requires_grad=True)
    for block in blocks:
        x = block(x)
    # block i's backward comes after the uses of 2 * (3 - i) blocks: kept from forward to backward only where
    # that is below the distance (blocks 2 and 3, as DeepSpeed's rule keeps them); 0 and 1 are released
    assert released_blocks(rec.log) == [0, 1]
    assert [i for i, b in enumerate(blocks) if all(p.ds_status is AVAILABLE for p in b.parameters())] == [2, 3]
    x.sum().backward()
    # ... and gathered again for their backward: block 1 by a prefetch at block 2's backward, block 0 at 1's
    assert gathered_blocks(rec.log)[-2:] == [(1,), (0,)]
    assert hooks.counts["prefetched"] >= 5 and not hooks.gathered


def test_the_live_limit_caps_what_the_prefetch_holds():
    # nothing kept from forward to backward (reuse distance 0), so what is held is what the prefetch gathered
    blocks, hooks, rec = hooked(6, window=10**9, max_live=3 * NUMEL, max_reuse=0)
    unit(blocks, hooks)
    hooks.peak_held = 0
    unit(blocks, hooks)
    # the window alone would gather every block at the first use; the prefetch stops at the limit: the block in
    # use and two ahead (DeepSpeed's limit too counts only what its prefetch may add, not what is kept)
    assert hooks.peak_held == 3 * NUMEL
    assert hooks.counts["prefetched"] >= 6


def test_a_unit_that_departs_from_the_record_stops_prefetching_and_records_again():
    blocks, hooks, rec = hooked(4, window=2 * NUMEL)
    unit(blocks, hooks)
    unit(blocks[:2], hooks)  # a shorter forward of the same kind: deviates at its first backward use
    assert hooks.counts["deviations"] == 1
    # blocks 2 and 3 were prefetched for a use that never came: held until the next unit settles them
    assert sorted(b.module.weight.block_index for b in hooks.gathered) == [2, 3]
    unit(blocks, hooks)  # records again (the previous unit restarted the trace)
    assert hooks.counts["restarts"] == 1
    rec.log.clear()
    unit(blocks, hooks)
    assert gathered_blocks(rec.log) == [(0,), (1, 2), (3,)] and hooks.counts["deviations"] == 1


def test_settle_waits_for_gathers_in_flight_and_releases_every_block_held():
    blocks, hooks, rec = hooked(4, window=10**9)
    unit(blocks, hooks)
    with torch.enable_grad():
        hooks.start_unit(None, ())
        x = blocks[0](torch.randn(2, WIDTH, requires_grad=True))  # an exception after the first block
    assert hooks.inflight and hooks.gathered
    assert any(p.ds_status is INFLIGHT for b in blocks for p in b.parameters())
    hooks.settle()
    assert not hooks.inflight and not hooks.gathered and hooks.held == 0
    assert all(p.ds_status is NA for b in blocks for p in b.parameters())
    del x


def test_no_grad_units_release_after_each_forward_and_keep_their_own_trace():
    blocks, hooks, rec = hooked(3, window=NUMEL)
    for _ in range(2):
        unit(blocks, hooks, grad=False)
        unit(blocks, hooks, grad=True)
    assert hooks.counts["deviations"] == 0  # two kinds of unit alternating: each follows its own record
    rec.log.clear()
    unit(blocks, hooks, grad=False)
    assert gathered_blocks(rec.log) == [(0,), (1,), (2,)]  # (1,) and (2,) prefetched one use ahead
    assert hooks.counts["prefetched"] >= 2 and released_blocks(rec.log) == [0, 1, 2] and not hooks.gathered


def test_a_block_whose_tensors_all_persist_is_never_gathered_or_released():
    blocks, hooks, rec = hooked(3, window=10**9)
    for p in blocks[1].parameters():  # below the persistence threshold: whole on every rank, always
        p.ds_persist, p.ds_status = True, AVAILABLE
    hooks.blocks[blocks[1]] = zero3_blocks.Block(blocks[1])
    for _ in range(3):
        unit(blocks, hooks)
    assert all(1 not in g for g in gathered_blocks(rec.log)) and 1 not in released_blocks(rec.log)
    assert all(p.ds_status is AVAILABLE for p in blocks[1].parameters())
    assert hooks.counts["prefetched"] > 0 and not hooks.gathered


def test_a_checkpointed_blocks_recompute_is_not_a_use_and_releases_nothing():
    from functools import partial

    from torch.utils.checkpoint import checkpoint

    blocks, hooks, rec = hooked(3, window=NUMEL)
    run = partial(checkpoint, use_reentrant=False)
    for _ in range(2):
        hooks.start_unit(None, ())
        x = torch.randn(2, WIDTH, requires_grad=True)
        for block in blocks:
            x = run(block, x)
        x.sum().backward()
    # each block's forward ran again inside its backward (after the backward had gathered it): counted, but
    # neither recorded as a use nor followed by a release, so the second unit follows its record
    assert hooks.counts["recomputes"] == 6 and hooks.counts["deviations"] == 0
    assert [u[1] for u in hooks.traces[True].uses] == [False] * 3 + [True] * 3
    assert hooks.counts["released_backward"] == 6 and not hooks.gathered


def test_a_parameter_another_module_is_using_is_not_released():
    blocks, hooks, rec = hooked(2, window=NUMEL)
    blocks[1].weight.ds_active_sub_modules.add(99)  # DeepSpeed's coordinator holds it for module 99
    unit(blocks, hooks, grad=False)
    assert blocks[1].weight.ds_status is AVAILABLE and blocks[1].bias.ds_status is NA
    assert blocks[0].weight.ds_status is NA


def test_the_patch_does_not_apply_where_a_block_shares_a_parameter_with_a_module_outside_it():
    blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(2))
    model = nn.ModuleDict({"blocks": blocks, "head": nn.Linear(WIDTH, WIDTH)})
    assert zero3_blocks.blocks_own_their_parameters(model, list(blocks))
    model["head"].weight = blocks[1].weight  # tied
    assert not zero3_blocks.blocks_own_their_parameters(model, list(blocks))
