"""`dsclip train` as users run it: the deepspeed launcher with 2 CPU ranks, and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsclip.cli import main as cli_main
from dsclip.testing.gloo_world import free_port

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
DEEPSPEED = str(Path(PY).parent / "deepspeed")


def env():
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run_cli(args, *, world=1, timeout=600, check=True):
    if world == 1:
        cmd = [PY, "-m", "dsclip", *args]
    else:
        cmd = [DEEPSPEED, "--num_gpus", str(world), "--master_port", str(free_port()), "--module", "dsclip", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def assert_one_error_line(stderr: str, expect: str) -> None:
    """A bad-input failure as users see it: no traceback, exactly one `dsclip train: error:` line naming ``expect``."""
    assert "Traceback" not in stderr
    err = [line for line in stderr.splitlines() if line.startswith("dsclip train: error:")]
    assert len(err) == 1 and expect in err[0], stderr[-3000:]


def bad_train_args(tmp_path: Path, extra: list[str]) -> list[str]:
    return ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "bad", *extra]


def assert_bad_train_process(tmp_path: Path, extra: list[str], expect: str) -> None:
    """`dsclip train --config tiny EXTRA` as a real process: exit code 2, one error line naming ``expect``,
    no checkpoint written."""
    p = run_cli(bad_train_args(tmp_path, extra), check=False)
    assert p.returncode == 2, p.stderr[-3000:]
    assert_one_error_line(p.stderr, expect)
    assert not (tmp_path / "bad" / "checkpoints").exists() and os.path.isdir(tmp_path)


def assert_bad_train_in_process(tmp_path: Path, capsys, extra: list[str], expect: str) -> None:
    """The same through the CLI's main in this process (errors raised before the world starts: the exit code
    and stderr a subprocess would give, without seconds of process start)."""
    from dsclip.cli import main as cli_main

    rc = cli_main(bad_train_args(tmp_path, extra))
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert_one_error_line(err, expect)
    assert not (tmp_path / "bad" / "checkpoints").exists() and os.path.isdir(tmp_path)


def losses(run_dir: Path) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss_last"]
    return out


# bf16 at both stages: fp32 runs through the same launcher, train and resume at both stages elsewhere (with
# --accum-freq 2: test_finetune.py test_locked_run_checkpoints_resumes_and_converts_every_weight; across world
# sizes: test_checkpoint_resume.py; killed: test_checkpoint_crash.py), ~30 s of CI per case.
@pytest.mark.dist
@pytest.mark.parametrize("ds_config", ["zero2_bf16", "zero3_bf16"])
def test_two_rank_deepspeed_launcher_trains_and_resumes_exactly(tmp_path, ds_config):
    common = [
        "train",
        "--config",
        "tiny",
        "--logs",
        str(tmp_path),
        "--deepspeed-config",
        f"ds_configs/{ds_config}.json",
        "--max-steps",
        "10",
        "--lr-scheduler",
        "cosine",
        "--warmup",
        "2",
        "--save-every-n-steps",
        "5",
        "--batch-size",
        "8",
        "--accum-freq",
        "2",
        "--precision",
        "auto",
    ]
    # --zeroshot-data at the end of training (--max-steps 10 is mid-epoch): collective under ZeRO-3, every rank runs it
    full = run_cli(common + ["--name", "full", "--zeroshot-data", "demo"], world=2)
    run = tmp_path / "full"
    results = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    assert [r["step"] for r in results if "zeroshot" in r] == [10], results
    curve = losses(run)
    assert sorted(curve) == list(range(1, 11))
    first, last3 = curve[1], sum(curve[k] for k in (8, 9, 10)) / 3
    assert last3 < first - 0.05, f"loss did not decrease: {curve}"
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000000010"
    for tag in ("step_000000005", "step_000000010"):
        assert (ckpts / tag / "COMPLETE").exists()
    rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["world_size"] == 2 and r["effective_batch"] == 8 * 2 * 2 for r in rec if "loss" in r)
    assert "zeroshot" in full.stdout

    # Resume from step 5 into a new run folder: steps 6..10 must reproduce the uninterrupted curve.
    run_cli(common + ["--name", "resumed", "--resume", str(ckpts / "step_000000005")], world=2)
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == list(range(6, 11))
    tol = 1e-5 if "fp32" in ds_config else 2e-2
    for step, value in resumed.items():
        assert value == pytest.approx(curve[step], abs=tol), (step, value, curve[step])


def write_val_shards(out: Path, n: int = 12) -> str:
    """A retrieval set for --val-data: ``n`` held-out demo images with their captions, in shards of 6."""
    from PIL import Image

    from dsclip.data.demo import DemoDataset
    from dsclip.data.tools import write_shards

    ds = DemoDataset.heldout(n, 32)
    (out / "img").mkdir(parents=True)
    samples = []
    for i in range(n):
        Image.fromarray(ds.render(i)).save(out / "img" / f"{i}.png")
        samples.append((str(out / "img" / f"{i}.png"), ds.caption(i)))
    write_shards(samples, out, shard_size=6, progress=False)
    return str(out / "shard-{00000..00001}.tar")


def test_resume_latest_without_checkpoint_starts_fresh_and_continues(tmp_path):
    """Also the log of a run stopped by --max-steps mid-epoch (step 4 of 64): the step line's timing and
    progress, "checkpoint saved:", the end-of-training evaluations in results.jsonl, the summary line, and
    out.log holding the console's lines, the run header included."""

    def args(max_steps):
        return [
            "train",
            "--config",
            "tiny",
            "--logs",
            str(tmp_path),
            "--name",
            "r",
            "--max-steps",
            str(max_steps),
            "--save-every-n-steps",
            "2",
            "--resume",
            "latest",
            "--report-to",
            "tensorboard",
        ]

    evals = ["--zeroshot-data", "demo", "--val-data", write_val_shards(tmp_path / "val")]
    first = run_cli(args(4) + evals)
    run = tmp_path / "r"
    assert "resumed from" not in first.stdout  # nothing to resume: a fresh start, as a requeued job wants
    # a one-rank run neither builds nor loads DeepSpeed's shm op, and DeepSpeed's noise stays out of the log
    for noise in ("built successfully", "untested optimizer", "bind cuda"):
        assert noise not in first.stdout + first.stderr, noise
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    out = first.stdout.splitlines()
    step4 = next(x for x in out if x.startswith("step 4/4 "))
    assert re.search(
        r"^step 4/4 ep 0 \[\s*64/1024 \(6%\)\] \| loss \S+ \| [\d.]+ s/step \(data [\d.]+ s, \d+%\) \| eta 0s \|", step4
    )
    for step in (2, 4):
        assert any(x.startswith(f"checkpoint saved: {run}/checkpoints/step_{step:09d} (step {step}, ") for x in out)
    # the end of training evaluated although no epoch ended, once, at the last step
    results = [json.loads(x) for x in (run / "results.jsonl").read_text().splitlines()]
    for name, key in (("zeroshot", "zeroshot-top1"), ("retrieval", "image_to_text_R@1")):
        got = [r for r in results if name in r]
        assert [(r["step"], r["epoch"]) for r in got] == [(4, 0)], results
        assert 0 <= got[0][name][key] <= 1
    done = [x for x in out if x.startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: step 4 (4 this run) in "), out[-5:]
    assert f"samples/s | checkpoint {run}/checkpoints/step_000000004 | last eval zeroshot-top1 " in done[0]
    log = (run / "out.log").read_text()
    header = next(x for x in out if x.startswith("dsclip: tiny | world 1 | "))
    for line in (header, step4, done[0]):
        assert f"| dsclip.console | {line}\n" in log

    # logging every 2nd step from here: step 5 is not logged, and without clipping computes no gradient norm
    second = run_cli(args(6) + ["--log-every-n-steps", "2"])
    assert "resumed from" in second.stdout and "step_000000004" in second.stdout
    assert sorted(losses(run)) == [1, 2, 3, 4, 6]  # one metrics.jsonl, continued
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    norms = {r["step"]: r["grad_norm"] for r in records if "loss" in r}
    assert all(isinstance(n, float) and 0 < n < float("inf") for n in norms.values()), norms  # every logged step


def test_torchcompile_run_trains_like_eager_and_evaluates(tmp_path):
    """The whole loop with compiled blocks: gradient-cache steps (K=2), checkpoint, end-of-run zero-shot
    (eval mode, no grad: more graphs). aot_eager traces exactly what inductor would lower, without a
    C++ build; inductor numerics are checked in tests/dist/test_gradcache.py."""
    common = ["train", "--config", "tiny", "--logs", str(tmp_path), "--max-steps", "4", "--batch-size", "8"]
    common += ["--accum-freq", "2", "--save-every-n-steps", "4", "--warmup", "1", "--precision", "fp32"]
    compiled = run_cli(common + ["--name", "compiled", "--torchcompile", "--torchcompile-backend", "aot_eager"])
    run_cli(common + ["--name", "eager"])
    a, b = losses(tmp_path / "compiled"), losses(tmp_path / "eager")
    assert sorted(a) == [1, 2, 3, 4]
    for step in a:
        assert a[step] == pytest.approx(b[step], abs=1e-4), (step, a, b)
    assert "zeroshot" in compiled.stdout
    assert "--torchcompile: 4 transformer blocks compiled in place with aot_eager" in compiled.stdout
    assert (tmp_path / "compiled" / "checkpoints" / "step_000000004" / "COMPLETE").exists()
    saved = (tmp_path / "compiled" / "run_config.yaml").read_text()
    assert "torchcompile: true" in saved and "torchcompile_backend: aot_eager" in saved


def _demo_tokenizer(tmp_path) -> str:
    from dsclip.data.demo import ensure_demo_tokenizer

    return ensure_demo_tokenizer(tmp_path / "tok")


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _bad_cases(tmp_path) -> dict[str, tuple[list[str], str]]:
    """case -> (dsclip argv, what its one error line says): errors raised after the world is up."""
    base = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "bad"]
    return {
        "unknown_json_key": (
            base + ["--deepspeed-config", _write(tmp_path, "k.json", '{"zero_optimisation": {}}')],
            "unknown key 'zero_optimisation'",
        ),
        "batch_mismatch": (
            base + ["--deepspeed-config", _write(tmp_path, "b.json", '{"train_batch_size": 1000}')],
            "'train_batch_size' is 1000",
        ),
        "unknown_model": (base + ["--model", "ViT-Q-99"], "ViT-B-32"),
        "invalid_json": (base + ["--deepspeed-config", _write(tmp_path, "j.json", "{nope")], "not valid JSON"),
        "fp16_on_cpu": (base + ["--precision", "fp16"], "fp16 is not supported by DeepSpeed on CPU"),
        "unknown_compile_backend": (
            base + ["--torchcompile", "--torchcompile-backend", "inductr"],
            "'inductr' is not a torch.compile backend",
        ),
        "missing_tokenizer": (base + ["--tokenizer", str(tmp_path / "none.model")], "sentencepiece model not found"),
        "missing_shards": (
            base
            + ["--tokenizer", _demo_tokenizer(tmp_path), "--train-data", str(tmp_path / "s" / "{00000..00003}.tar")],
            "00000.tar",
        ),
    }


def test_bad_input_is_one_line_and_nonzero(tmp_path):
    # the real exit path: `python -m dsclip` of its own, stopped by an error found after the world is up
    args, expect = _bad_cases(tmp_path)["fp16_on_cpu"]
    p = run_cli(args, check=False, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    err_lines = [line for line in p.stderr.splitlines() if line.startswith("dsclip train: error:")]
    assert len(err_lines) == 1 and expect in err_lines[0], p.stderr[-3000:]


# One process runs the CLI's main (what `python -m dsclip` calls) for each case in turn: a process start with
# torch + DeepSpeed imports and the world's init is ~10 s, the cases themselves milliseconds. The world stays
# up between cases (init_distributed is idempotent), as it would be when each case ran first.
_CASES_DRIVER = """
import json, sys
from dsclip.cli import main
for name, argv in json.loads(sys.argv[1]):
    print(f"@@case {name}", file=sys.stderr, flush=True)
    rc = main(argv)
    print(f"@@rc {rc}", file=sys.stderr, flush=True)
"""


def run_cli_cases(cases: dict[str, list[str]], e: dict | None = None, timeout: int = 300) -> dict[str, tuple[int, str]]:
    """Run ``dsclip ARGV`` for every case in ONE process; case -> (return code of main, that case's stderr)."""
    payload = json.dumps(list(cases.items()))
    p = subprocess.run(
        [PY, "-c", _CASES_DRIVER, payload], cwd=ROOT, env=e or env(), capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    out = {}
    for chunk in p.stderr.split("@@case ")[1:]:
        name, rest = chunk.split("\n", 1)
        rest, _, rc = rest.rpartition("@@rc ")
        out[name] = (int(rc.split()[0]), rest)
    assert list(out) == list(cases), p.stderr[-3000:]
    return out


def test_bad_inputs_after_the_world_is_up_are_one_line_and_nonzero(tmp_path):
    cases = {k: v for k, v in _bad_cases(tmp_path).items() if k != "fp16_on_cpu"}  # that one runs above
    results = run_cli_cases({name: argv for name, (argv, _) in cases.items()})
    for name, (_, expect) in cases.items():
        rc, err = results[name]
        assert rc == 2, (name, err[-3000:])
        err_lines = [line for line in err.splitlines() if line.startswith("dsclip train: error:")]
        assert len(err_lines) == 1 and expect in err_lines[0], (name, err[-3000:])


@pytest.mark.parametrize(
    "case, argv, expect",
    [
        ("missing_recipe", ["--config", "{tmp}/nope.yaml"], "recipe not found"),
        ("unknown_flag", ["--config", "tiny", "--batch-sise", "4"], "unknown flag --batch-sise"),
    ],
    ids=["missing_recipe", "unknown_flag"],
)
def test_bad_flags_are_one_line_in_process(tmp_path, capsys, monkeypatch, case, argv, expect):
    # raised while parsing, before any work: the CLI's main in this process gives the exit code and stderr a
    # subprocess would, without seconds of process start (the cases above cover the real exit path)
    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    rc = cli_main(["train", *[a.format(tmp=tmp_path) for a in argv], "--logs", str(tmp_path), "--name", "bad"])
    err = capsys.readouterr().err
    assert rc == 2, (case, err[-3000:])
    err_lines = [line for line in err.splitlines() if line.startswith("dsclip train: error:")]
    assert len(err_lines) == 1 and expect in err_lines[0] and "Traceback" not in err, (case, err[-3000:])
