"""A run folder that holds checkpoints is never started over by accident (issue 52), through the CLI: every
case runs in ONE process (run_cli_cases) on copies of the shared 3-step tiny run. Also the small items: every
resume leaves a ``{"resumed_from": step}`` record in metrics.jsonl, and ``--resume latest`` with nothing to
resume says that it starts fresh."""

from __future__ import annotations

import json
import shutil

from tests.e2e.test_faults import CONST_LR_ARGS
from tests.e2e.test_train_cli import ROOT, run_cli_cases


def _steps(run_dir):
    return [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss' in ln]


def test_same_name_refused_resume_forms_continue_overwrite_starts_over(tmp_path, tiny_const_lr_run):
    runs = {k: tmp_path / k for k in ("again", "forms", "over")}
    for d in runs.values():
        shutil.copytree(tiny_const_lr_run, d)
    (runs["over"] / "checkpoints" / "step_000000003" / "old-run-marker").write_text("x")
    ck = runs["forms"] / "checkpoints"
    forms = ["latest", str(runs["forms"]), str(ck), str(ck / "latest"), str(ck / "step_000000002")]
    failed = tmp_path / "failed"  # a run that failed at its start: logs, no checkpoint
    failed.mkdir()
    (failed / "out.log").write_text("OLD-LOG-LINE\n")
    (failed / "metrics.jsonl").write_text(json.dumps({"step": 7, "loss_last": 1.0}) + "\n")
    before = {p.name: p.read_bytes() for p in runs["again"].iterdir() if p.is_file() and p.name != ".lock"}
    cases = {
        "again": CONST_LR_ARGS(tmp_path, "again", "--seed", "5"),
        **{f"form{i}": CONST_LR_ARGS(tmp_path, "forms", "--resume", f) for i, f in enumerate(forms)},
        "over": CONST_LR_ARGS(tmp_path, "over", "--max-steps", "2", "--overwrite"),
        "failed": CONST_LR_ARGS(tmp_path, "failed", "--max-steps", "1"),
        "fresh": CONST_LR_ARGS(tmp_path, "fresh", "--max-steps", "1", "--resume", "latest"),
    }
    out = run_cli_cases(cases)
    rc, err = out["again"]
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("dsclip train: error:")]
    assert len(lines) == 1 and "already holds checkpoints (latest: step 3, step_000000003)" in lines[0], err[-2000:]
    assert "--resume latest" in lines[0] and "another --name" in lines[0]
    after = {p.name: p.read_bytes() for p in runs["again"].iterdir() if p.is_file() and p.name != ".lock"}
    assert after == before  # nothing written: no second history in metrics.jsonl/out.log
    for i in range(len(forms)):
        assert out[f"form{i}"][0] == 0, out[f"form{i}"][1][-2000:]  # every form --resume takes still continues
    records = [json.loads(ln) for ln in (runs["forms"] / "metrics.jsonl").read_text().splitlines()]
    marks = [(i, r["resumed_from"]) for i, r in enumerate(records) if "resumed_from" in r]
    assert [m for _, m in marks] == [3, 3, 3, 3, 2], marks  # one marker per resume, naming its step
    step3 = [i for i, r in enumerate(records) if r.get("step") == 3 and "loss" in r]
    assert len(step3) == 2 and step3[0] < marks[-1][0] < step3[1]  # the re-run step 3 follows its marker
    assert out["over"][0] == 0, out["over"][1][-2000:]
    over = runs["over"]
    assert sorted(p.name for p in (over / "checkpoints").glob("step_*")) == ["step_000000001", "step_000000002"]
    assert not (over / "checkpoints" / "step_000000003").exists()  # the old run's tags: gone, not mixed
    assert _steps(over) == [1, 2]  # one history
    assert "--overwrite: deleting the earlier run" in (over / "out.log").read_text()
    demo = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "--name demo --overwrite" in demo  # `make demo` twice: the second starts over, as README says
    assert out["failed"][0] == 0, out["failed"][1][-2000:]
    log = (failed / "out.log").read_text()
    assert "holds no checkpoint" in log and "reusing it" in log and "OLD-LOG-LINE" not in log
    assert _steps(failed) == [1]
    assert out["fresh"][0] == 0
    assert "--resume latest: no checkpoint in" in (tmp_path / "fresh" / "out.log").read_text()
