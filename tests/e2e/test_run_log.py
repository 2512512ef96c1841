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

from tests.e2e.test_train_cli import PY, ROOT, env

DEEPSPEED_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] \[[A-Z]+\] ")


def _run(tmp_path, max_steps: int) -> list[str]:
    args = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "r", "--batch-size", "8"]
    args += ["--max-steps", str(max_steps), "--save-every-n-steps", "2", "--resume", "latest"]
    p = subprocess.run(
        [PY, "-m", "dsclip", *args], cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:]
    return [x for x in p.stdout.splitlines() if x.strip() and not DEEPSPEED_LINE.match(x)]


def test_out_log_holds_the_console_lines_in_order_across_a_resume(tmp_path):
    first = _run(tmp_path, 2)
    second = _run(tmp_path, 3)
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
    assert status == {"exit_code": 0, "stop": "finished", "step": 3, "checkpoint": last}, status
