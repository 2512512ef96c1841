"""The host's shared-memory slots (dsclip/engine/host_shm.py) and the flush's exchange over them
(local_flush._HostExchange): what each rank reads is what the others wrote in that step, nothing is
left on disk, and a rank that cannot reserve its slot sends every rank back to the process group.

The bit-for-bit comparison of the whole flush with DeepSpeed's is tests/dist/test_local_flush.py."""

from __future__ import annotations

import os

import pytest

from tests.distutil import run_world

pytestmark = [pytest.mark.dist]


def _slots_rank(rank, world, directory):
    import torch
    import torch.distributed as dist

    from dsclip.engine.host_shm import open_host_slots

    slots = open_host_slots(5, torch.float32, directory=directory)
    listing = sorted(os.listdir(directory))  # after the call: every name is gone already
    slots[rank].fill_(rank + 1)
    dist.barrier()
    seen = [s.tolist() for s in slots]
    return {"listing": listing, "seen": seen}


def test_every_rank_reads_every_slot_and_no_file_is_left(tmp_path):
    ranks = run_world(_slots_rank, 3, str(tmp_path))
    for r in ranks:
        assert r["listing"] == []
        assert r["seen"] == [[1.0] * 5, [2.0] * 5, [3.0] * 5]
    assert os.listdir(tmp_path) == []


def _fallback_rank(rank, world, directory):
    import torch

    import dsclip.engine.host_shm as host_shm

    if rank == 1:  # this rank's /dev/shm is full: nobody may use the slots
        host_shm._reserve = lambda path, nbytes: False
    slots = host_shm.open_host_slots(1000, torch.float32, directory=directory)
    missing = host_shm.open_host_slots(10, torch.float32, directory=os.path.join(directory, "absent"))
    return {"none": slots is None, "missing_none": missing is None, "listing": os.listdir(directory)}


def _hosts_rank(rank, world, directory):
    import torch

    from dsclip.engine.host_shm import open_host_slots

    own_host = os.path.join(directory, f"host{rank}")  # each rank sees only its own host's /dev/shm
    os.makedirs(own_host, exist_ok=True)
    slots = open_host_slots(100, torch.float32, directory=own_host)
    return {"none": slots is None, "listing": os.listdir(own_host)}


def test_ranks_on_different_hosts_fall_back_instead_of_mapping_empty_files(tmp_path):
    ranks = run_world(_hosts_rank, 2, str(tmp_path))
    assert all(r["none"] and r["listing"] == [] for r in ranks)


def test_one_rank_without_room_sends_every_rank_to_the_fallback(tmp_path):
    ranks = run_world(_fallback_rank, 2, str(tmp_path))
    assert all(r["none"] and r["missing_none"] for r in ranks)
    assert os.listdir(tmp_path) == []  # rank 0's reserved file removed too


def _exchange_rank(rank, world, steps, applied):
    import time

    import torch

    from dsclip.engine.local_flush import _HostExchange

    sizes = [7, 3]  # two parameter groups, partitions of 7 and 3 elements
    exchange = _HostExchange.open(sizes, torch.float32, None)
    if rank == world - 1:  # the last rank lags after every barrier: the others run ahead into their next write
        barrier = exchange._barrier

        def lagging_barrier(payload=None):
            barrier(payload)
            time.sleep(0.3)

        exchange._barrier = lagging_barrier
    weights = [torch.zeros(size * world) for size in sizes]  # this rank's flat "weights" per group
    parts = [list(w.split(size)) for w, size in zip(weights, sizes)]
    reduced, gathered, payloads = [], [], []
    for step in range(steps):
        exchange.before_writing_grads()
        for i, size in enumerate(sizes):  # rank r's gradient: 1000 * step + 100 * r + 10 * group + element
            g = 1000.0 * step + 100 * rank + 10 * i + torch.arange(size * world, dtype=torch.float32)
            exchange.grads(i).copy_(g)
        payload = torch.tensor([float(rank + 1), float(step)])
        exchange.payload = payload  # summed over the ranks by the barrier of this reduce-scatter
        exchange.reduce_scatter()
        payloads.append((payload.tolist(), exchange.payload))
        reduced.append([exchange.grads(i).narrow(0, rank * size, size).clone() for i, size in enumerate(sizes)])
        if applied[step]:  # a skipped step (overflow) has no gather: the next write must still wait
            for i in range(len(sizes)):
                parts[i][rank].fill_(10.0 * step + rank + i / 10)
            exchange.all_gather(parts)
            gathered.append([w.clone() for w in weights])
    # two gathers with no flush between (DeepSpeed's update_lp_params after a checkpoint load)
    again = []
    for value in (-1.0, -2.0):
        for i in range(len(sizes)):
            parts[i][rank].fill_(value * (rank + 1))
        exchange.all_gather(parts)
        again.append([w.clone() for w in weights])
    return {"reduced": reduced, "gathered": gathered, "again": again, "payloads": payloads}


@pytest.mark.parametrize("world", [2, 3])
def test_exchange_reads_this_steps_values_with_a_lagging_rank_and_skipped_steps(world):
    import torch

    steps, applied = 4, [True, False, False, True]
    ranks = run_world(_exchange_rank, world, steps, applied)
    sizes = [7, 3]
    for rank, out in enumerate(ranks):
        for step in range(steps):
            for i, size in enumerate(sizes):
                # the average over ranks of this step's gradients, this rank's partition
                total = sum(1000.0 * step + 100 * r + 10 * i + torch.arange(size * world) for r in range(world))
                want = (total / world)[rank * size : (rank + 1) * size]
                assert torch.allclose(out["reduced"][step][i], want.float()), (rank, step, i)
        rank_sum = float(sum(r + 1 for r in range(world)))
        assert out["payloads"] == [([rank_sum, float(world * step)], None) for step in range(steps)]
        done = [s for s in range(steps) if applied[s]]
        for k, step in enumerate(done):
            for i, size in enumerate(sizes):
                want = torch.cat([torch.full((size,), 10.0 * step + r + i / 10) for r in range(world)])
                assert torch.equal(out["gathered"][k][i], want), (rank, step, i)
        for k, value in enumerate((-1.0, -2.0)):
            for i, size in enumerate(sizes):
                want = torch.cat([torch.full((size,), value * (r + 1)) for r in range(world)])
                assert torch.equal(out["again"][k][i], want), (rank, value, i)


def _meetings_rank(rank, world):
    import torch.distributed as dist

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.train.gradcache import GradCacheStep
    from tests.dist.test_gradcache import make_batches, make_cfg, make_model, rank_chunks

    cfg = make_cfg(2, 2)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    engine = build_engine(ds, cfg.train, cfg.optim, make_model, total_steps=10, steps_per_epoch=10).engine
    step = GradCacheStep(engine, build_loss("infonce"))
    calls = []
    for name in ("all_reduce", "barrier", "all_gather_into_tensor", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            original = getattr(dist, name)

            def counted(*a, _original=original, _name=name, **k):
                calls.append(_name)
                return _original(*a, **k)

            setattr(dist, name, counted)
    out = {"kind": engine._dsclip_local_flush, "riding": [], "alone": [], "losses": []}
    for s, key in enumerate(("riding", "riding", "alone", "riding")):  # the first one warms up
        if key == "alone":  # the same step with the reported loss all-reduced on its own, as without the slots
            exchange, step.exchange = step.exchange, None
        images, tokens = make_batches(world, 2, seed=50 + s)
        calls.clear()
        result = step(rank_chunks(images, tokens, rank, world, 2), grad_norm=False)
        out[key].append(len(calls))
        out["losses"].append(result.loss)
        if key == "alone":
            step.exchange = exchange
    return out


def test_the_reported_loss_rides_on_the_flushs_barrier():
    ranks = run_world(_meetings_rank, 2)
    for r in ranks:
        assert r["kind"] == "shm"
        # one collective fewer per step with the loss riding on the flush's all-reduce
        assert r["riding"][1] == r["riding"][2] == r["alone"][0] - 1, r
    assert ranks[0]["losses"] == ranks[1]["losses"]  # the full-batch loss, the same on every rank
