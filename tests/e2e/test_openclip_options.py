"""OpenCLIP options through `dsclip train` itself: --dataset-type synthetic with --opt timm/NAME, --device,
--use-bn-sync, --dist-backend and --imagenet-v2 in one 2-rank run whose ranks meet at --dist-url; bad values
as one-line errors (one through a real `dsclip train` process, the parse-time ones through the CLI entry point
in-process: a process start costs seconds and tests nothing more for an error raised before any work)."""

from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch
from PIL import Image

from dsclip.testing.gloo_world import free_port
from tests.e2e.test_train_cli import PY, ROOT, assert_bad_train_in_process, assert_bad_train_process, env


def test_two_ranks_meet_at_the_dist_url_and_train_synthetic_data_with_timm_lion_and_imagenet_v2(tmp_path):
    # One 2-rank run carries both checks (a process world costs ~20 s to start, the steps are milliseconds):
    # (1) MASTER_PORT is held by another socket: an env:// rendezvous fails on it, the --dist-url file:// store
    # works; (2) --dataset-type synthetic, --opt timm/lion, --device, --use-bn-sync, --imagenet-v2 in one run.
    v2 = tmp_path / "v2" / "ImageNetV2-matched-frequency"
    for label in (1, 5):
        (v2 / str(label)).mkdir(parents=True)
        Image.new("RGB", (24, 24), (label * 40, 0, 0)).save(v2 / str(label) / "a.jpeg")
    (tmp_path / "t.txt").write_text("a photo of a {c}.\n")
    with socket.socket() as busy:
        busy.bind(("", free_port()))
        busy.listen()
        common = dict(env(), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
        common["MASTER_PORT"] = str(busy.getsockname()[1])
        args = [PY, "-m", "dsclip", "train", "--config", "tiny", "--logs", str(tmp_path), "--name", "syn"]
        args += ["--max-steps", "100", "--dist-backend", "gloo", "--dist-url", f"file://{tmp_path}/rendezvous"]
        args += ["--dataset-type", "synthetic", "--train-num-samples", "64", "--epochs", "1"]  # 2 steps of 16 x 2
        args += ["--opt", "timm/lion", "--lr", "1e-4", "--device", "cpu", "--use-bn-sync"]
        args += ["--imagenet-v2", str(tmp_path / "v2"), "--zeroshot-templates", str(tmp_path / "t.txt")]
        procs = [
            subprocess.Popen(
                args,
                cwd=ROOT,
                env=dict(common, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    line = next(x for x in outs[0][1].splitlines() if x.startswith("[dsclip] rank 0/2"))
    assert f"master file://{tmp_path}/rendezvous backend gloo" in line
    run = tmp_path / "syn"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in records if "loss" in r}) == [1, 2]
    results = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    zs = [r["zeroshot"] for r in results if "zeroshot" in r]
    assert len(zs) == 1 and {"imagenetv2-zeroshot-val-top1", "imagenetv2-zeroshot-val-top5"} <= set(zs[0])
    assert not any("demo_zeroshot" in r for r in results)  # synthetic data is not the demo
    # the optimizer DeepSpeed stepped: Lion keeps only exp_avg (AdamW would add exp_avg_sq), on both ranks
    optim_files = sorted((run / "checkpoints").glob("*/*optim_states.pt"))
    assert len({f.name for f in optim_files}) == 2, sorted(p.name for p in (run / "checkpoints").rglob("*"))
    for f in optim_files:
        base = torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        states = base["base_optimizer_state"]["state"].values()  # ZeRO-2: the optimizer over the flat partitions
        assert {k for st in states for k in st} == {"exp_avg"}, f


def test_bad_device_is_one_line_and_nonzero(tmp_path):
    # a real process: the exit code and stderr of `python -m dsclip`; --device is checked after the world is up
    assert_bad_train_process(tmp_path, ["--device", "cuda"], "--device cuda: the DeepSpeed accelerator here is cpu")


@pytest.mark.parametrize(
    "extra, expect",
    [
        (["--opt", "timm/lino"], "timm has no optimizer 'lino' (did you mean timm/lion?)"),
        (["--dataset-type", "synthetic"], "--dataset-type synthetic needs --train-num-samples"),
        (["--imagenet-v2", "/nonexistent/v2"], "--imagenet-v2 folder not found"),
    ],
    ids=["opt", "synthetic", "imagenet_v2"],
)
def test_bad_values_are_one_line_and_nonzero(tmp_path, capsys, monkeypatch, extra, expect):
    # errors of the run config: raised before the world starts, so `python -m dsclip`'s main in this process
    # gives the same exit code and stderr as a subprocess would (test_bad_device_... covers the real exit path)
    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    assert_bad_train_in_process(tmp_path, capsys, extra, expect)
