"""--loss-dist-impl (OpenCLIP's SigLIP exchange: bidir, shift, reduce, gather) on 2 and 3 gloo ranks: for
each value, the loss `dsclip train` builds from the run config gives the same per-rank loss and gradients
(features, logit scale and bias; float64) as OpenCLIP's own SigLipLoss(dist_impl=value). World 2 runs
bidir's single one-way step, world 3 its bidirectional one."""

from __future__ import annotations

import pytest
import torch

from dsclip.testing.gloo_world import run_world
from tests.unit.test_losses import assert_close, loss_and_grads, make_batch

pytestmark = pytest.mark.dist
B, D = 4, 6
IMPLS = ("bidir", "shift", "reduce", "gather")


def _worker(rank, world):
    import open_clip.loss as ocl

    from dsclip.config import make_run_config
    from dsclip.losses import build_loss

    x, y, s, b = make_batch(world * B, D, seed=7 + world, dtype=torch.float64)
    rows = slice(rank * B, (rank + 1) * B)
    out = {}
    for impl in IMPLS:
        cfg = make_run_config({"name": "t", "siglip": True, "loss_dist_impl": impl, "loss_tile_size": 3})
        ours = build_loss(cfg.loss.loss_config())
        theirs = ocl.SigLipLoss(rank=rank, world_size=world, dist_impl=impl)
        out[impl] = (loss_and_grads(ours, x[rows], y[rows], s, b), loss_and_grads(theirs, x[rows], y[rows], s, b))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_openclip_exchange_gives_openclips_numbers(world):
    for res in run_world(_worker, world, timeout=240):
        for impl in IMPLS:
            (loss, grads), (oc_loss, oc_grads) = res[impl]
            assert_close(loss, oc_loss)
            for a, c in zip(grads, oc_grads):
                assert_close(a, c)
