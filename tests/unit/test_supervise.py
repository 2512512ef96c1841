"""`dsclip launch` (dsclip/launch/supervise.py) around a stand-in launcher that behaves like DeepSpeed's
launch.py at its worst: on SIGTERM it SIGKILLs its ranks at once and exits 1. Its "ranks" save (a file,
after a second) when they get SIGTERM. Seconds, no torch in the launcher; the real DeepSpeed launcher runs
in tests/e2e/test_launch_signals.py and tests/e2e/test_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsclip.launch import supervise

REPO = Path(__file__).resolve().parents[2]

LAUNCHER = r"""
import os, signal, subprocess, sys, time
out = sys.argv[1]
status = open("/proc/self/status").read()
open(f"{out}/launcher.sigblk", "w").write(next(l for l in status.splitlines() if l.startswith("SigBlk:")).split()[1])
ranks = []
def impatient(signum, frame):  # launch.py's sigkill_handler, without its 30 s of grace
    for p in ranks:
        p.kill()
    sys.exit(1)
signal.signal(signal.SIGTERM, impatient)
for r in range(2):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r))
    ranks.append(subprocess.Popen([sys.executable, "-c", sys.argv[2], out, str(r)], env=env))
codes = [p.wait() for p in ranks]
sys.exit(max(codes))
"""

# a rank as dsclip's: unblock the stop signals (dsclip.cli.main), record SIGTERM, finish the "step", save, exit 143;
# a data-loader-like worker shares its RANK (must not be signalled: it would die of it)
RANK = r"""
import os, signal, subprocess, sys, time
from dsclip.launch.supervise import release_stop_signals
out, rank = sys.argv[1], sys.argv[2]
release_stop_signals()
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(f"{out}/rank{rank}.worker", "w").write(str(worker.pid))
open(f"{out}/rank{rank}.ready", "w").write(str(os.getpid()))
while not got:
    time.sleep(0.05)
time.sleep(1.0)  # the save
open(f"{out}/rank{rank}.saved", "w").write("ok")
worker.kill()
worker.wait()
sys.exit(143)
"""


def env():
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", supervise.ENV)}
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start(tmp_path: Path, rank_code: str = RANK) -> subprocess.Popen:
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    cmd = [sys.executable, "-m", "dsclip", "launch", "--", sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)]
    return subprocess.Popen([*cmd, rank_code], cwd=REPO, env=env(), stderr=subprocess.PIPE, text=True)


def wait_for(paths, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, f"{paths} not there after {timeout} s"
        time.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["alone", "group"])
def test_sigterm_reaches_the_ranks_past_an_impatient_launcher_and_exit_follows_them(tmp_path, how):
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    cmd = [sys.executable, "-m", "dsclip", "launch", "--", sys.executable, str(tmp_path / "launcher.py"), str(tmp_path)]
    proc = subprocess.Popen(
        [*cmd, RANK], cwd=REPO, env=env(), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        wait_for([tmp_path / f"rank{r}.ready" for r in (0, 1)], proc)
        ranks = [int((tmp_path / f"rank{r}.ready").read_text()) for r in (0, 1)]
        workers = [int((tmp_path / f"rank{r}.worker").read_text()) for r in (0, 1)]
        assert sorted(supervise.rank_pids(proc.pid)) == sorted(ranks)  # not the launcher, not the workers
        if how == "alone":
            os.kill(proc.pid, signal.SIGTERM)
        else:  # every process, the launcher included: it has SIGTERM blocked, so its handler never runs
            os.killpg(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=60)
        exited_at = time.time()
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, err
    assert not [p for p in ranks + workers if alive(p)], "the supervisor exited before the ranks"
    for r in (0, 1):
        saved = tmp_path / f"rank{r}.saved"
        assert saved.exists(), err  # the launcher's SIGKILL never came
        assert saved.stat().st_mtime <= exited_at
    blocked = int((tmp_path / "launcher.sigblk").read_text(), 16)
    assert blocked & (1 << (signal.SIGTERM - 1)) and blocked & (1 << (signal.SIGUSR1 - 1))
    assert "got SIGTERM: forwarding it to the ranks" in err and "exit 143" in err


def test_a_rank_whose_supervisor_is_killed_stops_as_on_sigterm(tmp_path):
    # the real rank-side code: stop.install_preemption_handler starts the watch on DSCLIP_SUPERVISOR
    rank = r"""
import sys, time
from dsclip.engine.world import stop
out, rank = sys.argv[1], sys.argv[2]
stop.install_preemption_handler()
open(f"{out}/rank{rank}.ready", "w").write("1")
deadline = time.monotonic() + 60
while not stop.preemption_requested(sync=False) and time.monotonic() < deadline:
    time.sleep(0.05)
open(f"{out}/rank{rank}.saved", "w").write(str(stop.preemption_requested(sync=False)))
sys.exit(stop.exit_code(stop.preemption_requested(sync=False)))
"""
    proc = start(tmp_path, rank)
    below: dict[int, int] = {}
    try:
        wait_for([tmp_path / f"rank{r}.ready" for r in (0, 1)], proc, timeout=120)
        below = supervise.descendants(proc.pid)
        proc.kill()  # SIGKILL: the supervisor can forward nothing
        proc.wait()
        wait_for_saved = time.monotonic() + 30
        while not all((tmp_path / f"rank{r}.saved").exists() for r in (0, 1)):
            assert time.monotonic() < wait_for_saved, "ranks trained on after their supervisor died"
            time.sleep(0.1)
    finally:
        for pid in below:  # the launcher and ranks this test started, by pid
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    for r in (0, 1):
        assert (tmp_path / f"rank{r}.saved").read_text() == "terminate"


def test_supervisor_token_names_one_live_process_on_this_machine():
    me = supervise.token(os.getpid())
    assert supervise.supervisor_alive(me) is True
    pid, start, boot = me.split(":", 2)
    assert supervise.supervisor_alive(f"{pid}:{int(start) + 1}:{boot}") is False  # the pid, reused
    assert supervise.supervisor_alive(f"{pid}:{start}:another-boot") is None  # another machine: not ours to watch
    assert supervise.supervisor_alive("garbage") is None


def test_pdsh_host_list_is_read_as_pdsh_leaves_it():
    from dsclip.launch.supervise import PdshJob, _pdsh_hosts, remote_signal_command

    # pdsh turns the commas of `-w node1,node2` into NULs in place: /proc shows separate words
    assert _pdsh_hosts(["pdsh", "-S", "-f", "1024", "-w", "node1", "node2", "export A=1; cd /x;", "python"]) == [
        "node1",
        "node2",
    ]
    assert _pdsh_hosts(["pdsh", "-S", "-w", "n[1-4],gpu-07.cluster", "-R", "ssh", "export A=1;"]) == [
        "n[1-4],gpu-07.cluster"
    ]
    cmd = remote_signal_command(PdshJob((1, "node1,node2", "eyJh+/b=")), signal.SIGUSR1)
    assert cmd[:4] == ["pdsh", "-S", "-w", "node1,node2"]
    # only launch.py itself (argv from the python binary), base64's '+' escaped; its children get USR1
    # pdsh puts each host's index in the -w list for %n
    assert (
        "'^[^ ]*python[^ ]* -u -m deepspeed[.]launcher[.]launch --world_info=eyJh[+]/b= --node_rank=%n( |$)'" in cmd[4]
    )
    assert "pkill -USR1 -P $p" in cmd[4]


FAKE_LAUNCH = """
import subprocess, sys, time
rank = subprocess.Popen(["sleep", "60"])  # the "rank" DeepSpeed's launch.py would start
print(rank.pid, flush=True)
rank.wait()
"""


def test_the_pdsh_stop_signal_reaches_only_each_hosts_own_ranks(tmp_path):
    """Two hosts on one machine (tests/cluster.sh's ssh hosts share a process table): each host's command,
    with %n as pdsh fills it in, signals the ranks of that host's launch.py and not the other's. Before, each
    host signalled both hosts' ranks, so every rank got one SIGTERM per host, seconds apart when a host was
    slow, and the later one counted as "stop now" (the pdsh SIGTERM test then exited 241 instead of 143)."""
    from dsclip.launch.supervise import PdshJob, remote_signal_command

    pkg = tmp_path / "deepspeed" / "launcher"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "deepspeed", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "launch.py").write_text(FAKE_LAUNCH)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    world_info = "eyJub2RlMSI6IFswXX0+="  # base64, with the '+' the pattern must escape
    launchers, ranks = [], []
    try:
        for node in (
            0,
            1,
        ):  # DeepSpeed's runner: python -u -m deepspeed.launcher.launch --world_info=B64 --node_rank=%n
            cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}"]
            p = subprocess.Popen(
                [*cmd, f"--node_rank={node}", "--master_addr=node1"], env=env, stdout=subprocess.PIPE, text=True
            )
            launchers.append(p)
            ranks.append(int(p.stdout.readline()))
        script = remote_signal_command(PdshJob((1, "node1,node2", world_info)), signal.SIGTERM)[4]
        subprocess.run(["bash", "-c", script.replace("%n", "1")], check=True, timeout=30)  # node2's turn
        assert launchers[1].wait(timeout=30) == 0  # its rank got SIGTERM, so this launch.py finished
        assert launchers[0].poll() is None and os.path.exists(f"/proc/{ranks[0]}")  # node1's rank untouched
    finally:
        for p in launchers:
            p.kill()
            p.wait()
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_rank_reports_its_exit_code_only_to_a_supervisor_on_this_machine(tmp_path):
    status = tmp_path / "status"
    mine = {supervise.ENV: supervise.token(os.getpid()), supervise.STATUS_ENV: str(status)}
    supervise.report_exit(143, env=mine)
    assert supervise._read_status(str(status)) == 143 and not status.exists()  # read once, then gone
    pid, start, _ = mine[supervise.ENV].split(":", 2)
    supervise.report_exit(85, env={**mine, supervise.ENV: f"{pid}:{start}:another-boot"})  # a remote rank
    supervise.report_exit(85, env={supervise.STATUS_ENV: str(status)})  # not supervised
    assert not status.exists() and supervise._read_status(str(status)) is None


def test_a_supervisor_clears_status_files_that_supervisors_killed_before_reading_them_left(tmp_path):
    """A supervisor killed with SIGKILL leaves its ranks' status file behind. The one at a new supervisor's
    own path (its pid reused) would speak for ranks that never wrote it; the others only pile up in /tmp."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    me, live = os.getpid(), os.getppid()
    files = {pid: Path(supervise.status_path(str(tmp_path), pid)) for pid in (me, gone.pid, live)}
    for path in files.values():
        path.write_text("143\n")
    other = tmp_path / "dsclip-launch-notes.status"  # not a supervisor's: left alone
    other.write_text("x")
    removed = supervise.clear_stale_status_files(str(tmp_path), me)
    assert sorted(removed) == sorted(str(files[p]) for p in (me, gone.pid))
    assert not files[me].exists() and not files[gone.pid].exists()
    assert files[live].exists() and other.exists()  # a running supervisor's file stays
