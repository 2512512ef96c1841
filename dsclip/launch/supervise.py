"""``dsclip launch -- LAUNCHER ...``: a stop signal reaches every rank, and this process ends after they have.

Why a wrapper: DeepSpeed's launchers do not forward stop signals to the ranks (DeepSpeed 0.19.8, read in
deepspeed/launcher/). ``deepspeed`` on one node (runner.py) has no handler: SIGTERM to it alone ends it at
once with 143 while ``launch.py`` and the ranks train on, orphaned and unsaved. ``launch.py`` (the per-node
launcher) SIGTERMs the ranks on SIGTERM/SIGINT, SIGKILLs what is left 30 s later and exits 1; and when one
rank exits non-zero (143 after a save) it does the same to the others. A scheduler that saw the job step end
may then kill the node mid-save.

What the wrapper does (Linux):
- It becomes a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): ranks whose launcher died are
  re-parented to it, and it waits for them too.
- It starts the launcher with SIGTERM and SIGUSR1 *blocked*. Ignoring is not enough: ``launch.py``
  installs its own SIGTERM handler, which replaces SIG_IGN but not a blocked mask. The mask is inherited
  down to the ranks; every ``dsclip`` command unblocks both first thing (:func:`dsclip.cli.main`), so a
  rank still starting up dies of them as without the supervisor, and ``train`` handles them from
  :func:`dsclip.engine.world.stop.install_preemption_handler` on. Ranks that are not dsclip keep them blocked:
  the supervisor is for dsclip ranks.
- On SIGTERM/SIGUSR1 it forwards the signal to every rank among its descendants: the topmost process of a
  branch whose environment has its own ``RANK`` and ``LOCAL_RANK`` (a rank's data-loader workers share
  the rank's values; the launchers have none). Ranks that appear later get the signals they missed.
  A signal to the whole process group (or to every process of a SLURM step) reaches the ranks both
  directly and forwarded, milliseconds apart: they count it once (``dsclip.engine.world.stop.TERM_REPEAT_S``).
- It exits when the launcher and every descendant have, with the launcher's exit code (143 after SIGTERM,
  85 after SIGUSR1: the ranks' codes, which the launcher passes on). A launcher that reports a stopped
  rank as a failure (torchrun's agent exits 1 when a rank exits 143) is corrected: each dsclip rank on
  this machine records the code it exits with in the file ``DSCLIP_LAUNCH_STATUS`` names
  (:func:`report_exit`), and after a forwarded stop signal that code (143 or 85) is what this process
  exits with.
- The ranks get ``DSCLIP_SUPERVISOR`` (this process's pid, start time and the kernel's boot id): a rank
  whose supervisor disappears (SIGKILL, OOM) treats that as SIGTERM — save and exit — instead of training
  on unwatched (:func:`watch_supervisor`). On another machine (the boot id differs) the variable is ignored.

Remote ranks (``deepspeed --hostfile`` with pdsh, the default multi-node launcher) are not descendants of
this process: they run under each host's sshd, below that host's ``launch.py``. For them the supervisor
finds the ``pdsh`` that DeepSpeed's runner started among its descendants, reads its host list and the job's
``--world_info`` (unique to one launch: it carries the hosts, slots and master port), and sends each stop
signal over pdsh to the children of the ``launch.py`` processes started with that world info: exactly this
job's ranks, on every host (:func:`remote_signal_command`). The local ``pdsh`` and runner keep the signals
blocked, so they stay up until every host's ``launch.py`` has ended with its ranks' code, which pdsh
(``-S``) and the runner return.

This module imports neither torch nor DeepSpeed: the supervisor is a small process that only waits.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

ENV = "DSCLIP_SUPERVISOR"
STATUS_ENV = "DSCLIP_LAUNCH_STATUS"  # file where this machine's dsclip ranks record their exit code
STOP_CODES = (85, 143)  # what a dsclip rank exits with after SIGUSR1 / SIGTERM (dsclip.engine.world.stop)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
HELP = """Runs LAUNCHER (deepspeed) with SIGTERM and SIGUSR1 blocked, forwards each of them that this process
gets to every rank below it (and, for a pdsh launch over a hostfile, to the job's ranks on every host), and
exits when the launcher and all ranks have, with the launcher's exit code (143 after SIGTERM, 85 after
SIGUSR1). Ranks whose supervisor is killed stop as on SIGTERM (docs/clusters.md, "Stop signals and the
DeepSpeed launcher")."""
POLL_S = 0.2
LEFTOVER_S = 10.0  # how long to wait for non-rank descendants (a stuck ssh, say) once launcher and ranks are gone
USAGE = "usage: dsclip launch -- LAUNCHER [ARGS...]  (dsclip launch -- deepspeed --num_gpus 8 --module dsclip ...)"


def _say(msg: str) -> None:
    print(f"[dsclip launch {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- /proc -------------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks since boot) of ``pid``, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": comm may hold spaces and ')'
    return fields[0], int(fields[1]), int(fields[19])


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "-"


def _rank_env(pid: int) -> tuple[bytes, bytes] | None:
    """(RANK, LOCAL_RANK) values in ``pid``'s environment, None when it lacks one (or is unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except OSError:
        return None
    found = {}
    for kv in env:
        if kv.startswith((b"RANK=", b"LOCAL_RANK=")):
            k, _, v = kv.partition(b"=")
            found[k] = v
    if b"RANK" not in found or b"LOCAL_RANK" not in found:
        return None
    return found[b"RANK"], found[b"LOCAL_RANK"]


def descendants(root: int) -> dict[int, int]:
    """{pid: parent pid} of every live (not zombie) process below ``root``."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(int(d))
            if st is not None and st[0] != "Z":
                parent[int(d)] = st[1]
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        out[pid] = parent[pid]
        todo.extend(children.get(pid, []))
    return out


def rank_pids(root: int) -> list[int]:
    """The ranks below ``root``: processes with RANK and LOCAL_RANK set that their parent does not share."""
    below = descendants(root)
    envs = {pid: _rank_env(pid) for pid in below}
    return sorted(
        pid
        for pid, ppid in below.items()
        if envs[pid] is not None and envs.get(ppid) != envs[pid]  # a parent outside `below` is root: no ranks
    )


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _environ(pid: int) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = [kv.decode(errors="replace").partition("=") for kv in f.read().split(b"\0") if kv]
    except OSError:
        return None
    return {k: v for k, _, v in items}


class PdshJob(tuple):
    """(pdsh pid, hosts, world_info) of a DeepSpeed pdsh launch below the supervisor."""

    pid = property(lambda self: self[0])
    hosts = property(lambda self: self[1])
    world_info = property(lambda self: self[2])


def pdsh_jobs(root: int) -> list[PdshJob]:
    """The ``pdsh`` processes DeepSpeed's runner started below ``root`` (multinode_runner.PDSHRunner:
    ``pdsh -S -f N -w HOSTS ... python -u -m deepspeed.launcher.launch --world_info=B64 ...``)."""
    out = []
    for pid in descendants(root):
        argv = _cmdline(pid)
        if not argv or os.path.basename(argv[0]) != "pdsh" or "-w" not in argv:
            continue
        world = [a.split("=", 1)[1] for a in argv if a.startswith("--world_info=")]
        if world and any("deepspeed.launcher.launch" in a for a in argv):
            out.append(PdshJob((pid, ",".join(_pdsh_hosts(argv)), world[0])))
    return out


_HOSTS = re.compile(r"[\w.@:\[\]-]+(,[\w.@:\[\]-]+)*")


def _pdsh_hosts(argv: list[str]) -> list[str]:
    """The host list after ``-w``. pdsh splits it in place (the commas of ``-w node1,node2`` become NULs,
    so /proc shows ``-w node1 node2``): every host-like word up to the next option or the command."""
    hosts = []
    for a in argv[argv.index("-w") + 1 :]:
        if a.startswith("-") or not _HOSTS.fullmatch(a):
            break
        hosts.append(a)
    return hosts


def remote_signal_command(job: PdshJob, sig: int) -> list[str]:
    """pdsh over the job's hosts: the stop signal to the children of the ``launch.py`` that has this job's
    world info and that host's node rank (the ranks: launch.py starts them directly; their data workers are
    theirs, not launch.py's)."""
    name = signal.Signals(sig).name.removeprefix("SIG")
    # The launch.py process itself (not the remote shell pdsh ran it from, nor this command's own shell):
    # argv anchored at the python binary; the brackets keep the pattern from matching its own text;
    # world_info is base64, whose '+' is escaped for the extended regex. DeepSpeed's runner starts it with
    # `--node_rank=%n`, which pdsh replaces by the host's index in the -w list; this command passes the same
    # list, so on each host the pattern names that host's launch.py only. Without it, hosts that share a
    # process table (several "hosts" on one machine, as in tests/cluster.sh) each signalled every host's
    # ranks: one SIGTERM per host, and one arriving more than TERM_REPEAT_S after the first meant "stop now".
    pattern = (
        "^[^ ]*python[^ ]* -u -m deepspeed[.]launcher[.]launch --world_info="
        + job.world_info.replace("+", "[+]")
        + " --node_rank=%n( |$)"
    )
    script = f"for p in $(pgrep -f -- '{pattern}'); do pkill -{name} -P $p; done; true"
    return ["pdsh", "-S", "-w", job.hosts, script]


# ---- the supervisor ----------------------------------------------------------------------------------


class Supervisor:
    def __init__(self, cmd: list[str]):
        self.cmd = cmd
        self.me = os.getpid()
        self.received: list[int] = []  # stop signals, in order
        self.sent: dict[int, int] = {}  # rank pid -> how many of self.received it has been sent
        self.launcher: subprocess.Popen | None = None
        self.launcher_rc: int | None = None
        self.orphan_rcs: list[int] = []
        self.remote_sent: dict[int, int] = {}  # pdsh pid -> how many of self.received its hosts have had

    def forward_remote(self) -> None:
        """Send a pdsh launch's remote ranks the stop signals they have not had yet (from the main loop: a
        pdsh round trip does not belong in a signal handler)."""
        for job in pdsh_jobs(self.me) if self.received else []:
            done = self.remote_sent.get(job.pid, 0)
            env = _environ(job.pid) or dict(os.environ)  # the runner's PDSH_RCMD_TYPE, ssh settings, PATH
            for sig in self.received[done:]:
                try:
                    r = subprocess.run(remote_signal_command(job, sig), env=env, capture_output=True, text=True,
                                       timeout=120)  # fmt: skip
                    ok = r.returncode == 0
                except (OSError, subprocess.TimeoutExpired) as e:
                    ok, r = False, e
                _say(f"{signal.Signals(sig).name} -> ranks on {job.hosts} over pdsh"
                     + ("" if ok else f" FAILED: {str(getattr(r, 'stderr', r)).strip()[-300:]}"))  # fmt: skip
            self.remote_sent[job.pid] = len(self.received)

    def forward(self) -> None:
        """Send every rank the stop signals it has not had yet."""
        if not self.received:
            return
        for pid in rank_pids(self.me):
            done = self.sent.get(pid, 0)
            for sig in self.received[done:]:
                try:
                    os.kill(pid, sig)
                except OSError:
                    break
            if done < len(self.received):
                self.sent[pid] = len(self.received)
                _say(f"{signal.Signals(self.received[-1]).name} -> rank process {pid}")

    def _on_stop(self, signum, frame) -> None:
        self.received.append(signum)
        _say(f"got {signal.Signals(signum).name}: forwarding it to the ranks, waiting for them to exit")
        self.forward()

    def _on_int(self, signum, frame) -> None:
        # Ctrl-C reaches the whole foreground group (the launchers handle it: they end the ranks); a SIGINT
        # sent to this process alone is passed to the launcher, and we keep waiting for what it ends.
        if self.launcher is not None and self.launcher_rc is None:
            try:
                self.launcher.send_signal(signal.SIGINT)
            except OSError:
                pass

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rc = os.waitstatus_to_exitcode(status)
            if self.launcher is not None and pid == self.launcher.pid:
                self.launcher_rc = rc
                self.launcher.returncode = rc  # reaped here: Popen must not wait for it again
            else:
                self.orphan_rcs.append(rc)  # a rank (or per-node launcher) whose parent had died

    def run(self) -> int:
        set_subreaper()
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_stop)
        signal.signal(signal.SIGINT, self._on_int)
        env = dict(os.environ)
        env[ENV] = token(self.me)
        self.status_file = status_path(tempfile.gettempdir(), self.me)
        clear_stale_status_files(tempfile.gettempdir(), self.me)
        env[STATUS_ENV] = self.status_file
        # the launcher sets RANK/LOCAL_RANK per rank; an inherited pair would hide which processes are ranks
        for k in ("RANK", "LOCAL_RANK"):
            env.pop(k, None)
        # blocked in the launcher (and inherited by its children); a stop signal that comes meanwhile waits
        # here, and is handled once the mask is restored
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self.launcher = subprocess.Popen(self.cmd, env=env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        ranks_gone_at = None
        while True:
            self._reap()
            self.forward()  # ranks started after a signal get it too
            self.forward_remote()
            if self.launcher_rc is not None:
                left = descendants(self.me)
                if not left:
                    break
                if rank_pids(self.me):
                    ranks_gone_at = None
                elif ranks_gone_at is None:
                    ranks_gone_at = time.monotonic()
                elif time.monotonic() - ranks_gone_at > LEFTOVER_S:
                    _say(f"launcher and ranks exited; not waiting for processes {sorted(left)}")
                    break
            time.sleep(POLL_S)
        rc = self.launcher_rc
        if rc < 0:  # the launcher died of a signal: a shell would report 128 + N
            rc = 128 - rc
        ranks_rc = _read_status(self.status_file)
        if self.received and rc not in STOP_CODES and ranks_rc in STOP_CODES:
            # the ranks saved and stopped as asked; the launcher counted that as a failure (torchrun: 1)
            _say(f"the launcher exited {rc}, the ranks {ranks_rc} after saving; exit {ranks_rc}")
            rc = ranks_rc
        if self.received:
            _say(f"launcher and ranks exited; exit {rc}")
        return rc


def set_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    except (OSError, AttributeError) as e:  # not Linux: orphaned ranks are not waited for, the rest works
        _say(f"cannot become a subreaper ({e}); ranks whose launcher dies are not waited for")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + HELP)
        return 0 if argv else 2
    return Supervisor(argv).run()


# ---- the rank side -----------------------------------------------------------------------------------


def token(pid: int) -> str:
    """What identifies a live process across PID reuse: pid, start time, boot id."""
    st = _stat(pid)
    return f"{pid}:{st[2] if st else 0}:{_boot_id()}"


def supervisor_alive(value: str) -> bool | None:
    """True while the process ``value`` (:func:`token`) names runs, False once it is gone, None when it is
    not on this machine (another boot id) or ``value`` is malformed: nothing to watch."""
    try:
        pid_s, start_s, boot = value.split(":", 2)
        pid, start = int(pid_s), int(start_s)
    except ValueError:
        return None
    if boot != _boot_id():
        return None
    st = _stat(pid)
    return st is not None and st[0] != "Z" and st[2] == start


def worker_ignores_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: a rank's data workers ignore SIGTERM/SIGUSR1. A signal to the whole
    process group (``kill -TERM -PGID``, SLURM signalling every process of a step) reaches them too, and
    torch's worker handler dies of it: the rank's next batch then raised "DataLoader worker exited
    unexpectedly" and the run crashed unsaved (seen here, 2 ranks, --workers 1). The rank stops its workers
    when it exits, and torch's workers end by themselves when their rank dies."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def report_exit(code: int, env=None) -> None:
    """Record the exit code of this rank for its ``dsclip launch`` supervisor (a no-op when not supervised on
    this machine). Every rank of a stop exits with the same code, so the last writer is as good as any."""
    env = os.environ if env is None else env
    path, value = env.get(STATUS_ENV), env.get(ENV)
    if not path or not value or supervisor_alive(value) is None:  # not supervised, or by another machine's
        return
    tmp = f"{path}.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(f"{int(code)}\n")
        os.replace(tmp, path)
    except OSError:  # the supervisor then exits with the launcher's code, as before
        pass


STATUS_PREFIX, STATUS_SUFFIX = "dsclip-launch-", ".status"  # one file per supervisor: PREFIX + pid + SUFFIX


def status_path(folder: str, supervisor_pid: int) -> str:
    return os.path.join(folder, f"{STATUS_PREFIX}{supervisor_pid}{STATUS_SUFFIX}")


def clear_stale_status_files(folder: str, me: int) -> list[str]:
    """Remove status files left by supervisors that were killed before they could read them (SIGKILL, OOM):
    the one at this supervisor's own path (its pid reused) would otherwise speak for ranks that never wrote,
    and the others of processes that are gone only pile up. Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(folder, f"{STATUS_PREFIX}*{STATUS_SUFFIX}")):
        pid = os.path.basename(path)[len(STATUS_PREFIX) : -len(STATUS_SUFFIX)]
        if not pid.isdigit() or (int(pid) != me and _stat(int(pid)) is not None):
            continue  # not a supervisor's file, or one of a process that still runs
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another supervisor removed it first, or it is not ours to remove
            pass
    return removed


def _read_status(path: str) -> int | None:
    try:
        with open(path) as f:
            code = int(f.read().strip())
        os.unlink(path)
        return code
    except (OSError, ValueError):
        return None


def release_stop_signals() -> None:
    """Unblock SIGTERM/SIGUSR1, blocked by the supervisor for its launcher (inherited by the ranks)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def watch_supervisor(env=None, interval_s: float = 1.0) -> threading.Thread | None:
    """If this process runs under ``dsclip launch`` on this machine, a daemon thread that sends this process
    SIGTERM once the supervisor is gone (killed with SIGKILL, say): the rank then saves and exits as if the
    job had been cancelled, instead of training on with nobody waiting for it. None when not supervised."""
    global _watcher
    value = (os.environ if env is None else env).get(ENV)
    if not value or supervisor_alive(value) is None:
        return None
    if _watcher is not None and _watcher.is_alive():  # a process that trains twice watches once
        return _watcher

    def watch():
        while supervisor_alive(value):
            time.sleep(interval_s)
        print(
            f"[dsclip rank {os.environ.get('RANK', '?')}] the dsclip launch supervisor is gone: stopping as on SIGTERM",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)

    _watcher = threading.Thread(target=watch, name="dsclip-supervisor-watch", daemon=True)
    _watcher.start()
    return _watcher


_watcher: threading.Thread | None = None
