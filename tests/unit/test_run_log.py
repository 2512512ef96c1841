"""dsclip.console: the lines said before the run folder exists reach RUN/out.log first, in order (issue #33)."""

import logging
import sys

import pytest

from dsclip import console
from dsclip.train import runlog
from dsclip.train.metrics import LogArgs


@pytest.fixture
def fresh_console():
    console.begin()
    yield
    console.begin()  # detach the test's run-log handlers
    console.take_early()
    logging.getLogger("dsclip").setLevel(logging.NOTSET)


def _messages(path):
    return [
        line.split(" | dsclip.console | ", 1)[1] for line in path.read_text().splitlines() if "dsclip.console" in line
    ]


def test_early_lines_go_first_into_the_run_log_and_only_into_their_run(tmp_path, capsys, fresh_console):
    console.say("dsclip: no --tokenizer: using OpenCLIP's tokenizer")  # preflight, before any run folder
    console.say("[dsclip] rank 0/1 local 0/1", stream=sys.stderr)  # the world set-up's stderr line
    runlog.setup(LogArgs(), tmp_path / "a", rank=0)
    console.say("dsclip: tiny | world 1")
    out, err = capsys.readouterr()
    assert out.splitlines() == ["dsclip: no --tokenizer: using OpenCLIP's tokenizer", "dsclip: tiny | world 1"]
    assert err.splitlines() == ["[dsclip] rank 0/1 local 0/1"]
    assert _messages(tmp_path / "a" / "out.log") == [
        "dsclip: no --tokenizer: using OpenCLIP's tokenizer",
        "[dsclip] rank 0/1 local 0/1",
        "dsclip: tiny | world 1",
    ]

    # a second run in this process: its early lines go to its own file, not into the first run's
    console.begin()
    console.say("resumed from X at step 2")
    runlog.setup(LogArgs(), tmp_path / "b", rank=0)
    assert _messages(tmp_path / "b" / "out.log") == ["resumed from X at step 2"]
    assert "resumed" not in (tmp_path / "a" / "out.log").read_text()


def test_a_rank_without_a_log_file_stops_keeping_lines(tmp_path, capsys, fresh_console):
    console.say("[dsclip] rank 1/2")
    assert runlog.setup(LogArgs(), tmp_path, rank=1) is None  # only rank 0 writes out.log without --log-local
    assert console.take_early() == []
    console.say("later")
    assert console.take_early() == []  # nothing kept once the question is settled
