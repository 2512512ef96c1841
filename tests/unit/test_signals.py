"""One meaning per signal (README "Signals"): SIGUSR1 = save + exit 85 (the batch scripts requeue),
SIGTERM = save + exit 143 (not requeued), a second SIGTERM = stop now. Duplicate deliveries of one
scancel (within TERM_REPEAT_S) count once."""

from __future__ import annotations

import pytest

from dsclip.engine.world import stop


@pytest.fixture
def handlers(monkeypatch):
    import signal

    for k, v in {"signum": None, "usr1": False, "term": False, "first_at": None, "saved_code": None}.items():
        monkeypatch.setitem(stop._preempt, k, v)
    old = {s: signal.getsignal(s) for s in stop.PREEMPT_SIGNALS}
    stop.install_preemption_handler()
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_usr1_means_save_and_requeue(handlers):
    import os
    import signal

    assert stop.preemption_requested(sync=False) is None
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.preemption_requested() == stop.STOP_REQUEUE  # no process group: local answer
    assert stop.exit_code(stop.STOP_REQUEUE) == stop.EXIT_REQUEUE == 85
    os.kill(os.getpid(), signal.SIGUSR1)  # SLURM may deliver it twice: still only recorded
    assert stop.local_stop_flags() == (1.0, 0.0)


def test_term_means_save_and_do_not_requeue(handlers):
    import os
    import signal

    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # the same scancel delivered twice (step + srun): still alive
    assert stop.preemption_requested(sync=False) == stop.STOP_TERMINATE
    assert stop.exit_code(stop.STOP_TERMINATE) == stop.EXIT_TERMINATED == 143
    # TERM wins over USR1 when ranks disagree: the sums of all ranks' flags decide on every rank
    assert stop.stop_reason((1.0, 1.0)) == stop.STOP_TERMINATE
    assert stop.stop_reason((2.0, 0.0)) == stop.STOP_REQUEUE
    assert stop.stop_reason((0.0, 0.0)) is None


@pytest.mark.parametrize("first", ["TERM", "USR1"])
def test_a_second_term_stops_now(first, tmp_path):
    import subprocess
    import sys

    code = f"""
import os, signal, time
from dsclip.engine.world import stop
stop.install_preemption_handler()
os.kill(os.getpid(), signal.SIG{first})
time.sleep(stop.TERM_REPEAT_S + 0.3)
print("alive after the first signal", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("survived the second TERM", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == -15, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "alive after the first signal"


@pytest.mark.parametrize("first, code", [("TERM", 143), ("USR1", 85)])
def test_a_second_term_after_the_stops_save_exits_with_the_stops_code(first, code):
    """After the stop's checkpoint is safe (the loop calls stop.stop_saved), a second SIGTERM still ends the
    process at once, but with the stop's code: a death by the signal made DeepSpeed's launch.py report -15 and
    pdsh 241, a failure, for a job that had saved."""
    import subprocess
    import sys

    code_py = f"""
import os, signal, time
from dsclip.engine.world import stop
stop.install_preemption_handler()
os.kill(os.getpid(), signal.SIG{first})
time.sleep(stop.TERM_REPEAT_S + 0.3)
stop.stop_saved(stop.exit_code(stop.stop_reason(stop.local_stop_flags())))
print("saved", flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("survived the second TERM", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", code_py], capture_output=True, text=True, timeout=60)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "saved"


@pytest.mark.parametrize("late", ["TERM", "USR1"])
def test_a_stop_signal_during_shutdown_after_the_stops_save_keeps_the_stops_code(late):
    """Once the atexit callbacks have run, CPython gives every signal with a Python handler its default action
    back, and the modules' teardown (process groups, DeepSpeed) still takes a while: a SIGTERM then killed a rank
    that had saved with -15 (pdsh 241, a failed job). Here the late signal comes from an object torn down with
    the script's globals, after that reset: the process must still end with the stop's code."""
    import subprocess
    import sys

    code_py = f"""
import os, signal, sys, time
from dsclip.engine.world import stop
stop.install_preemption_handler()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(stop.TERM_REPEAT_S + 0.3)
stop.stop_saved(stop.exit_code(stop.stop_reason(stop.local_stop_flags())))

class LateSignal:
    def __del__(self):  # runs when the interpreter clears this module, after the handlers went back to default
        os.kill(os.getpid(), signal.SIG{late})
        time.sleep(0.5)
        print("alive after the late signal", flush=True)

late = LateSignal()
print("saved", flush=True)
sys.exit(143)
"""
    r = subprocess.run([sys.executable, "-c", code_py], capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.split() == ["saved", "alive", "after", "the", "late", "signal"]


def test_a_stop_signal_during_shutdown_without_a_save_keeps_its_default_action():
    """Only a stop whose checkpoint is safe ignores signals at shutdown: a process that never saved still dies
    of a SIGTERM there, as before."""
    import subprocess
    import sys

    code_py = """
import os, signal, time
from dsclip.engine.world import stop
stop.install_preemption_handler()

class LateSignal:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("alive after the late signal", flush=True)

late = LateSignal()
"""
    r = subprocess.run([sys.executable, "-c", code_py], capture_output=True, text=True, timeout=60)
    assert r.returncode == -15, (r.returncode, r.stdout, r.stderr)
