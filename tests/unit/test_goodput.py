"""The goodput ledger (issue 65): every second to exactly one kind, spans nesting, overlapping writes apart,
starts summed from the run folder, and what the end line, TensorBoard and exit_status.json carry."""

from __future__ import annotations

import json

import pytest

from dsclip.train import goodput as gp
from dsclip.train.goodput import Goodput, summarize, summary_text
from dsclip.train.progress import summary_line


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def _start(clock: FakeClock) -> Goodput:
    """A start as the loop ticks it: 4 s start-up with a 1.5 s resume in it, the first batch after 0.5 s more,
    three steps of 2 s with 0.25 s input waits, a 3 s save in the second, a 1 s evaluation, 0.75 s to the end."""
    g = Goodput(clock=clock, start=clock() - 2.0)  # the process started 2 s before the ledger was made
    clock.advance(1.0)
    with g.span("resume"):
        clock.advance(1.5)
    clock.advance(1.0)
    g.tick("startup")  # the first batch is in: the start-up ends
    g.set_base("other")
    for i in range(3):
        if i:
            clock.advance(0.25)
            g.tick("data_wait")
        clock.advance(2.0)
        g.tick("step")
        if i == 1:
            with g.span("save"):
                clock.advance(3.0)
    g.add("background_write", 4.0)  # overlaps the steps: not part of the wall
    with g.span("eval"):
        clock.advance(1.0)
    clock.advance(0.75)
    return g


def test_every_second_goes_to_exactly_one_kind():
    clock = FakeClock()
    g = _start(clock)
    led = g.ledger()
    want = {"startup": 4.0, "resume": 1.5, "step": 6.0, "data_wait": 0.5, "save": 3.0, "eval": 1.0, "other": 0.75}
    assert led["seconds"] == {**dict.fromkeys(gp.KINDS, 0.0), **want}
    assert led["wall_s"] == 16.75 == sum(want.values())  # exactly, by construction (fake clock: exact binary sums)
    assert led["overlap_s"] == {"background_write": 4.0}
    rep = summarize([led])
    assert rep["goodput"] == rep["shares"]["step"] == 6.0 / 16.75
    assert sum(rep["shares"].values()) == pytest.approx(1.0, abs=1e-12)


def test_spans_nest_and_the_base_kind_takes_the_rest():
    clock = FakeClock()
    g = Goodput(clock=clock, start=clock())
    with g.span("eval"):
        clock.advance(1.0)
        with g.span("save"):  # the inner span's seconds are the inner kind's only
            clock.advance(2.0)
        clock.advance(0.5)
    clock.advance(1.0)  # outside any span: the base kind, start-up until the loop says otherwise
    g.set_base("stop")
    clock.advance(0.25)
    s = g.ledger()["seconds"]
    assert (s["eval"], s["save"], s["startup"], s["stop"]) == (1.5, 2.0, 1.0, 0.25)
    with pytest.raises(ValueError, match="not an overlapping kind"):
        g.add("save", 1.0)  # a stall is a span, never an added overlap


def test_starts_are_summed_from_the_run_folder(tmp_path):
    first = Goodput(clock=FakeClock(), start=100.0)
    first.attach(tmp_path)
    first.path = first.path.with_name("start-1.json")  # two starts of one second apart would share a name
    clock = first.clock
    clock.advance(3.0)
    first.tick("startup")
    clock.advance(5.0)
    first.tick("step")
    first.save()
    # the requeued start: its own clock, its ledger beside the first one's
    clock2 = FakeClock(500.0)
    second = Goodput(clock=clock2, start=500.0)
    second.attach(tmp_path)
    with second.span("resume"):
        clock2.advance(2.0)
    clock2.advance(7.0)
    second.tick("step")
    (tmp_path / "goodput" / ".start-x.json.tmp").write_text("{half")  # a start killed mid-write: ignored
    rep = second.report()
    assert sorted(p.name for p in (tmp_path / "goodput").glob("start-*.json")) == sorted(
        ["start-1.json", second.path.name]
    )
    assert rep["starts"] == 2 and rep["wall_s"] == 8.0 + 9.0
    assert (rep["seconds"]["step"], rep["seconds"]["startup"], rep["seconds"]["resume"]) == (12.0, 3.0, 2.0)
    assert rep["goodput"] == 12.0 / 17.0
    assert rep["this_start"]["starts"] == 1 and rep["this_start"]["wall_s"] == 9.0
    assert json.loads(second.path.read_text())["seconds"]["step"] == 7.0


def test_end_line_says_the_shares_and_the_overlap_apart():
    clock = FakeClock()
    rep = summarize([_start(clock).ledger(), None])
    text = summary_text(rep)
    assert text.startswith("goodput 35.8% of 17s (steps 35.8%, input wait 3.0%, start-up 23.9%, resume load 9.0%, ")
    assert "save stalls 17.9%, evaluations 6.0%, other 4.5%)" in text and "stop/hang" not in text  # 0 s: left out
    assert text.endswith("+ background writes 4.0 s overlapping the steps (not in the 100%)")
    line = summary_line(
        step=3, steps_run=3, wall_s=16.75, samples_per_s=1.0, checkpoint=None, evaluation=None, goodput=text
    )
    assert line.endswith(" | " + text)
    two = summarize([_start(FakeClock()).ledger(), _start(FakeClock()).ledger()])
    assert " over 2 starts " in summary_text(two) and two["goodput"] == rep["goodput"]
    scalars = gp.scalars(rep)
    assert scalars["goodput/goodput"] == rep["goodput"] and scalars["goodput/save_share"] == 3.0 / 16.75
    assert scalars["goodput/background_write_s"] == 4.0


def test_process_start_is_before_now_and_after_boot():
    import time

    now = time.perf_counter()
    start = gp.process_start()
    assert start <= time.perf_counter()
    # this interpreter started before the test session's imports, so before `now`; and not before boot
    assert start <= now and now - start < float(open("/proc/uptime").read().split()[0]) + 1


def test_a_ledger_that_cannot_be_written_never_stops_training(tmp_path, caplog):
    clock = FakeClock()
    g = Goodput(clock=clock, start=clock())
    (tmp_path / "goodput").write_text("a file where the folder would be")  # mkdir fails as on a full disk
    g.attach(tmp_path)
    clock.advance(2.0)
    g.tick("step")
    assert g.save()["seconds"]["step"] == 2.0 and g.report()["goodput"] == 1.0  # still reported
    assert sum("goodput:" in r.getMessage() for r in caplog.records) == 1  # said once
