"""dsclip train's early checks: misconfigured runs fail before the process group and before DeepSpeed."""

import json
import os
import subprocess
import sys

import pytest

from dsclip.config import ConfigError, make_run_config
from dsclip.train import preflight

# Runs the real CLI in a fresh interpreter and reports what had happened when the error came back. What is
# bounded (issue #33: these errors came after the world set-up and DeepSpeed's C++ op build, minutes in):
# - no process group was initialised (torch.distributed.is_initialized() after main() returned), and the
#   world set-up's rank line was never printed;
# - DeepSpeed was never imported ('deepspeed' not in sys.modules), except for a DeepSpeed JSON key that only
#   the installed DeepSpeed's own schema can judge: that check imports deepspeed's pydantic config models
#   (there is no cheaper source of truth), and it runs last, still before the process group.
# - torch itself loads only for the checks that need it (the accelerator for the precision, DeepSpeed's
#   JSON): an unknown model, a missing tokenizer or shard stops with torch never imported.
# No wall-time assertion.
PROBE = """
import json, sys
from dsclip.cli import main
rc = main(sys.argv[1:])
torch_loaded = "torch" in sys.modules
import torch.distributed as dist
print(json.dumps({"rc": rc, "deepspeed": "deepspeed" in sys.modules, "torch": torch_loaded,
                  "group": dist.is_available() and dist.is_initialized()}))
"""


def _probe(args, tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DSCLIP_CACHE": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=tmp_path)
    return json.loads(p.stdout.strip().splitlines()[-1]), p.stderr, p.stdout


@pytest.mark.parametrize(
    "args, says, loads_torch",
    [
        (["--model", "ViT-Nope-99"], "unknown model 'ViT-Nope-99'", False),
        # CUDA hidden: the accelerator is the CPU, where DeepSpeed has no fp16
        (["--model", "demo", "--precision", "fp16"], "fp16 is not supported by DeepSpeed on CPU", True),
        (["--model", "demo", "--tokenizer", "nope/spm.model"], "--tokenizer sentencepiece model not found", False),
        (
            ["--model", "demo", "--train-data", "nope/shard-{0..3}.tar", "--train-num-samples", "8"],
            "--train-data: shard not found: nope/shard-0.tar",
            False,
        ),
        (
            ["--model", "demo", "--deepspeed-config", "bad_ds.json"],
            "unknown key 'zero_optimization.overlap_com'",
            True,
        ),
    ],
)
def test_misconfigured_run_fails_before_world_and_deepspeed(tmp_path, args, says, loads_torch):
    (tmp_path / "bad_ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_com": True}}))
    out, err, stdout = _probe(["train", "--name", "x", "--logs", str(tmp_path), *args], tmp_path)
    errors = [line for line in err.splitlines() if line.startswith("dsclip train: error:")]
    assert out["rc"] == 2 and len(errors) == 1 and says in errors[0], err  # one line naming the problem
    assert "Traceback" not in err
    assert not out["group"] and "[dsclip] rank" not in stdout + err  # no process group, no world set-up
    # only DeepSpeed's own schema check (of a JSON's zero_optimization/compile) may load DeepSpeed
    assert out["deepspeed"] is ("--deepspeed-config" in args)
    assert out["torch"] is loads_torch


def cfg(**kv):
    return make_run_config({"name": "x", **kv})


def test_other_model_without_data_lists_the_data_options():
    with pytest.raises(ConfigError, match="--model ViT-B-32 needs training data") as e:
        preflight.check(cfg(model="ViT-B-32"))
    assert "webdataset" in str(e.value) and "CSV" in str(e.value) and "--dataset-type synthetic" in str(e.value)
    preflight.check(cfg(model="demo"))  # the demo model trains on the built-in set
    preflight.check(cfg(model="ViT-B-32", dataset_type="demo"))  # asked for explicitly


def test_openclip_architecture_defaults_to_openclip_tokenizer(tmp_path, capsys):
    (tmp_path / "s-0.tar").write_bytes(b"")
    out = preflight.check(cfg(model="ViT-B-32", train_data=str(tmp_path / "s-{0..0}.tar")))
    assert out.data.tokenizer == "open_clip:ViT-B-32"
    assert "open_clip:ViT-B-32" in capsys.readouterr().out  # said at start-up


def test_no_tokenizer_error_names_both_kinds(tmp_path):
    (tmp_path / "s-0.tar").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        preflight.check(cfg(model="tiny", train_data=str(tmp_path / "s-0.tar")))
    assert "path/to/spm.model" in str(e.value) and "open_clip:MODEL" in str(e.value)


def test_missing_shards_and_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match="shard not found"):
        preflight.check(cfg(model="ViT-B-32", train_data=str(tmp_path / "s-{0..3}.tar")))
    (tmp_path / "s-0.tar").write_bytes(b"")
    with pytest.raises(FileNotFoundError):
        preflight.check(
            cfg(model="ViT-B-32", train_data=str(tmp_path / "s-0.tar"), tokenizer=str(tmp_path / "no.model"))
        )


def test_resume_of_an_openclip_file_names_pretrained(tmp_path):
    f = tmp_path / "epoch_28.pt"
    f.write_bytes(b"")
    with pytest.raises(ConfigError, match=f"--pretrained {f}"):
        preflight.check(cfg(model="demo", resume=str(f)))


@pytest.mark.parametrize("flag", ["--horovod", "--use-bnb-linear"])
def test_refused_openclip_flags_quote_the_compat_table(flag):
    from dsclip.config import parse_run_config

    with pytest.raises(ConfigError) as e:
        parse_run_config([flag, "x"] if "=" not in flag else [flag])
    msg = str(e.value)
    assert "did you mean" not in msg and "OpenCLIP's option, not offered" in msg
    reason = "DeepSpeed replaces it" if "horovod" in flag else "zero3_bf16"
    assert reason in msg


def test_tensorboard_train_tags_are_openclips(tmp_path):
    import torch

    from dsclip.train.gradcache import StepResult
    from dsclip.train.metrics import MetricsLogger

    m = MetricsLogger(
        tmp_path, rank=0, world_size=1, every_n_steps=1, report_to="", samples_per_step=4, total_steps=10,
        device=torch.device("cpu"),
    )  # fmt: skip
    seen = {}
    m._scalars = lambda scalars, step: seen.update(scalars)
    m.step(1, StepResult(loss=1.5, logit_scale=14.0, logit_bias=None, grad_norm=2.0, applied=True),
           data_wait_s=0.0, lr=1e-3, epoch=0)  # fmt: skip
    m.close()
    assert seen["train/scale"] == 14.0 and "train/samples_per_second" in seen
    assert "train/samples_per_second_per_gpu" in seen and "train/logit_scale" not in seen
