"""The process group's life cycle: :func:`init_distributed` (discover, export, bind the device, share the
cores, create the group through DeepSpeed, print the rank line) and :func:`shutdown` (barrier +
``destroy_process_group``), which is also registered ``atexit`` — without it ranks sometimes abort with
code 134 after succeeding.

Failure behaviour: a rank that dies closes its sockets, so the other ranks' next collective fails
at once (gloo: "Connection closed by peer"; :func:`peer_lost` recognises it), they exit non-zero, and
the launchers propagate it (``deepspeed`` kills the node's other ranks and exits with the rank's code;
``srun --kill-on-bad-exit=1`` ends the step). A rank that *hangs* is bounded by the process-group
timeout: ``DSCLIP_DIST_TIMEOUT`` (seconds), ``DEEPSPEED_TIMEOUT`` (minutes, DeepSpeed's convention),
the ``timeout_s`` argument, or 30 minutes — first one set wins. That long timeout is for the start-up
and the first steps (compilation, the first checkpoint load); from the third step on the loop shortens it
(:func:`set_collective_timeout`, ``--collective-timeout``) and puts it back around checkpoint saves and
evaluations (dsclip.train.hang), and :func:`collective_timed_out` recognises a wait that ran out.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from dsclip.console import say
from dsclip.dist import initialized
from dsclip.engine.log_filter import install_log_filter
from dsclip.engine.shm_op import shm_op_for_world
from dsclip.engine.shm_workspace import release_shm_workspace

# Module references, not names: a test that replaces cores.cpu_affinity or discovery.check_master_port
# changes what init_distributed calls too.
from dsclip.engine.world import cores, devices, discovery
from dsclip.engine.world.discovery import WorldInfo

DEFAULT_TIMEOUT_S = 30 * 60


def _line(msg: str) -> None:
    """One stderr line in one write: the ranks of a node share a pipe, and under ``python -u`` print()
    writes the text and its newline separately, so two ranks' lines would interleave."""
    say(msg, stream=sys.stderr)  # into RUN/out.log too, once it exists (dsclip.console)


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


_state = {"info": None, "binding": None, "timeout": None, "failed": False, "atexit": False, "prev_excepthook": None}


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
    info = discovery.discover_world()
    discovery.export_env(info)
    devices.remap_launcher_devices()  # before CUDA initialises: it reads CUDA_VISIBLE_DEVICES once
    on_gpu = torch.cuda.is_available()
    binding = devices.resolve_device(info, cuda_count=torch.cuda.device_count() if on_gpu else None)
    backend = backend or os.environ.get("DSCLIP_DIST_BACKEND")
    if backend is None:
        backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(binding.index)
    _state["binding"] = binding
    if init_method in (None, "env://"):  # another URL names its own rendezvous; MASTER_PORT is unused
        discovery.check_master_port(info)
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
    threads = cores.share_cores(info)
    _state["info"], _state["timeout"] = info, timeout
    if os.environ.get("DSCLIP_LOG_WORLD", "1") != "0":
        # one line per rank: the first thing to look at when a launch misbehaves
        _line(
            f"[dsclip] rank {info.rank}/{info.world_size} local {info.local_rank}/{info.local_world_size} "
            f"host {socket.gethostname()} node {os.environ.get('SLURMD_NODENAME', '-')} "
            f"source {info.source} master {init_method or f'{info.master_addr}:{info.master_port}'} backend {backend} "
            f"timeout {int(timeout.total_seconds())}s {binding.describe()} "
            f"cpus {cores.format_cpus(cores.cpu_affinity())} ({len(cores.cpu_affinity())}) "
            f"net {net_settings()} {threads}"
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


def long_timeout() -> timedelta:
    """The timeout the process group was created with (:func:`resolve_timeout` before :func:`init_distributed`)."""
    return _state["timeout"] or resolve_timeout()


def set_collective_timeout(timeout: timedelta) -> int:
    """``timeout`` for every collective issued from now on, in every process group this rank belongs to (the
    default one and those DeepSpeed made for ZeRO); returns how many groups. Work already issued keeps the
    timeout it had. gloo and NCCL honour it (``torch.distributed.set_timeout``)."""
    if not initialized():
        return 0
    # private, read-only: the registry of this process's groups (torch has no public list of them)
    groups = list(dist.distributed_c10d._world.pg_map)
    for group in groups:
        dist.set_timeout(timeout, group)
    return len(groups)


# what gloo and NCCL raise when a collective waited out its timeout (a peer that hangs rather than dies):
# gloo names no peer, NCCL the operation and its sequence number
TIMED_OUT = (
    "Timed out waiting",  # gloo: "... Timed out waiting 300000ms for recv operation to complete"
    "Application timeout caused pair closure",  # gloo: the next collective after a timed-out one
    "collective operation timeout",  # NCCL: "Watchdog caught collective operation timeout: WorkNCCL(...)"
)


def collective_timed_out(exc: BaseException) -> str | None:
    """The first line of ``exc`` when it says that a collective waited out its timeout (else None)."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and any(m in text for m in TIMED_OUT):
        line = text.strip().splitlines()[0]
        return re.sub(r"^\[[^\]]*\]\s*", "", line)  # gloo's source path
    return None


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
