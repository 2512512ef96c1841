"""Who am I in the job, and the process group's life cycle — the one place dsclip reads launcher env.

Sources, in the order they are tried:

``launcher``  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as set by ``deepspeed`` (which also passes
              ``--local_rank=N`` to the script and sets ``LOCAL_SIZE``; ``source="deepspeed"``),
              ``torchrun`` (``"torchrun"``), ``launch/slurm/srun_dsclip.sh`` (``"slurm"``) or
              anything else that exports the same variables (``"env"``). Wins over SLURM, so
              ``srun deepspeed --no_ssh --node_rank=...`` (one launcher per node) works although
              every rank also sees ``SLURM_*``.
``slurm``     one process per task started by ``srun``: ``SLURM_PROCID`` → rank, ``SLURM_LOCALID`` →
              local rank, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS`` → world size, tasks on this node
              from ``SLURM_STEP_TASKS_PER_NODE`` (``"2(x3),1"``); ``MASTER_ADDR`` from the environment
              or the step's first node (``scontrol show hostnames "$SLURM_JOB_NODELIST" | head -1``);
              ``MASTER_PORT`` from the environment or derived from ``SLURM_JOB_ID``.
``single``    none of the above: one process, ``127.0.0.1`` and a free port.

DeepSpeed itself never reads ``SLURM_*``: without :func:`export_env` it falls back to mpi4py
discovery and fails. :func:`init_distributed` exports the discovered world and creates the process
group with a bounded timeout; :func:`shutdown` ends it (barrier + ``destroy_process_group``), which
is also registered ``atexit`` — without it ranks sometimes abort with code 134 after succeeding.

Failure behaviour: a rank that dies closes its sockets, so the other ranks' next collective fails
at once (gloo: "Connection closed by peer"), they exit non-zero, and the launchers propagate it
(``deepspeed`` kills the node's other ranks and exits with the rank's code; ``srun
--kill-on-bad-exit=1`` ends the step). A rank that *hangs* is bounded by the process-group timeout:
``DSCLIP_DIST_TIMEOUT`` (seconds), ``DEEPSPEED_TIMEOUT`` (minutes, DeepSpeed's convention), the
``timeout_s`` argument, or 30 minutes — first one set wins.

Preemption (SLURM ``--signal=B:USR1@120`` → batch script forwards ``SIGUSR1`` to the ranks):
:func:`install_preemption_handler` records ``SIGUSR1``/``SIGTERM``; the training loop polls
:func:`preemption_requested` (collective: every rank must call it at the same step), saves a
checkpoint and exits with :data:`EXIT_REQUEUE`, and the batch script requeues the job, which then
resumes with ``--resume latest``.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsclip.dist import initialized, rank_world

# Exit code of a run that stopped early on request (preemption signal) after saving a checkpoint:
# the launch scripts requeue the job when they see it. 0 = finished, anything else = failure.
EXIT_REQUEUE = 85
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
DEFAULT_TIMEOUT_S = 30 * 60

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")  # + --local_rank=N in argv for LOCAL_RANK
_SLURM_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_JOB_NODELIST")


class WorldDiscoveryError(RuntimeError):
    """The environment describes a distributed launch only partially (names what is missing)."""


@dataclass(frozen=True)
class WorldInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "deepspeed" | "torchrun" | "env" | "slurm" | "single"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _argv_local_rank(argv) -> int | None:
    """``--local_rank=N`` / ``--local_rank N`` / ``--local-rank=N`` as the deepspeed launcher passes it."""
    for i, a in enumerate(argv):
        m = re.fullmatch(r"--local[_-]rank(?:=(-?\d+))?", a)
        if m:
            if m.group(1) is not None:
                return int(m.group(1))
            if i + 1 < len(argv) and re.fullmatch(r"-?\d+", argv[i + 1]):
                return int(argv[i + 1])
    return None


def _int(env, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise WorldDiscoveryError(f"{name}={env[name]!r} is not an integer") from None


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM hostlist → names: ``"a[1-3,5],b7"`` → ``["a1", "a2", "a3", "a5", "b7"]`` (keeps zero padding)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


def _first_host(nodelist: str) -> str:
    # scontrol knows every hostlist syntax SLURM accepts; the parser above covers the usual ones
    # (and the unit tests, which have no scontrol).
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_nodelist(nodelist)[0]


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """``"2(x3),1"`` (SLURM_TASKS_PER_NODE syntax) → task count of node ``node_id``."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ValueError(tasks_per_node)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node_id]


def slurm_port(job_id: str | int) -> int:
    """A job-specific port in 15000-24999 (below the ephemeral range; 295xx is busy on shared boxes)."""
    return 15000 + int(job_id) % 10000


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def discover_world(env=None, argv=None) -> WorldInfo:
    """Rank, world size and rendezvous address of this process (see the module docstring)."""
    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else argv
    argv_local_rank = _argv_local_rank(argv)

    # --- deepspeed / torchrun / anything exporting the torch.distributed variables -------------
    present = [v for v in _LAUNCHER_VARS if v in env]
    if present or argv_local_rank is not None:
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if "LOCAL_RANK" not in env and argv_local_rank is None:
            missing.append("LOCAL_RANK (or --local_rank=N)")
        if missing:
            raise WorldDiscoveryError(
                f"distributed launch detected ({', '.join(present) or '--local_rank'} set) but "
                f"{', '.join(missing)} missing: start with `deepspeed`, `torchrun` or `srun`, or export "
                "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"
            )
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else argv_local_rank
        if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
            source = "torchrun"
        elif "CROSS_RANK" in env or argv_local_rank is not None:
            source = "deepspeed"
        elif env.get("SLURM_PROCID") == env["RANK"]:
            source = "slurm"  # launch/slurm/srun_dsclip.sh mapped SLURM_* already
        else:
            source = "env"
        local_world = 1
        for v in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            if v in env:
                local_world = _int(env, v)
                break
        return _checked(
            WorldInfo(
                rank,
                local_rank,
                world,
                max(local_world, local_rank + 1),
                env["MASTER_ADDR"],
                _int(env, "MASTER_PORT"),
                source,
            )
        )

    # --- srun: one process per task ---------------------------------------------------------------
    if "SLURM_PROCID" in env:
        missing = [v for v in _SLURM_VARS if v not in env]
        if "MASTER_PORT" not in env and "SLURM_JOB_ID" not in env:
            missing.append("SLURM_JOB_ID (or MASTER_PORT)")
        if missing:
            raise WorldDiscoveryError(f"SLURM task detected (SLURM_PROCID set) but {', '.join(missing)} missing")
        in_step = "SLURM_STEP_ID" in env or "SLURM_STEPID" in env
        world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS")
        if not in_step:
            # The batch script itself (not an srun task): SLURM_NTASKS counts the tasks srun would
            # start. Treating this process as one of them would wait forever for the others.
            if world > 1:
                raise WorldDiscoveryError(
                    f"running in a SLURM batch script with SLURM_NTASKS={world} but not under srun "
                    "(SLURM_STEP_ID missing): start dsclip with `srun` (launch/slurm/train.sbatch), or "
                    "with `srun --ntasks-per-node=1 deepspeed --no_ssh ...` (train_per_node.sbatch)"
                )
            return _single(env)
        try:
            tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
            local_world = _tasks_on_node(tpn, int(env.get("SLURM_NODEID", "0")))
        except (TypeError, ValueError, IndexError):
            local_world = int(env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0] or 1)
        nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        addr = env.get("MASTER_ADDR") or _first_host(nodelist)
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else slurm_port(env["SLURM_JOB_ID"])
        return _checked(
            WorldInfo(_int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), world, local_world, addr, port, "slurm")
        )

    return _single(env)


def _single(env) -> WorldInfo:
    port = int(env["MASTER_PORT"]) if "MASTER_PORT" in env else _free_port()
    return WorldInfo(0, 0, 1, 1, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")


def _checked(info: WorldInfo) -> WorldInfo:
    if not (0 <= info.rank < info.world_size):
        raise WorldDiscoveryError(f"rank {info.rank} outside world of size {info.world_size} ({info.source})")
    if not (0 <= info.local_rank < max(info.local_world_size, 1)):
        raise WorldDiscoveryError(f"local rank {info.local_rank} outside {info.local_world_size} ({info.source})")
    if not (0 < info.master_port < 65536):
        raise WorldDiscoveryError(f"MASTER_PORT {info.master_port} out of range")
    return info


def export_env(info: WorldInfo, env=None) -> None:
    """Export the world as torch.distributed / DeepSpeed read it (so DeepSpeed never tries mpi4py)."""
    env = os.environ if env is None else env
    env.update(
        RANK=str(info.rank),
        LOCAL_RANK=str(info.local_rank),
        WORLD_SIZE=str(info.world_size),
        LOCAL_WORLD_SIZE=str(info.local_world_size),
        LOCAL_SIZE=str(info.local_world_size),  # DeepSpeed's name for it
        MASTER_ADDR=info.master_addr,
        MASTER_PORT=str(info.master_port),
    )


def resolve_timeout(timeout_s: float | None = None, env=None) -> timedelta:
    """Process-group timeout: DSCLIP_DIST_TIMEOUT (s) > DEEPSPEED_TIMEOUT (min) > ``timeout_s`` > 30 min."""
    env = os.environ if env is None else env
    if env.get("DSCLIP_DIST_TIMEOUT"):
        return timedelta(seconds=float(env["DSCLIP_DIST_TIMEOUT"]))
    if env.get("DEEPSPEED_TIMEOUT"):
        return timedelta(minutes=float(env["DEEPSPEED_TIMEOUT"]))
    return timedelta(seconds=DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s))


_state = {"info": None, "failed": False, "atexit": False, "prev_excepthook": None}


def _excepthook(tp, value, tb):
    # An uncaught exception means the other ranks may never reach our exit barrier: skip it.
    _state["failed"] = True
    (_state["prev_excepthook"] or sys.__excepthook__)(tp, value, tb)


def init_distributed(timeout_s: float | None = None, backend: str | None = None) -> WorldInfo:
    """Discover the world, export it, and create the default process group (through DeepSpeed).

    Backend: ``backend`` or ``DSCLIP_DIST_BACKEND``, else nccl on CUDA and gloo otherwise. Also
    called for a single process (DeepSpeed needs a process group either way). Idempotent.
    """

    if _state["info"] is not None and dist.is_initialized():
        return _state["info"]
    info = discover_world()
    export_env(info)
    backend = backend or os.environ.get("DSCLIP_DIST_BACKEND")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    timeout = resolve_timeout(timeout_s)

    # lazy: launchers' stand-ins and the CLI's error path import this module; deepspeed takes seconds to load
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend, timeout=timeout, auto_mpi_discovery=False, verbose=info.rank == 0)
    release_shm_workspace()
    _state["info"] = info
    if os.environ.get("DSCLIP_LOG_WORLD", "1") != "0":
        # one line per rank: the first thing to look at when a launch misbehaves
        print(
            f"[dsclip] rank {info.rank}/{info.world_size} local {info.local_rank}/{info.local_world_size} "
            f"host {socket.gethostname()} node {os.environ.get('SLURMD_NODENAME', '-')} "
            f"source {info.source} master {info.master_addr}:{info.master_port} backend {backend} "
            f"timeout {int(timeout.total_seconds())}s",
            file=sys.stderr,
            flush=True,
        )
    if not _state["atexit"]:
        _state["atexit"] = True
        _state["prev_excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
        atexit.register(_shutdown_at_exit)
    return info


SHM_WORKSPACE = "/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"


def release_shm_workspace() -> bool:
    """Unlink this rank's DeepSpeed CPU shared-memory all-reduce workspace from /dev/shm (keeping it mapped).

    Why: on a CPU accelerator DeepSpeed (0.19) creates a ~69 MB POSIX shm segment per rank when its
    comm backend starts (csrc/cpu/comm/shm.cpp, named from MASTER_ADDR/MASTER_PORT/rank) and never
    unlinks it, so every run leaves RAM-backed files behind until the machine fills up. Its
    initialisation returns only after the rank has opened every peer's segment, so once all ranks
    are past it (the barrier) the names are no longer needed; the mappings stay valid until exit.
    Safe to call more than once and where the segment does not exist (GPU runs). Collective when
    the world has more than one rank: call it on every rank. Returns True if a segment was removed.
    """

    if not initialized():
        return False
    path = SHM_WORKSPACE.format(
        uid=os.getuid(),
        addr=os.environ.get("MASTER_ADDR", ""),
        port=os.environ.get("MASTER_PORT", ""),
        rank=dist.get_rank(),
    )
    if dist.get_world_size() > 1 and dist.get_backend() == "gloo":
        dist.barrier()  # every peer has mapped our segment
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def world_info() -> WorldInfo | None:
    """The WorldInfo of :func:`init_distributed`, or None before it."""
    return _state["info"]


def shutdown(barrier: bool = True) -> None:
    """End the process group: barrier (all ranks done) then destroy_process_group. Idempotent."""

    if not initialized():
        return
    try:
        if barrier and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                # bounded: a peer that exits without reaching it must not hold us for the PG timeout
                limit = float(os.environ.get("DSCLIP_EXIT_BARRIER_TIMEOUT", 120))
                dist.monitored_barrier(timeout=timedelta(seconds=limit))
            else:
                dist.barrier()
    finally:
        dist.destroy_process_group()


def mark_failed() -> None:
    """Tell the exit hook not to wait in a barrier (for code that handles an exception itself)."""
    _state["failed"] = True


def _shutdown_at_exit() -> None:
    try:
        shutdown(barrier=not _state["failed"])
    except Exception as e:  # the peers may be gone already; exiting is all that is left to do
        print(
            f"[dsclip rank {os.environ.get('RANK', '?')}] process group shutdown failed: {e}",
            file=sys.stderr,
            flush=True,
        )


# --- preemption (SLURM --signal, scancel --signal, kill) -------------------------------------------

_preempt = {"signum": None}


def install_preemption_handler(signals=PREEMPT_SIGNALS) -> None:
    """Record (not act on) ``SIGUSR1``/``SIGTERM``; the loop checks :func:`preemption_requested`.

    Only the first signal is deferred; after it, SIGTERM gets its default action back, so SLURM's
    SIGTERM at the time limit (after the USR1 warning) or a second ``scancel`` ends the process at
    once. A repeated SIGUSR1 (SLURM may deliver it to a rank both directly and via the batch
    script) stays harmless."""

    def handler(signum, frame):
        _preempt["signum"] = signum
        if signal.SIGTERM in signals:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    for s in signals:
        signal.signal(s, handler)


def preemption_requested(sync: bool = True) -> bool:
    """True once any rank got a preemption signal. With ``sync`` (default) this is a collective
    (MAX all-reduce of one int) so all ranks stop at the same step — call it on every rank."""
    local = _preempt["signum"] is not None
    if not sync:
        return local

    if rank_world()[1] == 1:
        return local
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(local)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
