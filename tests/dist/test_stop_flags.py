"""Stop signals ride on the all-reduce the gradient-cache step already makes (no extra collective or
host sync per step), and every rank gets the same stop decision at the same step (gloo, 2 ranks)."""

from __future__ import annotations

import os
import signal

import pytest

from dsclip.model import create_model, get_model_config  # before zero.Init patches torch.Tensor
from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]


def _rank(rank, world, send_signal):
    import torch
    import torch.distributed as dist

    from dsclip.engine.build import build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.engine.world import stop
    from dsclip.losses import build_loss
    from dsclip.testing.gradcache import make_batches, make_cfg, rank_chunks
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_cfg(2, 2)
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    mcfg = get_model_config("tiny")
    engine = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        lambda: create_model(mcfg, vocab_size=256, eos_id=2, pad_id=0),
        total_steps=10,
        steps_per_epoch=10,
    ).engine
    images, tokens = make_batches(world, 2)
    chunks = rank_chunks(images, tokens, rank, world, 2)
    stop.install_preemption_handler()
    calls = {"all_reduce": 0}
    real = dist.all_reduce

    def counting(*a, **k):
        calls["all_reduce"] += 1
        return real(*a, **k)

    dist.all_reduce = counting
    try:
        out = []
        plain = GradCacheStep(engine, build_loss("infonce"))
        folded = GradCacheStep(engine, build_loss("infonce"), extra_flags=stop.local_stop_flags)
        for name, step in (("plain", plain), ("quiet", folded), ("signalled", folded)):
            if name == "signalled" and rank == 1:
                os.kill(os.getpid(), send_signal)  # only rank 1 is told
            before = calls["all_reduce"]
            torch.manual_seed(rank)
            r = step(chunks)
            out.append((name, calls["all_reduce"] - before, r.flags, stop.stop_reason(r.flags) if r.flags else None))
        return out
    finally:
        dist.all_reduce = real


@pytest.mark.parametrize("sig,reason", [(signal.SIGUSR1, "requeue"), (signal.SIGTERM, "terminate")])
def test_signal_on_one_rank_stops_every_rank_at_the_same_step_without_extra_collective(sig, reason):
    r0, r1 = run_world(_rank, 2, sig)
    assert r0 == r1  # same counts, same summed flags, same decision on both ranks
    (_, n_plain, f_plain, _), (_, n_quiet, f_quiet, s_quiet), (_, n_sig, f_sig, s_sig) = r0
    assert f_plain == () and n_quiet == n_plain == n_sig  # the flags cost no all-reduce of their own
    assert f_quiet == (0.0, 0.0) and s_quiet is None
    want = (1.0, 0.0) if sig == signal.SIGUSR1 else (0.0, 1.0)
    assert f_sig == want and s_sig == reason
