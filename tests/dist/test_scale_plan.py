"""dsclip plan's model-state bytes against the buffers a real DeepSpeed engine allocates (2 gloo ranks, bf16).

After one optimizer step we sum the tensors DeepSpeed keeps per rank: the 16-bit parameters (ZeRO-2:
the flat replicated copy; ZeRO-3: this rank's partitions), the fp32 master partition and Adam's two
moments on it, and (ZeRO-3) the persistent 16-bit gradient partition buffer. Each must equal the
planner's term within the alignment padding DeepSpeed adds (< 1% on this model). The planner's
gradient term additionally counts the fp32 gradient DeepSpeed builds transiently inside ``step()``.
"""

from __future__ import annotations

import pytest
import torch

from dsclip.model import create_model  # noqa: F401  (import before zero.Init patches torch)
from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]


def _measure(rank, world, stage):
    from dsclip.config import make_run_config
    from dsclip.engine.build import autocast_dtype, build_engine
    from dsclip.engine.ds_config import load_ds_json, resolve_ds_config
    from dsclip.losses import build_loss
    from dsclip.plan import memory as M
    from dsclip.train.gradcache import GradCacheStep

    cfg = make_run_config(
        {
            "name": "p",
            "model": "demo",
            "batch_size": 4,
            "accum_freq": 1,
            "precision": "bf16",
            "warmup": 0,
            "lr_scheduler": "const",
            "deepspeed_config": f"ds_configs/zero{stage}_bf16.json",
        }
    )
    ds = resolve_ds_config(
        load_ds_json(cfg.train.deepspeed_config), cfg.train, cfg.optim, world_size=world, device_type="cpu"
    )
    if stage == 3:
        ds["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition every parameter

    def factory():
        torch.manual_seed(0)
        return create_model("demo", vocab_size=1000)

    bundle = build_engine(
        ds,
        cfg.train,
        cfg.optim,
        factory,
        grad_checkpointing=cfg.model.grad_checkpointing,
        total_steps=10,
        steps_per_epoch=10,
    )
    engine = bundle.engine
    step = GradCacheStep(engine, build_loss("infonce"), compute_dtype=autocast_dtype(bundle))
    g = torch.Generator().manual_seed(rank)
    ctx = engine.module.context_length
    tok = torch.randint(3, 900, (4, ctx), generator=g)
    tok[:, ctx - 2] = 2  # EOS
    step([(torch.randn(4, 3, 32, 32, generator=g), tok)])

    opt = engine.optimizer
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    if stage == 2:
        masters = list(opt.single_partition_of_fp32_groups)
        params16 = nbytes(opt.bit16_groups_flat)
        grads16 = None
    else:
        masters = list(opt.fp32_partitioned_groups_flat)
        params16 = nbytes(p.ds_tensor for p in engine.module.parameters())
        grads16 = nbytes([opt.grad_partitions_flat_buffer])
    adam = nbytes(v for m in masters for v in opt.optimizer.state[m].values() if torch.is_tensor(v) and v.dim())
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    planned = M.model_state_bytes(n_params, world, stage, "bf16")
    return {
        "params16": params16,
        "master": nbytes(masters),
        "adam": adam,
        "grads16": grads16,
        "planned": planned,
        "n": n_params,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_planner_model_states_equal_engine_buffers(stage):
    for r in run_world(_measure, 2, stage):
        planned, n = r["planned"], r["n"]
        assert r["params16"] == pytest.approx(planned["params"], rel=0.01)
        assert r["master"] + r["adam"] == pytest.approx(planned["optimizer"], rel=0.01)
        assert r["adam"] == pytest.approx(2 * r["master"], rel=1e-6)  # exp_avg + exp_avg_sq in fp32
        if stage == 3:
            # the persistent gradient partition: fp32 under the sharded reduction (what dsclip train runs at world 2,
            # dsclip/engine/grad_reduction.py), the planner's 4 B x P / N, not DeepSpeed's 16-bit 2 B of its 6
            from dsclip.plan.memory import sharded_grad_bytes

            assert r["grads16"] == pytest.approx(sharded_grad_bytes(n, 2), rel=0.01)
        assert n > 1e6
