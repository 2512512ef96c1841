"""--grad-reduction: which reduction each job shape gets, what is refused, and the fp32 sum it asks of DeepSpeed."""

from __future__ import annotations

import pytest

from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import TrainArgs, load_ds_json, resolve_ds_config
from dsclip.engine.grad_reduction import MAX_16BIT_SUM_CHUNKS, choose_grad_reduction
from dsclip.engine.optim_config import OptimArgs


@pytest.mark.parametrize(
    ("stage", "world", "k", "precision", "expected"),
    [
        (1, 8, 16, "bf16", "coalesced"),  # ZeRO-1 holds the whole gradient anyway
        (2, 8, 16, "bf16", "sharded"),  # 16-bit, K > 1: the fp32 sum
        (3, 1, 16, "bf16", "sharded"),
        (2, 1, 4, "fp32", "coalesced"),  # world 1: nothing to shard
        (3, 1, 1, "bf16", "coalesced"),
        (3, 8, 4, "fp32", "sharded"),  # ZeRO-3: the 1/N gradient is its point
        (2, 8, 1, "bf16", "sharded"),  # K = 1: DeepSpeed's overlapped path, the same one reduction
        (2, 8, 4, "fp32", "coalesced"),  # one reduction instead of K
    ],
)
def test_auto_picks(stage, world, k, precision, expected):
    assert choose_grad_reduction("auto", stage=stage, world=world, accum_freq=k, precision=precision) == expected


def test_refusals_name_the_fix():
    assert MAX_16BIT_SUM_CHUNKS == 1
    with pytest.raises(ConfigError, match="sum 16 chunk gradients in bf16.*--grad-reduction sharded"):
        choose_grad_reduction("coalesced", stage=2, world=8, accum_freq=16, precision="bf16")
    with pytest.raises(ConfigError, match="needs ZeRO-2 or ZeRO-3.*ZeRO-1"):
        choose_grad_reduction("sharded", stage=1, world=8, accum_freq=4, precision="fp32")
    # coalesced bf16 at K = 1 sums nothing: allowed
    assert choose_grad_reduction("coalesced", stage=2, world=8, accum_freq=1, precision="bf16") == "coalesced"


def _resolve(name, world=4, **train):
    t = TrainArgs(deepspeed_config=name, batch_size=2, **train)
    return resolve_ds_config(load_ds_json(name), t, OptimArgs(), world_size=world, device_type="cpu")


def test_16bit_accumulation_is_asked_in_fp32():
    """DeepSpeed sums and partitions gradients in data_types.grad_accum_dtype, the model's dtype unless set:
    fp32 wherever a 16-bit run's gradients are sharded (any K: the step then reads the fp32 partition in place)
    or summed (ZeRO-1, K > 1: BF16_Optimizer)."""
    assert _resolve("zero2_bf16", accum_freq=16)["data_types"]["grad_accum_dtype"] == "fp32"
    assert _resolve("zero3_bf16", accum_freq=4)["data_types"]["grad_accum_dtype"] == "fp32"
    assert _resolve("zero2_bf16", accum_freq=1)["data_types"]["grad_accum_dtype"] == "fp32"  # sharded at world 4
    assert _resolve("zero1_bf16", accum_freq=4)["data_types"]["grad_accum_dtype"] == "fp32"  # BF16_Optimizer
    assert "data_types" not in _resolve("zero2_bf16", world=1, accum_freq=1)  # coalesced, nothing summed
    assert "data_types" not in _resolve("zero2_bf16", accum_freq=1, grad_reduction="coalesced")
    assert "data_types" not in _resolve("zero2_fp32", accum_freq=16)


def test_16bit_accumulation_conflicts_fail_early(tmp_path):
    import json

    raw = load_ds_json("zero2_bf16")
    raw["data_types"] = {"grad_accum_dtype": "bf16"}
    path = tmp_path / "z2.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="grad_accum_dtype 'bf16'.*set fp32"):
        _resolve(str(path), accum_freq=8)
    raw = load_ds_json("zero2_bf16")
    raw["zero_optimization"] = {"stage": 0}
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="ZeRO-0 with --precision bf16 and --accum-freq 8"):
        _resolve(str(path), accum_freq=8)
    with pytest.raises(ConfigError, match="--grad-reduction coalesced"):
        _resolve("zero3_bf16", accum_freq=8, grad_reduction="coalesced")
