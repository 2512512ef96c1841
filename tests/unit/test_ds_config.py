"""DeepSpeed JSON: auto values filled from the run config, contradictions and typos refused."""

import json
from pathlib import Path

import pytest

from dsclip.config import ConfigError, make_run_config
from dsclip.engine.ds_config import load_ds_json, resolve_ds_config

ROOT = Path(__file__).resolve().parents[2]


def cfg(**kw):
    kw.setdefault("name", "t")
    return make_run_config(kw)


def resolve(raw, world=2, device="cpu", **kw):
    c = cfg(**kw)
    return resolve_ds_config(raw, c.train, c.optim, world_size=world, device_type=device)


@pytest.mark.parametrize("path", sorted((ROOT / "ds_configs").glob("*.json")), ids=lambda p: p.name)
def test_shipped_configs_resolve(path):
    raw = load_ds_json(path)
    precision = "auto"
    ds = resolve(raw, batch_size=8, accum_freq=2, precision=precision, device="cuda")
    assert ds["train_batch_size"] == 8 * 2 * 2
    assert ds["gradient_accumulation_steps"] == 1  # the gradient cache owns accumulation
    assert ds["train_micro_batch_size_per_gpu"] == 16
    assert "auto" not in json.dumps(ds)


def test_batch_triad_contradiction():
    raw = {"train_batch_size": 100, "zero_optimization": {"stage": 2}}
    with pytest.raises(ConfigError, match=r"'train_batch_size' is 100 .*--batch-size 8 × --accum-freq 1 × world 2"):
        resolve(raw, batch_size=8)
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' is 4"):
        resolve({"gradient_accumulation_steps": 4}, batch_size=8)
    ok = resolve({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8}, batch_size=8)
    assert ok["train_batch_size"] == 16


def test_unknown_keys_are_errors():
    with pytest.raises(ConfigError, match="unknown key 'gradient_accumulation_dtype'"):
        resolve({"gradient_accumulation_dtype": "fp32"})
    with pytest.raises(
        ConfigError,
        match=r"unknown key 'zero_optimization.stage3_prefetch_bucket_sise': DeepSpeed [0-9.]+ has no such setting; "
        r"did you mean 'stage3_prefetch_bucket_size'",
    ):
        resolve({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 1}})
    with pytest.raises(ConfigError, match="unknown key 'cpu_checkpoint'.*did you mean 'cpu_checkpointing'"):
        resolve({"activation_checkpointing": {"cpu_checkpoint": True}})


def test_precision_resolution():
    assert resolve({"bf16": {"enabled": "auto"}}, precision="bf16")["bf16"]["enabled"] is True
    assert resolve({"bf16": {"enabled": True}})["bf16"]["enabled"] is True  # JSON decides when --precision auto
    auto = resolve({})
    assert not auto["bf16"]["enabled"] and not auto["fp16"]["enabled"]
    with pytest.raises(ConfigError, match="sets precision bf16 but --precision is fp32"):
        resolve({"bf16": {"enabled": True}}, precision="fp32")
    with pytest.raises(ConfigError, match="fp16 is not supported by DeepSpeed on CPU"):
        resolve({}, precision="fp16", device="cpu")
    fp16 = resolve({}, precision="amp", device="cuda")
    assert fp16["fp16"]["enabled"] and fp16["fp16"]["loss_scale"] == 0  # dynamic loss scaling


def test_clip_and_optimizer_autofill():
    ds = resolve(
        {"gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
        grad_clip_norm=1.5,
        lr=3e-4,
        wd=0.05,
    )
    assert ds["gradient_clipping"] == 1.5
    assert ds["optimizer"]["params"]["lr"] == 3e-4 and ds["optimizer"]["params"]["weight_decay"] == 0.05
    with pytest.raises(ConfigError, match="'gradient_clipping' is 2.0"):
        resolve({"gradient_clipping": 2.0}, grad_clip_norm=1.0)


def test_scheduler_block_refused():
    with pytest.raises(ConfigError, match="dsclip owns the schedule"):
        resolve({"scheduler": {"type": "WarmupLR"}})


def test_invalid_json_and_missing_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 4,,}')
    with pytest.raises(ConfigError, match="not valid JSON: .* line 1"):
        load_ds_json(bad)
    with pytest.raises(ConfigError, match="DeepSpeed config not found.*shipped names: .*zero2_bf16"):
        load_ds_json(tmp_path / "nope.json")


def test_shipped_configs_by_name_from_any_directory(tmp_path, monkeypatch):
    """`--deepspeed-config zero3_bf16` (and the ds_configs/... spelling) from a directory that is not
    the checkout: the JSONs are package data next to the code."""
    shipped = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert load_ds_json("zero3_bf16") == shipped
    assert load_ds_json("zero3_bf16.json") == shipped
    assert load_ds_json("ds_configs/zero3_bf16.json") == shipped
    own = tmp_path / "zero3_bf16.json"  # a file of the same name in the cwd wins: it is a path
    own.write_text('{"zero_optimization": {"stage": 1}}')
    assert load_ds_json("zero3_bf16.json") == {"zero_optimization": {"stage": 1}}
    with pytest.raises(ConfigError, match="not found: elsewhere/zero3_bf16.json"):
        load_ds_json("elsewhere/zero3_bf16.json")  # an explicit other folder is not silently replaced


def test_cpu_checkpointing_dropped_on_cpu_kept_on_gpu():
    raw = {"activation_checkpointing": {"cpu_checkpointing": True}}
    assert resolve(raw, device="cpu")["activation_checkpointing"]["cpu_checkpointing"] is False
    assert resolve(raw, device="cuda")["activation_checkpointing"]["cpu_checkpointing"] is True


def test_options_incompatible_with_gradient_cache_refused():
    with pytest.raises(ConfigError, match="managed_gradient_accumulation=false is incompatible"):
        resolve({"managed_gradient_accumulation": False}, accum_freq=4)
    with pytest.raises(ConfigError, match="pipeline parallelism is not supported"):
        resolve({"pipeline": {}})


# ZeRO settings that exist in one supported DeepSpeed release and not in the other (0.19.2 <-> 0.19.8).
ONLY_NEWER, ONLY_OLDER = "compute_grad_norm", "mics_shard_size"


def test_zero_key_the_installed_deepspeed_lacks_names_key_and_version():
    import deepspeed
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    fields = DeepSpeedZeroConfig.model_fields
    missing = ONLY_OLDER if ONLY_NEWER in fields else ONLY_NEWER
    assert missing not in fields  # one of the two is absent from every supported release
    with pytest.raises(ConfigError) as e:
        resolve({"zero_optimization": {"stage": 3, missing: 1}})
    msg = str(e.value)
    assert f"unknown key 'zero_optimization.{missing}'" in msg and f"DeepSpeed {deepspeed.__version__}" in msg
    assert "\n" not in msg and "install the DeepSpeed release that has it" in msg


def test_zero_nested_keys_and_values_checked_by_deepspeeds_schema():
    with pytest.raises(
        ConfigError, match=r"unknown key 'zero_optimization.offload_param.devise'.*did you mean 'device'"
    ):
        resolve({"zero_optimization": {"stage": 3, "offload_param": {"devise": "cpu"}}})
    with pytest.raises(ConfigError, match=r"zero_optimization.offload_param.device = 'gpu': .*fix the value") as e:
        resolve({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"zero_optimization.stage3_max_live_parameters = 'many'"):
        resolve({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": "many"}})
    with pytest.raises(ConfigError, match=r"unknown key 'compile.deepcompil'.*did you mean 'deepcompile'"):
        resolve({"zero_optimization": {"stage": 3}, "compile": {"deepcompil": True}})
    ok = resolve({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})  # valid ones pass
    assert ok["zero_optimization"]["offload_param"] == {"device": "cpu"}


def test_deepcompile_refused_off_cuda_and_with_pairs_deepspeed_refuses():
    z3 = {"stage": 3}
    with pytest.raises(ConfigError, match="compile.deepcompile needs a CUDA device.*accelerator is cpu"):
        resolve({"zero_optimization": z3, "compile": {"deepcompile": True}}, device="cpu")
    assert resolve({"zero_optimization": z3, "compile": {"deepcompile": True}}, device="cuda")["compile"]
    opt_cpu = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=r"compile.offload_opt_states with zero_optimization.offload_optimizer"):
        resolve(
            {"zero_optimization": opt_cpu, "compile": {"deepcompile": True, "offload_opt_states": True}}, device="cuda"
        )
    both_cpu = opt_cpu | {"offload_param": {"device": "cpu"}}
    with pytest.raises(ConfigError, match=r"compile.offload_opt_states with compile.offload_parameters"):
        resolve(
            {
                "zero_optimization": z3
                | {"offload_param": {"device": "cpu"}}
                | {"offload_optimizer": {"device": "none"}},
                "compile": {"deepcompile": True, "offload_opt_states": True, "offload_parameters": True},
            },
            device="cuda",
        )
    from deepspeed.compile.config import CompileConfig

    # DeepSpeed 0.19.2 has no activation offload pass: there the key itself is the error
    expect = (
        "offload_activation with compile.offload_parameters"
        if "offload_activation" in CompileConfig.model_fields
        else "unknown key 'compile.offload_activation'"
    )
    with pytest.raises(ConfigError, match=expect):
        resolve(
            {"zero_optimization": both_cpu, "compile": {"deepcompile": True, "offload_activation": True}}, device="cuda"
        )
