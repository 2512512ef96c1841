"""Which GPU a rank binds, as an index valid in its own ``CUDA_VISIBLE_DEVICES`` view, for every launcher
(:func:`resolve_device`), and the per-node DeepSpeed launcher's GPU ids mapped back into SLURM's set
(:func:`remap_launcher_devices`). Reads no CUDA itself: the caller passes the device count."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from dsclip.engine.world.discovery import WorldDiscoveryError, WorldInfo


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
