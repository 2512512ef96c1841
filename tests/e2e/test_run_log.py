"""RUN/out.log holds the console's lines, the same ones in the same order, from the first (issue #33: the
rank line, the engine patches line and the resumed-from lines were missing, said before the file existed or
with print()).

A fresh run and its resumption (tiny model, 2 + 1 steps, one CPU rank), stdout and stderr read as one stream
as a terminal shows them. Left out of the comparison: DeepSpeed's own log lines ("[2026-12-03 12:00:00,000]
[WARNING] [real_accelerator.py:...]"), which its logger prints itself, outside dsclip. The torchcompile line
and the preflight lines (tokenizer default, DeepSpeed range) go through the same dsclip.console.say
(tests/unit/test_run_log.py covers lines said before the run folder exists).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.e2e.test_train_cli import PY, ROOT, env

DEEPSPEED_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] ")


def _run(tmp_path, max_steps: int, times: list | None = None) -> list[str]:
    args = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "r", "--batch-size", "8"]
    args += ["--max-steps", str(max_steps), "--save-every-n-steps", "2", "--resume", "latest"]
    before = time.time()
    p = subprocess.run(
        [PY, "-m", "dsclip", *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300,
    )  # fmt: skip
    if times is not None:
        times.append((before, time.time()))  # when the process was started and when it had ended
    assert p.returncode == 0, p.stdout[-4000:]
    return [x for x in p.stdout.splitlines() if x.strip() and not DEEPSPEED_LINE.match(x)]


def test_out_log_holds_the_console_lines_in_order_across_a_resume(tmp_path):
    times: list = []
    first = _run(tmp_path, 2, times)
    second = _run(tmp_path, 3, times)
    for lines in (first, second):
        assert any(x.startswith("[dsclip] rank 0/1 ") for x in lines)  # world set-up, before the run folder
        assert any(x.startswith("[dsclip] rank 0 patches ") for x in lines)  # engine patches
        assert any(x.startswith("dsclip: tiny | world 1 |") for x in lines)  # the run header
        assert any(x.startswith("done: ") for x in lines)
    assert any(x.startswith("resumed from ") for x in second)
    assert any(x.startswith("resume: schedule length 3 steps") for x in second)

    log = (tmp_path / "r" / "out.log").read_text().splitlines()
    console = [x.split(" | dsclip.console | ", 1)[1] for x in log if " | dsclip.console | " in x]
    assert console == first + second  # every console line, nothing else, in the console's order
    # how the last start ended, for the batch scripts (a finished run: exit 0, its last checkpoint)
    status = json.loads((tmp_path / "r" / "exit_status.json").read_text())
    last = str(tmp_path / "r" / "checkpoints" / "step_000000003")
    good = status.pop("goodput")
    assert status == {"exit_code": 0, "stop": "finished", "step": 3, "checkpoint": last}, status
    _check_goodput(tmp_path / "r", good, times, first, second)


def _check_goodput(run_dir, good: dict, times: list, first: list[str], second: list[str]) -> None:
    """Issue 65: both starts' wall time by kind, summed; each start's clock from its process's start."""
    starts = sorted(
        (json.loads(p.read_text()) for p in (run_dir / "goodput").glob("start-*.json")), key=lambda x: x["started_unix"]
    )
    assert len(starts) == good["starts"] == 2
    for led, (before, after) in zip(starts, times):
        # from the process's start (the kernel's clock ticks: 10 ms), not from when training code began
        assert before - 0.05 <= led["started_unix"] <= led["started_unix"] + led["wall_s"] <= after + 0.05
        assert abs(sum(led["seconds"].values()) - led["wall_s"]) <= 0.01 * led["wall_s"]  # every second, once
        assert led["seconds"]["startup"] > 0 and led["seconds"]["step"] > 0 and led["seconds"]["save"] > 0
    # the run is both starts: the first's ledger and this start's up to its end line (its file, written once more
    # as the process ends, holds a little more: the loggers' closing)
    this = good["this_start"]
    assert this["starts"] == 1 and this["wall_s"] <= starts[1]["wall_s"]
    assert good["wall_s"] == pytest.approx(starts[0]["wall_s"] + this["wall_s"], rel=1e-9)
    for kind in ("step", "save", "resume", "startup"):
        assert good["seconds"][kind] == pytest.approx(starts[0]["seconds"][kind] + this["seconds"][kind], rel=1e-9)
    assert abs(sum(good["seconds"].values()) - good["wall_s"]) <= 0.01 * good["wall_s"]
    assert good["goodput"] == pytest.approx(good["seconds"]["step"] / good["wall_s"])
    assert starts[1]["seconds"]["resume"] > starts[0]["seconds"]["resume"]  # only the second loaded a checkpoint
    # the end lines: the first start's own goodput, the second's summed over both
    end1, end2 = (next(x for x in lines if x.startswith("done: ")) for lines in (first, second))
    assert " | goodput " in end1 and " starts " not in end1
    assert f" | goodput {100 * good['goodput']:.1f}% of " in end2 and " over 2 starts (steps " in end2
