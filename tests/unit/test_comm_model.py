"""The communication model's arithmetic against hand-derived values, the collective counter under torch's
fake group (counting, nesting, filling), and the rehearsal's one-line refusals."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from dsclip.plan.comm import LinkModel, Traffic, estimate, ring_factor
from dsclip.rehearsal.counter import CollectiveCounter
from dsclip.rehearsal.room import RehearsalError, check_fake_group, check_world


def test_ring_factors():
    assert ring_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)  # 1.75
    assert ring_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert ring_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert ring_factor("broadcast", 4) == 1.0
    assert ring_factor("all_reduce", 1) == 0.0  # one rank sends nothing


def test_link_seconds_intra_and_inter_node():
    link = LinkModel(gpus_per_node=8, intra_gbps=460.0, inter_gbps=50.0)
    # 1 GB all-reduce in one node: 1e9 x 1.75 / 460e9 s
    assert link.seconds("all_reduce", 8, 1e9) == pytest.approx(1.75 / 460)  # 3.804 ms
    # 16 ranks leave the node: the per-GPU network link, 1e9 x 2 x 15/16 / 50e9 = 37.5 ms
    assert link.seconds("all_reduce", 16, 1e9) == pytest.approx(0.0375)
    # all-gather of a 400 MB output over 64 ranks: 4e8 x 63/64 / 50e9 = 7.875 ms
    assert link.seconds("all_gather", 64, 4e8) == pytest.approx(7.875e-3)


def test_estimate_exposes_what_compute_cannot_hide():
    link = LinkModel(gpus_per_node=8, intra_gbps=100.0, inter_gbps=10.0)
    t = Traffic()
    t.add("all_gather", 8, int(8e8), "forward")  # ZeRO-3 prefetch: 8e8 x 7/8 / 1e11 = 7 ms, overlappable
    t.add("reduce_scatter", 8, int(8e8), "boundary")  # 7 ms, exposed (after the last backward)
    t.add("all_reduce", 8, 4, "other")  # the gradient cache's flags: ~0
    est = estimate(t, link, zero=3, overlap_comm=True, hideable_compute_s=0.005)
    assert est.total_s == pytest.approx(0.014, rel=1e-6)
    assert est.exposed_s == pytest.approx(0.007 + 0.002, rel=1e-6)  # boundary + the 2 ms compute can't hide
    assert est.per_kind["all_gather in forward"]["overlappable"]
    assert not est.per_kind["reduce_scatter in boundary"]["overlappable"]
    # ZeRO-2 gathers nothing in the forward: the same traffic would be exposed there
    z2 = estimate(t, link, zero=2, overlap_comm=True, hideable_compute_s=1.0)
    assert z2.exposed_s == pytest.approx(0.014, rel=1e-6)


def test_counter_counts_and_fills_under_the_fake_group():
    """Each collective counted once with its whole buffer; under the fake group the rank's own data lands where
    its peers' would, in gathers, reduce-scatters and point-to-point receives alike."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    original = dist.all_gather_into_tensor
    try:
        with CollectiveCounter(fill_outputs=True) as c:
            inp = torch.arange(2.0)
            out = torch.full((8,), float("nan"))
            dist.all_gather_into_tensor(out, inp)
            rs_in, rs_out = torch.arange(8.0), torch.full((2,), float("nan"))
            dist.reduce_scatter_tensor(rs_out, rs_in)
            dist.all_reduce(torch.ones(3, dtype=torch.bfloat16))
            # the ring losses' exchange (dsclip.losses.distributed.Ring): the fake group never fills a receive
            send, recv = torch.arange(3.0), torch.full((3,), float("nan"))
            ops = [dist.P2POp(dist.isend, send, 2), dist.P2POp(dist.irecv, recv, 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            c.phase = "step"
            dist.barrier()
        assert dist.all_gather_into_tensor is original  # uninstalled on exit
        assert torch.equal(out, torch.tensor([0.0, 1, 0, 1, 0, 1, 0, 1]))  # own shard where peers' land
        assert torch.equal(rs_out, torch.tensor([2.0, 3.0]))  # rank 1's own chunk
        assert torch.equal(recv, send)  # what it sends stands in for what its left neighbour would
        assert c.traffic.bytes == {
            ("all_gather", 4, "other"): 32,  # the gathered output, fp32
            ("reduce_scatter", 4, "other"): 32,  # the input
            ("all_reduce", 4, "other"): 6,  # 3 bf16
            ("send", 4, "other"): 12,  # each op of the batch: 3 fp32 out, 3 in
            ("recv", 4, "other"): 12,
            ("barrier", 4, "step"): 0,
        }
        assert sum(c.traffic.calls.values()) == 6
    finally:
        dist.destroy_process_group()


def test_a_world_the_model_cannot_be_partitioned_for_is_one_line():
    from dsclip.rehearsal.room import smallest_group_numel

    n = smallest_group_numel("demo")
    world = (n // 8 + 1) * 8  # whole nodes, more ranks than the smallest group has elements
    with pytest.raises(RehearsalError, match=rf"--gpus {world}: demo's smallest parameter group has {n}") as e:
        check_world("demo", world, 8)
    assert "\n" not in str(e.value)
    check_world("demo", 8, 8)  # a world it can be partitioned for passes
    with pytest.raises(RehearsalError, match="whole nodes"):
        check_world("demo", 12, 8)


def test_no_fake_group_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)  # import fails
    with pytest.raises(RehearsalError, match="no fake process group") as e:
        check_fake_group()
    assert "\n" not in str(e.value)


def test_counter_times_calls_and_async_waits_on_all_three_clocks(monkeypatch):
    """Every interval (a call, an async handle's wait) adds to the wall, process-CPU and main-thread-CPU
    totals: bench/rehearsal_host_time.py subtracts the CPU ones from a real rank's step."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dsclip.rehearsal import counter as counter_module

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    ticks = iter(range(100))
    monkeypatch.setattr(counter_module, "clocks", lambda: (lambda n: (n, 10.0 * n, 100.0 * n))(next(ticks)))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with CollectiveCounter() as c:
            dist.all_reduce(torch.ones(2))  # one interval of one tick
            work = dist.all_reduce(torch.ones(2), async_op=True)  # the launch: one tick
            work.wait()  # the wait: one tick
            assert (c.seconds, c.cpu_seconds, c.thread_seconds) == (3, 30, 300)
            c.recording = False
            dist.all_reduce(torch.ones(2))  # warm-up steps are not timed
            assert (c.seconds, c.cpu_seconds, c.thread_seconds) == (3, 30, 300)
            c.reset()
            assert (c.seconds, c.cpu_seconds, c.thread_seconds) == (0, 0, 0)
    finally:
        dist.destroy_process_group()
