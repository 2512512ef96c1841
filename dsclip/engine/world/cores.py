"""The CPU cores of a rank: its affinity, the intra-op threads the ranks of one host share
(:func:`share_cores`), and the warning when ``--workers`` exceeds the rank's cores."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from dsclip.console import say
from dsclip.engine.world.discovery import WorldInfo


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
    steps 0.08-1.6 s against 0.03-0.05 s with one thread each; bench/results/rank-threads_cpu2_2026-12-01.md).
    torchrun sets 1 thread in that case; dividing the cores keeps a CPU run with few ranks per host fast. The
    ranks compare their affinity masks and machines (one small all-gather at start), so launcher core binding
    (numactl, SLURM task/affinity) counts: disjoint masks are not shared. An explicit OMP_NUM_THREADS always
    wins."""
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


def check_workers(workers: int, rank: int | None = None) -> str | None:
    """One warning line when ``--workers`` data workers (plus the rank itself) exceed the rank's cores."""
    cores = len(cpu_affinity())
    if workers <= cores:
        return None
    if rank is None:
        # imported here: process_group imports this module for share_cores
        from dsclip.engine.world.process_group import world_info

        info = world_info()
        rank = info.rank if info else 0
    msg = (
        f"[dsclip] rank {rank}: WARNING --workers {workers} exceeds the {cores} core(s) this rank may use "
        f"(affinity {format_cpus(cpu_affinity())}); lower --workers to {cores} or request more cores per task "
        "(--cpus-per-task; srun needs -c or SRUN_CPUS_PER_TASK since Slurm 22.05)"
    )
    # one write (the ranks of a node share a pipe); into RUN/out.log too, once it exists (dsclip.console)
    say(msg, stream=sys.stderr)
    return msg
