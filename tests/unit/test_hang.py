"""The hang bounds without a world (issue 58): the watchdog's arithmetic on a fake clock, the ranks' signs of
life in a fake store, who is named stuck, the line and the resume command, the flags' checks, torch's
flight-recorder variables, and the guard's arming and ending with the process group's calls replaced.
No watchdog thread is started and nothing sleeps (the real thing: tests/e2e/test_hang.py, tests/dist/test_hang.py)."""

from __future__ import annotations

import json
import math
import threading
from datetime import timedelta

import pytest

from dsclip.config import make_run_config
from dsclip.config_base import ConfigError
from dsclip.engine.ds_config import TrainArgs
from dsclip.engine.world import process_group, watchdog
from dsclip.train import hang
from dsclip.train.goodput import Goodput


class Clock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _watchdog(clock, floor=10.0, factor=4.0, **kw):
    return watchdog.StepWatchdog(watchdog.StepBound(floor, factor), on_hang=lambda found: None, clock=clock, **kw)


def test_a_step_may_take_the_floor_or_factor_times_the_slowest_of_the_last_20():
    clock = Clock()
    wd = _watchdog(clock)
    clock.t += 9.9
    assert wd.overdue() is None  # under the floor before any step finished
    clock.t += 0.2
    found = wd.overdue()
    assert found.what == "step 1" and found.limit_s == 10.0 and found.last_step == 0
    wd.step_done(1)  # that step took 10.1 s: the next may take 4 x 10.1
    clock.t += 40.0
    assert wd.overdue() is None
    clock.t += 0.5
    assert wd.overdue().limit_s == pytest.approx(40.4) and "slowest recent step 10.10 s" in wd.overdue().bound
    for step in range(2, 22):  # 20 quick steps push the slow one out of the window
        wd.step_done(step)
        clock.t += 1.0
    wd.step_done(22)
    clock.t += 10.5
    found = wd.overdue()
    assert (found.what, found.last_step, found.limit_s) == ("step 23", 22, 10.0)


def test_a_phase_has_its_own_limit_and_its_time_is_not_step_time():
    clock = Clock()
    wd = _watchdog(clock)
    with wd.phase("checkpoint save", 60.0):
        clock.t += 59.0
        assert wd.overdue() is None
        clock.t += 2.0
        found = wd.overdue()
        assert found.what == "checkpoint save" and found.limit_s == 60.0 and "60 s for a checkpoint save" in found.bound
    clock.t += 9.0
    assert wd.overdue() is None  # the step clock restarted when the save ended
    wd.step_done(1)
    assert wd.slowest_s == pytest.approx(9.0)  # the 61 s save is not among the steps


def test_a_long_save_ends_only_when_a_peer_is_silent_for_longer_than_the_step_bound():
    clock, wall, store = Clock(), Clock(1000.0), FakeStore()
    me, peer = (watchdog.Liveness(store, r, 2, wall=wall) for r in (0, 1))
    wd = _watchdog(clock, floor=60.0, liveness=me)  # peers asked every 10 s (floor / 6) once past the bound
    with wd.phase("checkpoint save", 1800.0):
        for _ in range(12):  # 120 s of a slow save, both ranks stamping: not a hang
            clock.t += 10.0
            wall.t += 10.0
            me.beat()
            peer.beat()
            assert wd.frozen_peer() is None and wd.overdue() is None
        for _ in range(7):  # the peer freezes: silent for over 60 s at the seventh check
            clock.t += 10.0
            wall.t += 10.0
            me.beat()
            found = wd.frozen_peer()
        assert found is not None and found.what == "checkpoint save" and "with a peer silent as long" in found.bound
        assert wd.overdue() is None  # the save's own 1800 s are far away
        clock.t += 5.0
        assert wd.frozen_peer() is None  # not asked again before 10 s
        store.down = True
        clock.t += 10.0
        assert wd.frozen_peer() is None  # the store's first silence may be a slow moment
        clock.t += 10.0
        assert wd.frozen_peer().what == "checkpoint save"  # twice running: its host is frozen
    assert wd.frozen_peer() is None  # between phases the step bound rules


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.down = False
        self.frozen = threading.Event()
        self.frozen.set()

    def set(self, key, value):
        self._up()
        self.data[key] = value.encode()

    def check(self, keys):
        self._up()
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        self._up()
        return [self.data[k] for k in keys]

    def _up(self):
        if self.down:
            raise RuntimeError("wait timeout after 5000ms")
        self.frozen.wait()  # a frozen host: no answer, whatever the store's timeout


@pytest.fixture
def frozen_store():
    store = FakeStore()
    yield store
    store.frozen.set()  # lets a blocked asker thread finish


def test_a_rank_whose_stamp_stopped_is_silent_and_a_store_that_does_not_answer_says_none():
    store, wall = FakeStore(), Clock(1000.0)
    ranks = [watchdog.Liveness(store, r, 4, wall=wall) for r in range(4)]
    for r in (0, 1, 2):
        ranks[r].beat()
    wall.t += 30.0
    ranks[0].beat()
    ranks[2].beat()
    assert ranks[0].silent(10.0) == {1: pytest.approx(30.0), 3: None}  # 1 froze, 3 never stamped
    assert ranks[2].silent(40.0) == {3: None}
    store.down = True
    assert ranks[0].silent(10.0) is None
    ranks[0].beat()  # a store that stopped answering is not asked again each poll (it would wait its timeout)
    store.down = False
    ranks[0].beat()
    assert float(store.data["dsclip/alive/0"]) == 1030.0


def test_a_store_whose_host_is_frozen_is_no_answer_not_a_wait(frozen_store):
    me = watchdog.Liveness(frozen_store, 0, 2, wall=Clock(1000.0))
    me.beat()
    frozen_store.frozen.clear()
    assert me.silent(10.0, answer_s=0.01) is None


def test_who_is_named_stuck():
    assert hang.stuck_text(0, 512, {17: 190.2, 300: 185.0}, store_asked=True).startswith(
        "ranks 17, 300 (no sign of life for 185 s: stopped or frozen)"
    )
    assert hang.stuck_text(0, 2, {1: None}, store_asked=True) == "rank 1 (no sign of life: stopped or frozen)"
    assert hang.stuck_text(1, 2, None, store_asked=True).startswith("rank 0 (the job's store does not answer")
    assert hang.stuck_text(3, 8, None, store_asked=True).startswith("rank 0 or a peer (the job's store")
    assert hang.stuck_text(0, 2, {}, store_asked=True).startswith("rank 1 or this one (every process is alive")
    assert hang.stuck_text(0, 8, {}, store_asked=True).startswith("a peer of 8 ranks (every process is alive")
    assert hang.stuck_text(1, 2, None, store_asked=False) == "rank 0"
    assert hang.stuck_text(0, 1, None, store_asked=False).startswith("this rank (a world of 1")


def test_the_resume_command_is_the_rank_s_own_with_the_run_name_and_resume_latest():
    argv = ["/x/dsclip/__main__.py", "--local_rank=1", "train", "--config", "tiny", "--resume", "step_4", "--lr=1e-3"]
    args = hang.command_args(argv)
    assert args == ["--config", "tiny", "--resume", "step_4", "--lr=1e-3"]
    assert hang.resume_command(args, "2026_12_07-run") == (
        "dsclip train --config tiny --lr=1e-3 --name 2026_12_07-run --resume latest"
    )
    assert hang.resume_command(["--name=mine", "--resume=x", "--logs", "/a b"], "mine") == (
        "dsclip train --name=mine --logs '/a b' --resume latest"
    )
    line = hang.hang_line(rank=0, what="step 7 has run 12 s", stuck="rank 1", last_step=6, latest=None, resume="R")
    assert line.startswith("rank 0: hung: step 7 has run 12 s; stuck: rank 1; last step done: 6;")
    assert "no checkpoint was saved yet" in line and line.endswith("continue with --resume latest: R")


@pytest.mark.parametrize(
    "key,value,expect",
    [
        ("step_timeout", -1, "'step_timeout' must be >= 0 seconds (0: off), got -1"),
        ("collective_timeout", math.nan, "'collective_timeout' must be >= 0 seconds"),
        ("step_timeout_factor", 0.5, "'step_timeout_factor' must be >= 1"),
    ],
)
def test_bad_bounds_are_refused_with_the_flag_named(key, value, expect):
    with pytest.raises(ConfigError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        make_run_config({key: value})
    ok = make_run_config({"step_timeout": 0, "collective_timeout": 0, "step_timeout_factor": 1}).train
    assert (ok.step_timeout, ok.collective_timeout, ok.step_timeout_factor) == (0, 0, 1)


def test_flight_recorder_variables_are_set_where_unset_and_the_user_s_are_kept(tmp_path):
    env: dict[str, str] = {}
    done = watchdog.flight_recorder_env(tmp_path, "run1", env)
    assert (
        env
        == done
        == {
            "TORCH_FR_BUFFER_SIZE": "2000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "flight_recorder" / "run1_rank_"),
        }
    )
    assert not (tmp_path / "flight_recorder").exists()  # gloo dumps nothing: no empty folder
    # the user's own values, under torch's older names too, are never overridden
    env = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/",
    }
    assert watchdog.flight_recorder_env(tmp_path, None, env) == {}
    assert set(env) == {"TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    env = {}
    watchdog.flight_recorder_env(tmp_path, None, env, make_dir=True)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_recorder" / "rank_")
    assert (tmp_path / "flight_recorder").is_dir()


@pytest.fixture
def guard_world(monkeypatch, tmp_path):
    """A HangGuard of rank 0 of 2 on a fake clock: the timeouts it sets are recorded, its watchdog's thread
    is not started, its exit raises instead of ending pytest."""
    timeouts: list[float] = []
    monkeypatch.setattr(process_group, "long_timeout", lambda: timedelta(seconds=1800))
    monkeypatch.setattr(process_group, "set_collective_timeout", lambda t: timeouts.append(t.total_seconds()))
    monkeypatch.setattr(watchdog.StepWatchdog, "start", lambda self: None)

    def make(train: TrainArgs, store=None):
        clock = Clock()
        guard = hang.HangGuard(
            train, rank=0, world_size=2, run_dir=tmp_path, name="run", latest=lambda: str(tmp_path / "ck" / "step_4"),
            start_step=4, argv=["--config", "tiny"], clock=clock, store=store,
        )  # fmt: skip
        return guard, clock

    return make, timeouts


def test_the_guard_arms_after_two_steps_and_gives_saves_the_long_timeout(guard_world):
    make, timeouts = guard_world
    guard, clock = make(TrainArgs(step_timeout=30, step_timeout_factor=10, collective_timeout=20), store=FakeStore())
    clock.t += 3.0  # the first steps of a start are slow (compilation, loader start)
    guard.step_done(5)
    assert not guard.armed and timeouts == []
    clock.t += 1.0
    guard.step_done(6)
    assert guard.armed and timeouts == [30.0]  # max(--collective-timeout 20, 10 x slowest first step 3 s)
    assert guard.watchdog.last_step == 6 and guard.watchdog.slowest_s == 0.0  # warm-up steps are not in its window
    with guard.slow("checkpoint save"):
        assert timeouts == [30.0, 1800.0]
        clock.t += 100.0
        assert guard.watchdog.overdue() is None  # the save has 1800 s
    assert timeouts == [30.0, 1800.0, 30.0]
    clock.t += 31.0
    assert guard.watchdog.overdue().what == "step 7"
    guard.close()
    assert timeouts[-1] == 1800.0 and not guard.armed


def test_a_hang_says_one_line_writes_the_exit_status_and_exits_2(guard_world, monkeypatch, capsys, tmp_path):
    make, _ = guard_world
    store = FakeStore()
    guard, clock = make(TrainArgs(step_timeout=10, collective_timeout=0), store=store)
    guard.goodput = Goodput(clock=clock, start=clock.t - 20.0)  # the start's ledger, on the same clock
    guard.goodput.set_base("other")
    guard.step_done(5)
    guard.step_done(6)
    guard.goodput.tick("step")  # as the loop ticks a finished step
    assert guard.short is None  # --collective-timeout 0: the long one stays
    guard.watchdog.liveness.wall = Clock(5000.0)
    watchdog.Liveness(store, 1, 2, wall=Clock(4000.0)).beat()  # rank 1's last stamp: 1000 s ago
    clock.t += 11.0

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(hang.os, "_exit", exit_)
    with pytest.raises(SystemExit) as e:
        guard.on_hang(guard.watchdog.overdue())
    assert e.value.code == hang.EXIT_HUNG == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("dsclip train: error:")]
    assert len(err) == 1, err
    line = err[0]
    assert "rank 0: hung: step 7 has run 11 s" in line and "stuck: rank 1 (no sign of life for 1000 s" in line
    assert f"last step done: 6; latest names {tmp_path / 'ck' / 'step_4'}, untouched" in line
    assert line.endswith("continue with --resume latest: dsclip train --config tiny --name run --resume latest")
    status = json.loads((tmp_path / "exit_status.json").read_text())
    good = status.pop("goodput")
    assert status == {"exit_code": 2, "stop": "hung", "step": 6, "checkpoint": str(tmp_path / "ck" / "step_4")}
    # the hung step's 11 s, from the last finished step to the line, are the hang's; the 20 s before, the start-up
    assert good["wall_s"] == 31.0 and good["seconds"]["stop"] == 11.0 and good["seconds"]["startup"] == 20.0


def test_collective_timeouts_are_recognised_and_other_errors_are_not():
    gloo = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation")
    assert process_group.collective_timed_out(gloo) == "Timed out waiting 5000ms for recv operation"
    nccl = RuntimeError("[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE)")
    assert "WorkNCCL(SeqNum=9" in process_group.collective_timed_out(nccl)
    assert process_group.collective_timed_out(RuntimeError("Connection closed by peer")) is None
    assert process_group.collective_timed_out(ValueError("Timed out waiting")) is None


def test_the_collective_timeout_never_exceeds_the_process_group_s_own(guard_world, monkeypatch):
    make, timeouts = guard_world
    monkeypatch.setattr(process_group, "long_timeout", lambda: timedelta(seconds=10))  # DSCLIP_DIST_TIMEOUT=10
    guard, _ = make(TrainArgs(collective_timeout=300, step_timeout=0))
    guard.step_done(5)
    guard.step_done(6)
    assert timeouts == [10.0] and guard.watchdog is None  # --step-timeout 0: no watchdog


def test_a_collective_that_times_out_in_a_save_names_the_save_and_the_long_timeout(guard_world, monkeypatch, capsys):
    make, _ = guard_world
    guard, _ = make(TrainArgs(step_timeout=0, collective_timeout=20))
    guard.step_done(5)
    guard.step_done(6)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(hang.os, "_exit", exit_)
    with pytest.raises(SystemExit), guard.slow("save of checkpoint step_000000006"):
        guard.collective_timed_out("Timed out waiting 1800000ms for recv operation to complete")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "a collective of the save of checkpoint step_000000006 waited out the 1800 s collective timeout" in line
    assert "stuck: rank 1;" in line  # no watchdog, so no signs of life: the other of 2 ranks
