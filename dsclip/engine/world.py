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

Stop requests (SLURM ``--signal=B:USR1@120`` → batch script forwards ``SIGUSR1`` to the ranks;
``scancel`` → ``SIGTERM``): :func:`install_preemption_handler` records them; the gradient cache folds
:func:`local_stop_flags` into the all-reduce it makes every step, so every rank sees the same
:func:`stop_reason` at the same step without an extra host sync; the loop saves a checkpoint and
exits :data:`EXIT_REQUEUE` (USR1: the batch script requeues, the job resumes with ``--resume
latest``) or :data:`EXIT_TERMINATED` (TERM: not requeued).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsclip.console import say
from dsclip.dist import initialized, rank_world
from dsclip.engine.log_filter import install_log_filter
from dsclip.engine.shm_op import shm_op_for_world
from dsclip.engine.shm_workspace import release_shm_workspace
from dsclip.launch import supervise

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


# --- device binding (which GPU this rank uses, in its own view) -------------------------------------


class DeviceBindingError(WorldDiscoveryError):
    """This task cannot be given a GPU of its own (names the rank and the fix)."""


@dataclass(frozen=True)
class DeviceBinding:
    """The GPU a rank binds, as an index valid in the task's own view.

    ``index`` is what ``set_device`` and DeepSpeed's ``device_rank`` get; ``visible`` the task's
    ``CUDA_VISIBLE_DEVICES`` entries (None when unset: the node's GPUs in order), so ``physical`` —
    the entry ``index`` points at — names the node's GPU. On a CPU-only machine nothing is bound but
    the same rule runs on ``CUDA_VISIBLE_DEVICES``, so a launch can be checked without GPUs.
    """

    index: int | None  # None: a CPU run whose CUDA_VISIBLE_DEVICES names no usable GPU (nothing to bind)
    count: int  # GPUs in the task's view
    visible: tuple[str, ...] | None
    on_gpu: bool

    @property
    def physical(self) -> str:
        if self.index is None:
            return "-"
        return self.visible[self.index] if self.visible is not None else str(self.index)

    def describe(self) -> str:
        if not self.on_gpu and self.visible is None:
            # a CPU machine with no GPU view (CUDA_VISIBLE_DEVICES unset): nothing is or would be bound, so
            # "bind cuda:1" would only mislead; with a view (a fake-GPU cluster) the would-be binding is shown
            return "device cpu"
        vis = (",".join(self.visible) or "none") if self.visible is not None else "all"
        bind = "none" if self.index is None else f"cuda:{self.index}"
        return f"device {'cuda' if self.on_gpu else 'cpu'} bind {bind} gpu {self.physical} visible {vis}"


def _visible(env) -> tuple[str, ...] | None:
    v = env.get("CUDA_VISIBLE_DEVICES")
    if v is None:
        return None
    v = v.strip()
    # SLURM writes NoDevFiles when a step has GPUs it cannot map to device files; -1 hides all
    if v in ("", "-1", "NoDevFiles"):
        return ()
    return tuple(x.strip() for x in v.split(","))


def remap_launcher_devices(env=None) -> None:
    """Per-node DeepSpeed launcher under SLURM: ``launch.py`` sets ``CUDA_VISIBLE_DEVICES`` to hostfile
    slot ids (``0,1,..``), which ignores the GPUs SLURM gave the node's task (``DSCLIP_NODE_GPUS``, saved
    by launch/deepspeed_hostfile.sh before the launcher overwrote it). Translate the ids back into the
    SLURM set, before CUDA initialises, so a rank never uses a GPU of another job."""
    env = os.environ if env is None else env
    node = env.get("DSCLIP_NODE_GPUS")
    ids = _visible(env)
    if not node or ids is None:
        return
    node_gpus = tuple(x.strip() for x in node.split(","))
    if node_gpus == ids or _translated(env, node_gpus, ids):
        return
    try:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[int(i)] for i in ids)
    except (ValueError, IndexError):
        raise DeviceBindingError(
            f"rank {env.get('RANK', '?')}: the DeepSpeed launcher assigned GPU ids {','.join(ids)} but SLURM gave this "
            f"node only {node} ({len(node_gpus)} GPUs); set GPUS_PER_NODE / hostfile slots to at most {len(node_gpus)} "
            "or request more GPUs (--gpus-per-node)"
        ) from None
    env["DSCLIP_LAUNCHER_GPU_IDS"] = ",".join(ids)


def _translated(env, node_gpus: tuple[str, ...], ids: tuple[str, ...]) -> bool:
    # Called twice per rank (train/preflight.py before its CUDA query, then init_distributed): the second call
    # finds CUDA_VISIBLE_DEVICES already equal to the translation of the launcher ids it recorded.
    launcher = env.get("DSCLIP_LAUNCHER_GPU_IDS")
    if not launcher:
        return False
    try:
        return ids == tuple(node_gpus[int(i)] for i in launcher.split(","))
    except (ValueError, IndexError):
        return False


def resolve_device(info: WorldInfo, env=None, *, cuda_count: int | None = None) -> DeviceBinding:
    """Which GPU index this rank binds, valid in its own view (see :class:`DeviceBinding`).

    ``cuda_count``: ``torch.cuda.device_count()`` on a GPU run, None on a CPU-only machine (the view
    is then counted from ``CUDA_VISIBLE_DEVICES``). Rule, with n GPUs visible and L ranks on the node:
    n == 1 → 0 (``--gpus-per-task=1``, ``--gpu-bind=single``, ``map_gpu``); n >= L → the local rank (each
    rank sees the whole node: deepspeed, torchrun, plain srun); n < L with L a multiple of n → local rank
    mod n (``--gpu-bind=closest``: each socket's tasks see that socket's GPUs); anything else is an error
    on a GPU run (on a CPU run: nothing to bind, ``index`` None).
    """
    env = os.environ if env is None else env
    visible = _visible(env)
    on_gpu = cuda_count is not None
    if on_gpu:
        n = cuda_count
    else:
        n = len(visible) if visible is not None else info.local_world_size
    local, lws = info.local_rank, info.local_world_size
    who = f"rank {info.rank} (local {local}/{lws}, host {socket.gethostname()})"
    cvd = "unset" if visible is None else repr(env.get("CUDA_VISIBLE_DEVICES"))
    if n == 0:
        if not on_gpu:  # CUDA_VISIBLE_DEVICES="" is the usual way to force a CPU run
            return DeviceBinding(None, 0, visible, False)
        raise DeviceBindingError(
            f"{who}: no GPU visible to this task (CUDA_VISIBLE_DEVICES={cvd}); request GPUs for every task "
            "(--gpus-per-task=1 or --gpus-per-node) or unset CUDA_VISIBLE_DEVICES"
        )
    if n == 1:
        index = 0
    elif n >= lws:
        index = local
    elif lws % n == 0:
        index = local % n
    elif not on_gpu:
        return DeviceBinding(None, n, visible, False)  # a CPU run: nothing is bound, nothing to refuse
    else:
        raise DeviceBindingError(
            f"{who}: sees {n} GPUs (CUDA_VISIBLE_DEVICES={cvd}) for {lws} ranks on this node, so ranks would share "
            "a GPU; start one rank per GPU (--ntasks-per-node / --num_gpus = GPUs per node) or give each task its "
            "own GPU (--gpus-per-task=1)"
        )
    return DeviceBinding(index, n, visible, on_gpu)


def cpu_affinity() -> list[int]:
    """The cores this process may run on (SLURM task/affinity or cgroup binding, taskset, ...)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def threads_for_shared_cores(own: set[int], local_peers: list[set[int]], default: int) -> int:
    """Intra-op threads for one rank: its cores divided among the ranks of its host whose cores overlap
    them (itself included; ``local_peers`` lists every local rank's cores), at least 1, never more than
    torch's own default (its physical-core count, which ignores the affinity mask and the other ranks)."""
    return max(1, min(default, len(own) // max(1, ranks_sharing(own, local_peers))))


def ranks_sharing(own: set[int], local_peers: list[set[int]]) -> int:
    """How many of the local ranks (this one included) may run on at least one of this rank's cores."""
    return sum(1 for cpus in local_peers if cpus & own)


def host_identity() -> str:
    """Which machine this process runs on, as the cores see it: the kernel's boot id (shared by every
    container of one machine, different on every machine even where hostnames repeat, e.g. containers all
    named "localhost"), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def share_cores(info: WorldInfo, env=None) -> str:
    """Set torch's intra-op threads so the ranks of a host do not oversubscribe it; returns how (for the
    rank line). Only when ``OMP_NUM_THREADS`` is unset: torch then gives every rank as many threads as the
    machine has physical cores, so N ranks on one host run N x that many spinning OpenMP threads, and a
    rank waiting for a peer whose threads lost their core stalls (measured: 2 ranks on 2 cores, tiny model,
    steps 0.08-1.6 s against 0.03-0.05 s with one thread each; bench/rank_threads.py). torchrun sets 1
    thread in that case; dividing the cores keeps a CPU run with few ranks per host fast. The ranks compare
    their affinity masks and machines (one small all-gather at start), so launcher core binding (numactl,
    SLURM task/affinity) counts: disjoint masks are not shared. An explicit OMP_NUM_THREADS always wins."""
    env = os.environ if env is None else env
    own = set(cpu_affinity())
    if info.world_size > 1 and dist.is_initialized():
        # every rank takes part, whatever its own environment says (a rank skipping it would hang the rest)
        everyone = [None] * info.world_size
        here = host_identity()
        dist.all_gather_object(everyone, (here, sorted(own)))
        peers = [set(cpus) for host, cpus in everyone if host == here]
    else:  # no process group to ask: assume the launcher's local ranks share this rank's cores
        peers = [own] * max(1, info.local_world_size)
    if env.get("OMP_NUM_THREADS"):
        return f"threads {torch.get_num_threads()} (OMP_NUM_THREADS)"
    threads = threads_for_shared_cores(own, peers, torch.get_num_threads())
    torch.set_num_threads(threads)
    env["OMP_NUM_THREADS"] = str(threads)  # what this rank's own subprocesses (compile workers) inherit
    sharing = ranks_sharing(own, peers)
    ranks = f"{sharing} local rank" + ("s" if sharing != 1 else "")
    return f"threads {threads} ({len(own)} cpus / {ranks}, OMP_NUM_THREADS unset)"


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5" (the cpuset list syntax of taskset / Cpus_allowed_list)."""
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


def _line(msg: str) -> None:
    """One stderr line in one write: the ranks of a node share a pipe, and under ``python -u`` print()
    writes the text and its newline separately, so two ranks' lines would interleave."""
    say(msg, stream=sys.stderr)  # into RUN/out.log too, once it exists (dsclip.console)


def check_workers(workers: int, rank: int | None = None) -> str | None:
    """One warning line when ``--workers`` data workers (plus the rank itself) exceed the rank's cores."""
    cores = len(cpu_affinity())
    if workers <= cores:
        return None
    rank = (_state["info"].rank if _state["info"] else 0) if rank is None else rank
    msg = (
        f"[dsclip] rank {rank}: WARNING --workers {workers} exceeds the {cores} core(s) this rank may use "
        f"(affinity {format_cpus(cpu_affinity())}); lower --workers to {cores} or request more cores per task "
        "(--cpus-per-task; srun needs -c or SRUN_CPUS_PER_TASK since Slurm 22.05)"
    )
    _line(msg)
    return msg


def check_master_port(info: WorldInfo, env=None) -> None:
    """Rank 0 hosts the rendezvous store on MASTER_PORT: fail with one line if another process holds it
    (the other ranks would otherwise wait for the full timeout, or join a stranger's store)."""
    env = os.environ if env is None else env
    if info.rank != 0 or info.world_size == 1 or info.source == "torchrun" or "TORCHELASTIC_USE_AGENT_STORE" in env:
        return  # torchrun's agent already listens on MASTER_PORT on purpose
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            s.bind(("", info.master_port))
        except OSError:
            raise WorldDiscoveryError(
                f"rank 0 (host {socket.gethostname()}): MASTER_PORT {info.master_port} is already in use on "
                f"{info.master_addr} (another job?); set MASTER_PORT to a free port"
            ) from None


# The network settings the launch scripts forward and README documents, as each rank sees them.
NET_VARS = (
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_HCA",
    "NCCL_DEBUG",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "GLOO_SOCKET_IFNAME",
)


def net_settings(env=None) -> str:
    """``NCCL_SOCKET_IFNAME=ib0,NCCL_DEBUG=WARN`` (the set ones of :data:`NET_VARS`), or ``-``."""
    env = os.environ if env is None else env
    return ",".join(f"{k}={env[k]}" for k in NET_VARS if env.get(k)) or "-"


def resolve_timeout(timeout_s: float | None = None, env=None) -> timedelta:
    """Process-group timeout: DSCLIP_DIST_TIMEOUT (s) > DEEPSPEED_TIMEOUT (min) > ``timeout_s`` > 30 min."""
    env = os.environ if env is None else env
    if env.get("DSCLIP_DIST_TIMEOUT"):
        return timedelta(seconds=float(env["DSCLIP_DIST_TIMEOUT"]))
    if env.get("DEEPSPEED_TIMEOUT"):
        return timedelta(minutes=float(env["DEEPSPEED_TIMEOUT"]))
    return timedelta(seconds=DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s))


_state = {"info": None, "binding": None, "failed": False, "atexit": False, "prev_excepthook": None}


def _excepthook(tp, value, tb):
    # An uncaught exception means the other ranks may never reach our exit barrier: skip it.
    _state["failed"] = True
    (_state["prev_excepthook"] or sys.__excepthook__)(tp, value, tb)


def init_distributed(
    timeout_s: float | None = None, backend: str | None = None, init_method: str | None = None
) -> WorldInfo:
    """Discover the world, export it, and create the default process group (through DeepSpeed).

    Backend: ``backend`` (OpenCLIP's --dist-backend) or ``DSCLIP_DIST_BACKEND``, else nccl on CUDA and
    gloo otherwise. ``init_method`` (OpenCLIP's --dist-url): torch's rendezvous URL, default env://.
    Also called for a single process (DeepSpeed needs a process group either way). Idempotent.
    """

    if _state["info"] is not None and dist.is_initialized():
        return _state["info"]
    info = discover_world()
    export_env(info)
    remap_launcher_devices()  # before CUDA initialises: it reads CUDA_VISIBLE_DEVICES once
    on_gpu = torch.cuda.is_available()
    binding = resolve_device(info, cuda_count=torch.cuda.device_count() if on_gpu else None)
    backend = backend or os.environ.get("DSCLIP_DIST_BACKEND")
    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(binding.index)
    _state["binding"] = binding
    if init_method in (None, "env://"):  # another URL names its own rendezvous; MASTER_PORT is unused
        check_master_port(info)
    timeout = resolve_timeout(timeout_s)

    # lazy: launchers' stand-ins and the CLI's error path import this module; deepspeed takes seconds to load
    import deepspeed

    # tcp:// and file:// rendezvous need rank and world size spelled out (env:// reads them from the
    # environment export_env just wrote), so hand over the discovered ones with any URL.
    ranks = dict(rank=info.rank, world_size=info.world_size) if init_method else {}
    install_log_filter()
    with shm_op_for_world(info.world_size):  # one rank: no shm op build/load; never its "built" line
        deepspeed.init_distributed(
            dist_backend=backend,
            timeout=timeout,
            auto_mpi_discovery=False,
            verbose=info.rank == 0,
            init_method=init_method,
            **ranks,
        )
    release_shm_workspace()
    threads = share_cores(info)
    _state["info"] = info
    if os.environ.get("DSCLIP_LOG_WORLD", "1") != "0":
        # one line per rank: the first thing to look at when a launch misbehaves
        _line(
            f"[dsclip] rank {info.rank}/{info.world_size} local {info.local_rank}/{info.local_world_size} "
            f"host {socket.gethostname()} node {os.environ.get('SLURMD_NODENAME', '-')} "
            f"source {info.source} master {init_method or f'{info.master_addr}:{info.master_port}'} backend {backend} "
            f"timeout {int(timeout.total_seconds())}s {binding.describe()} "
            f"cpus {format_cpus(cpu_affinity())} ({len(cpu_affinity())}) net {net_settings()} {threads}"
        )
    if not _state["atexit"]:
        _state["atexit"] = True
        _state["prev_excepthook"] = sys.excepthook
        sys.excepthook = _excepthook
        atexit.register(_shutdown_at_exit)
    return info


def device_rank() -> int | None:
    """The device index :func:`init_distributed` bound (DeepSpeed's ``device_rank``), None before it."""
    b = _state["binding"]
    return None if b is None else b.index


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


# what gloo / NCCL / the TCP store raise on the survivors when a peer process is gone (killed, OOM, crashed):
# a collective's read or write on its socket fails, or the communicator is aborted
PEER_LOST = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL is aborted",
)


def peer_lost(exc: BaseException) -> str | None:
    """The first line of ``exc`` when it says that another rank of the job is gone (else None)."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(m in text for m in PEER_LOST):
        line = text.strip().splitlines()[0] if text.strip() else text
        return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically", 1)[0]  # gloo's source path
    return None


def lost_peer_name(rank: int, world_size: int) -> str:
    """Which rank died, as far as this one can tell: gloo names only an address, so with two ranks it is the
    other one; with more, the launcher's output (or that rank's out-RANK.log with --log-local) names it."""
    if world_size == 2:
        return f"rank {1 - rank}"
    return f"another of the {world_size} ranks (the launcher's output names it)"


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


# --- stop requests: SIGUSR1 (requeue), SIGTERM (stop, no requeue), a second SIGTERM (now) --------------
#
# One meaning per signal, the same for every launcher and documented in README ("Signals"):
#   SIGUSR1  time-limit warning (sbatch --signal=B:USR1@120, forwarded by the batch scripts): finish
#            the step, save a checkpoint, exit EXIT_REQUEUE (85); the batch scripts requeue on 85 only.
#   SIGTERM  scancel, scheduler preemption, the time limit itself: finish the step, save, exit
#            EXIT_TERMINATED (143 = 128 + SIGTERM); never requeued.
#   SIGTERM again, more than TERM_REPEAT_S after the first one (or after SIGUSR1): stop now (default
#            action). SLURM delivers one scancel twice within milliseconds (to the step and through
#            srun's forwarding), which must not count as a second request. Once the stop's checkpoint is
#            safe (stop_saved), "now" exits with the stop's own code (85/143) instead of dying of the
#            signal: a launcher would report the death (-15, pdsh 241) as a failure of a job that saved.
# TERM wins over USR1 when ranks disagree (someone cancelled the job).

EXIT_TERMINATED = 128 + signal.SIGTERM
TERM_REPEAT_S = 1.0
STOP_NONE, STOP_REQUEUE, STOP_TERMINATE = None, "requeue", "terminate"

_preempt = {"signum": None, "usr1": False, "term": False, "first_at": None, "saved_code": None}


def install_preemption_handler(signals=PREEMPT_SIGNALS) -> None:
    """Record ``SIGUSR1``/``SIGTERM`` (the loop acts at the end of the step, on every rank together);
    a later ``SIGTERM`` ends the process at once (see the table above)."""

    def handler(signum, frame):
        now = time.monotonic()
        first = _preempt["first_at"]
        if signum == signal.SIGTERM and first is not None and now - first > TERM_REPEAT_S:
            code = _preempt["saved_code"]
            if code is not None:  # asked twice after the stop's save: nothing is left to lose, end with its code
                supervise.report_exit(code)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # asked twice: stop now
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if first is None:
            _preempt["first_at"] = now
        _preempt["signum"] = signum
        _preempt["usr1" if signum == signal.SIGUSR1 else "term"] = True

    for s in signals:
        signal.signal(s, handler)
    # `dsclip launch` starts the launcher with them blocked (its own SIGTERM handler would end the ranks
    # early), and the mask is inherited: dsclip.cli unblocks them at start, this covers other callers.
    # A rank whose supervisor dies stops as on SIGTERM.
    supervise.release_stop_signals()
    supervise.watch_supervisor()


def stop_saved(code: int) -> None:
    """The stop's checkpoint is safe and this rank now exits with ``code``: a second SIGTERM from here on ends
    the process at once with that code rather than by the signal, and one that comes while the interpreter
    shuts down is ignored (see :func:`_ignore_stop_signals_at_exit`)."""
    if _preempt["saved_code"] is None:
        atexit.register(_ignore_stop_signals_at_exit)
    _preempt["saved_code"] = int(code)


def _ignore_stop_signals_at_exit() -> None:
    """After the atexit callbacks CPython puts every signal with a Python handler back to its default action
    (``_PySignal_Fini``), and then tears the modules down, which for a rank (process groups, DeepSpeed, data
    workers) takes long enough for a late SIGTERM to arrive: it killed the rank with -15 after its save, and
    DeepSpeed's launch.py reported -15 (pdsh 241) for a job that had saved (tests/e2e/test_launch.py's pdsh
    SIGTERM case, intermittently). An ignored signal keeps its disposition through that teardown, so the
    rank ends with the stop's own code; SIGKILL, which launchers send 30 s after SIGTERM, still ends it."""
    if _preempt["saved_code"] is not None:
        for s in PREEMPT_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def local_stop_flags() -> tuple[float, float]:
    """(SIGUSR1 seen, SIGTERM seen) on this rank, as numbers to fold into a collective the step makes."""
    return float(_preempt["usr1"]), float(_preempt["term"])


def stop_reason(flags) -> str | None:
    """``STOP_*`` from flags summed over all ranks (every rank gets the same answer from the same sums)."""
    usr1, term = (float(f) for f in flags)
    if term > 0:
        return STOP_TERMINATE
    if usr1 > 0:
        return STOP_REQUEUE
    return STOP_NONE


def exit_code(reason: str | None) -> int:
    return {STOP_REQUEUE: EXIT_REQUEUE, STOP_TERMINATE: EXIT_TERMINATED}.get(reason, 0)


def preemption_requested(sync: bool = True) -> str | None:
    """The stop reason (truthy) once any rank got SIGUSR1/SIGTERM. With ``sync`` (default) this is a
    collective (a SUM all-reduce of two numbers plus a host sync) so all ranks stop at the same step —
    call it on every rank. The training loop does not: the gradient cache folds the same flags into
    the all-reduce every step already makes (see dsclip/train/gradcache.py, bench/host_syncs.py)."""
    local = local_stop_flags()
    if not sync:
        return stop_reason(local)
    if rank_world()[1] == 1:
        return stop_reason(local)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor(local, dtype=torch.float32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    return stop_reason(flags.tolist())
