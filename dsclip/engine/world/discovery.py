"""Rank, world size and rendezvous address of this process, from the launcher's environment.

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
discovery and fails (dsclip.engine.world.process_group.init_distributed exports what is found here).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass

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
    if argv_local_rank is not None or any(v in env for v in _LAUNCHER_VARS):
        return _from_launcher(env, argv_local_rank)  # deepspeed / torchrun / anything exporting torch's variables
    if "SLURM_PROCID" in env:
        return _from_slurm(env)  # srun: one process per task
    return _single(env)


def _from_launcher(env, argv_local_rank: int | None) -> WorldInfo:
    present = [v for v in _LAUNCHER_VARS if v in env]
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
    addr, port = env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    return _checked(WorldInfo(rank, local_rank, world, max(local_world, local_rank + 1), addr, port, source))


def _from_slurm(env) -> WorldInfo:
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
