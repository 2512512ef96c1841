"""The collective timeout of the hang bounds on 2 gloo ranks (issue 58): set_collective_timeout reaches every
process group (the default one and one made later, as DeepSpeed's ZeRO groups are), a peer late by more than
it makes the waiting rank's collective raise what collective_timed_out recognises, and the long timeout put
back (as HangGuard.slow does around saves) lets the same lateness pass."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]

SHORT, LATE = timedelta(seconds=0.5), 1.5


def _rank(rank, world):
    import torch
    import torch.distributed as dist

    from dsclip.engine.world import process_group

    zero_group = dist.new_group([0, 1])  # made after the default group, like DeepSpeed's
    out = {"groups": process_group.set_collective_timeout(SHORT)}
    # a save's window: the long timeout back, a peer late by 1.5 s is waited for
    process_group.set_collective_timeout(timedelta(seconds=60))
    if rank == 1:
        time.sleep(LATE)
    t = torch.ones(2)
    dist.all_reduce(t, group=zero_group)
    out["slow_phase_sum"] = t.tolist()
    # between saves: the short timeout, and the same lateness is a hang
    process_group.set_collective_timeout(SHORT)
    if rank == 1:
        time.sleep(LATE)
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(2), group=zero_group)
        out["error"] = None
    except RuntimeError as e:
        out["error"] = str(e)
    out["waited_s"] = time.monotonic() - t0
    out["recognised"] = process_group.collective_timed_out(RuntimeError(out["error"] or ""))
    process_group.set_collective_timeout(timedelta(seconds=60))  # run_world's closing barrier waits for rank 1
    return out


def test_a_peer_late_by_more_than_the_collective_timeout_raises_a_recognised_timeout():
    r0, r1 = run_world(_rank, 2, timeout=120)
    assert r0["groups"] == r1["groups"] == 2
    assert r0["slow_phase_sum"] == r1["slow_phase_sum"] == [2.0, 2.0]
    assert r0["error"] is not None and "Timed out waiting 500ms" in r0["error"], r0
    assert r0["recognised"] and r0["waited_s"] < LATE, r0  # gave up after the 0.5 s timeout, not at the peer's arrival
    assert r1["error"] is not None  # the late peer finds the pair closed (or times out itself): never a silent pass
