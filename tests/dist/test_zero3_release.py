"""dsclip/engine/patches/zero3_release.py, each kind of ``param.partition`` call against DeepSpeed's own.

One gloo rank, two ZeRO-3 linears built alike under ``deepspeed.zero.Init``: one keeps DeepSpeed's
``partition``, the other gets the patch's. Each call a run makes is made on both, and the parameters must end
in the same state (status, the full tensor kept or dropped, the shard's values):

- a release after a fetch (the forward / backward / step case): the patch's direct path, DeepSpeed's
  ``Init._partition_param`` not reached;
- a release after the full tensor was changed (``has_been_updated``: ``GatheredParameters(modifier_rank=...)``,
  how weights are loaded into a ZeRO-3 model): DeepSpeed's path, which copies the change into the shard;
- a release that keeps the full tensor (``free_data=False``) and a list of parameters (the step's persistent
  set): the same state as DeepSpeed's.

The whole training run against DeepSpeed's paths, bit for bit: tests/dist/test_zero3_patches.py.
"""

from __future__ import annotations

import pytest
import torch

from dsclip.model import create_model  # noqa: F401  (imported before zero.Init patches torch.Tensor)
from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]


def _state(p):
    return (p.ds_status.name, tuple(p.data.shape), p.ds_tensor.detach().clone())


def _rank(rank, world):
    import deepspeed
    from deepspeed.runtime.zero import partition_parameters as pp
    from torch import nn

    from dsclip.engine.patches.zero3_release import _direct_release

    deepspeed.init_distributed(dist_backend="gloo")
    calls = [0]
    deepspeed_partition_param = pp.Init._partition_param

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return deepspeed_partition_param(self, *args, **kwargs)

    pp.Init._partition_param = counted
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}}
    twins = []
    for _ in range(2):
        torch.manual_seed(0)
        with deepspeed.zero.Init(config_dict_or_path=config):
            twins.append(nn.Linear(16, 8))
    theirs, ours = twins
    for p in ours.parameters():
        p.partition = _direct_release(p, p.partition)
    out = {"patched": [getattr(p.partition, "dsclip_direct_release", False) for p in ours.parameters()]}

    def both(name, action):
        """``action(param)`` on DeepSpeed's and the patched linear; the states after, and DeepSpeed's
        partition calls on the patched side."""
        states = []
        for model in (theirs, ours):
            calls[0] = 0
            for p in model.parameters():
                action(p)
            states.append([_state(p) for p in model.parameters()])
        out[name] = (states, calls[0])

    def fetch_release(p):
        p.all_gather()
        p.partition()

    def update(p):
        p.all_gather()
        with torch.no_grad():
            p.data.add_(1.0)
        p.partition(has_been_updated=True)

    def keep_data(p):
        p.all_gather()
        p.partition(free_data=False)
        p.data = torch.empty(0, dtype=p.dtype)  # what DeepSpeed's caller does after it (release_sub_module)

    both("fetch_release", fetch_release)
    both("update", update)
    both("keep_data", keep_data)

    def as_list(model):
        params = list(model.parameters())
        for p in params:
            p.all_gather()
        params[0].partition(param_list=params)

    states = []
    for model in (theirs, ours):
        calls[0] = 0
        as_list(model)
        states.append([_state(p) for p in model.parameters()])
    out["list"] = (states, calls[0])
    for model in (theirs, ours):  # the updated values are what a fetch gives back
        for p in model.parameters():
            p.all_gather()
    out["gathered"] = [[p.detach().clone() for p in m.parameters()] for m in (theirs, ours)]
    return out


def test_each_release_leaves_the_parameter_as_deepspeed_does():
    (out,) = run_world(_rank, 1)
    assert out["patched"] == [True, True]
    for case in ("fetch_release", "update", "keep_data", "list"):
        (theirs, ours), _ = out[case]
        for (status_a, shape_a, shard_a), (status_b, shape_b, shard_b) in zip(theirs, ours, strict=True):
            assert status_a == status_b == "NOT_AVAILABLE", case
            assert shape_a == shape_b, case
            assert torch.equal(shard_a, shard_b), case
    assert out["fetch_release"][1] == 0 and out["list"][1] == 0  # the direct path
    assert out["update"][1] == 2  # DeepSpeed's, once per parameter: it copies the change into the shard
    assert out["fetch_release"][0][1][0][1] == (0,)  # the full tensor dropped
    # the update reached the shards (so the comparison above compares something), and a fetch returns it
    before = [shard for _, _, shard in out["fetch_release"][0][1]]
    after = [shard for _, _, shard in out["update"][0][1]]
    assert all(torch.equal(b + 1.0, a) for b, a in zip(before, after, strict=True))
    theirs, ours = out["gathered"]
    for a, b in zip(theirs, ours, strict=True):
        assert a.numel() > 0 and torch.equal(a, b)
