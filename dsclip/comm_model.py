"""What one rank's training step sends, and how long that takes on a cluster's links.

Two halves:

* :class:`CollectiveCounter` counts every collective a process makes, per kind: calls and bytes, with the
  group size of each call. It wraps ``torch.distributed``'s functions (module attributes), because every
  path ends there: dsclip's loss and gradient cache call them directly, and DeepSpeed's ``TorchBackend``
  calls them too, partly through references it takes once when its backend is created
  (``get_all_gather_function``) - so the counter must be installed *before* ``deepspeed.init_distributed``.
  DeepSpeed's own comms logger sees only what goes through ``deepspeed.comm``, not dsclip's loss, so it is
  not used. A call made inside another counted call (``all_gather_object`` -> ``all_gather``) counts once.
  The same counter instruments a real gloo group and torch's fake group, which is what lets a test hold the
  fake rank's bytes equal to a real rank's.
  Under the fake group nothing arrives, so ``fill_outputs=True`` writes this rank's own shard where the
  peers' would land (all-gather) and its own chunk of a reduce-scatter: gathered ZeRO-3 weights and
  reduced gradients stay finite instead of being whatever ``torch.empty`` held.

* :class:`LinkModel` turns counted bytes into seconds with nccl-tests' bus-bandwidth convention:
  ``time = size x factor(n) / busbw`` where ``size`` is the collective's whole buffer (all-reduce: the
  tensor; all-gather: the gathered output; reduce-scatter: the input) and ``factor`` the ring's traffic per
  byte: all-reduce ``2(n-1)/n``, all-gather and reduce-scatter ``(n-1)/n``, broadcast 1. A group that fits
  in one node runs at the intra-node bus bandwidth, a larger one at the inter-node bandwidth per GPU (a flat
  ring bound: NCCL's tree/NVLS algorithms can do better across nodes, so this errs long).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# torch is imported where used: `dsclip plan --help` reads this module's defaults and must stay light
# Defaults, each with where it comes from (printed beside the times).
# Intra-node: nccl-tests all_reduce_perf busbw at large sizes on 8x H100 SXM5 with NVSwitch, 460-480 GB/s;
# we take the low end. H200 has the same NVLink-4 / NVSwitch fabric (900 GB/s bidirectional per GPU).
INTRA_NODE_GBPS = 460.0
INTRA_NODE_SOURCE = (
    "nccl-tests all_reduce_perf busbw 460-480 GB/s on 8x H100 SXM5 NVSwitch, low end "
    "(docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests); H200: same NVLink-4 fabric"
)
# Inter-node: one 400 Gb/s InfiniBand NDR (ConnectX-7) port per GPU, as on DGX/HGX H100 and H200 nodes.
INTER_NODE_GBPS = 50.0
INTER_NODE_SOURCE = "InfiniBand NDR 400 Gb/s per GPU (one ConnectX-7 per GPU on HGX H100/H200) = 50 GB/s, link rate"

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "barrier")


def _nbytes(t) -> int:
    import torch

    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args, kwargs, i: int, *names):
    if len(args) > i:
        return args[i]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


# function name -> (kind, bytes of the call from (args, kwargs)). Sizes follow nccl-tests: the whole buffer.
_SIZES: dict[str, tuple[str, Callable]] = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "all_reduce_coalesced": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensors"))),
    "all_gather": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "tensor_list"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "_all_gather_base": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),  # torch >= 2.14
    "all_gather_coalesced": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor_lists"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input_list"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "_reduce_scatter_base": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "reduce": ("reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "all_to_all": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor_list"))),
    "barrier": ("barrier", lambda a, k: 0),
    # object collectives pickle into tensors and call the ones above; counted once, as what they call
    "all_gather_object": ("all_gather", lambda a, k: 0),
    "broadcast_object_list": ("broadcast", lambda a, k: 0),
}


@dataclass
class Traffic:
    """Per (kind, group size, phase of the step): calls and bytes."""

    calls: dict[tuple[str, int, str], int] = field(default_factory=dict)
    bytes: dict[tuple[str, int, str], int] = field(default_factory=dict)

    def add(self, kind: str, group: int, nbytes: int, phase: str = "other") -> None:
        key = (kind, group, phase)
        self.calls[key] = self.calls.get(key, 0) + 1
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def merge(self, other: Traffic) -> None:
        for key, c in other.calls.items():
            self.calls[key] = self.calls.get(key, 0) + c
            self.bytes[key] = self.bytes.get(key, 0) + other.bytes[key]

    def by_kind(self) -> dict[str, tuple[int, int]]:
        """kind -> (calls, bytes), summed over group sizes."""
        out: dict[str, tuple[int, int]] = {}
        for key, c in self.calls.items():
            calls, b = out.get(key[0], (0, 0))
            out[key[0]] = (calls + c, b + self.bytes[key])
        return out

    def scaled(self, divisor: int) -> Traffic:
        """Per step from a total over ``divisor`` steps (integer division: counts are per-step exact)."""
        return Traffic(
            {k: v // divisor for k, v in self.calls.items()}, {k: v // divisor for k, v in self.bytes.items()}
        )


def clocks() -> tuple[float, float, float]:
    """(wall, this process's CPU over all its threads, the calling thread's CPU), in seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


class CollectiveCounter:
    """Counts torch.distributed collectives while installed (``with counter: ...``); ``recording`` gates
    what is counted (warm-up steps off). ``fill_outputs``: under the fake group, write this rank's own data
    where the peers' would land, so nothing downstream reads uninitialised memory."""

    def __init__(self, fill_outputs: bool = False):
        self.traffic = Traffic()
        self.recording = True
        self.phase = "other"  # set by track_phases: forward / backward / step of the engine
        self.seconds = 0.0  # wall time inside counted calls while recording
        # CPU time inside the same intervals: the process's (all threads, gloo's workers included) and the
        # calling thread's own (the rank's main thread: what separates its host work from its communication)
        self.cpu_seconds = 0.0
        self.thread_seconds = 0.0
        self.fill_outputs = fill_outputs
        self._saved: dict[tuple[object, str], Callable] = {}
        self._installed = False
        self._depth = threading.local()

    def reset(self) -> None:
        self.traffic = Traffic()
        self.seconds = self.cpu_seconds = self.thread_seconds = 0.0

    def add_interval(self, start: tuple[float, float, float]) -> None:
        """Add the wall, process-CPU and thread-CPU time since ``start`` (from ``clocks()``)."""
        now = clocks()
        self.seconds += now[0] - start[0]
        self.cpu_seconds += now[1] - start[1]
        self.thread_seconds += now[2] - start[2]

    def __enter__(self) -> CollectiveCounter:
        import sys

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        wrappers: dict[int, Callable] = {}  # id(original) -> its wrapper
        for mod in (dist, distributed_c10d):
            for name in _SIZES:
                fn = getattr(mod, name, None)
                if fn is None or (mod, name) in self._saved:
                    continue
                wrapper = wrappers.setdefault(id(fn), self._wrap(name, fn))
                self._saved[(mod, name)] = fn
                setattr(mod, name, wrapper)
        # modules that took a reference at import (dsclip's loss: ``_all_gather_single = dist.all_gather_single``)
        for mod in list(sys.modules.values()):
            attrs = getattr(mod, "__dict__", None)
            if not isinstance(attrs, dict) or mod in (dist, distributed_c10d):
                continue
            for attr, value in list(attrs.items()):
                if callable(value) and id(value) in wrappers and (mod, attr) not in self._saved:
                    self._saved[(mod, attr)] = value
                    setattr(mod, attr, wrappers[id(value)])
        # collectives issued inside torch's coalescing manager are queued and sent at its exit: time it too
        cm = getattr(distributed_c10d, "_coalescing_manager", None)
        if cm is not None:
            self._saved[(distributed_c10d, "_coalescing_manager")] = cm
            distributed_c10d._coalescing_manager = _timed_exit(cm, self)
        self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        self._installed = False  # a reference taken while installed now calls straight through
        for (mod, name), fn in self._saved.items():
            setattr(mod, name, fn)
        self._saved.clear()

    def _wrap(self, name: str, fn: Callable) -> Callable:
        import torch.distributed as dist

        kind, size = _SIZES[name]

        def counted(*args, **kwargs):
            if not self._installed:
                return fn(*args, **kwargs)
            depth = getattr(self._depth, "n", 0)
            if depth == 0 and self.recording:
                group = kwargs.get("group")
                self.traffic.add(kind, dist.get_world_size(group), size(args, kwargs), self.phase)
            self._depth.n = depth + 1
            t0 = clocks()
            try:
                out = fn(*args, **kwargs)
            finally:
                self._depth.n = depth
                if depth == 0 and self.recording:  # a real group's time inside the call (async: the launch)
                    self.add_interval(t0)
            if self.fill_outputs and depth == 0:
                _fill(name, args, kwargs)
            if depth == 0 and self.recording and hasattr(out, "wait"):  # async: its wait is collective time too
                return _TimedWork(out, self)
            return out

        counted.__wrapped__ = fn
        return counted


def _timed_exit(make_cm: Callable, counter: CollectiveCounter) -> Callable:
    """A context-manager factory whose exit time (where queued collectives are sent) adds to the counter's."""

    def wrapped(*args, **kwargs):
        cm = make_cm(*args, **kwargs)

        class Timed:
            def __enter__(self):
                return cm.__enter__()

            def __exit__(self, *exc):
                t0 = clocks()
                try:
                    return cm.__exit__(*exc)
                finally:
                    if counter._installed and counter.recording:
                        counter.add_interval(t0)

        return Timed()

    return wrapped


class _TimedWork:
    """An async collective's handle whose ``wait`` adds to the counter's time (the rest is the handle's)."""

    def __init__(self, work, counter: CollectiveCounter):
        self._work, self._counter = work, counter

    def wait(self, *args, **kwargs):
        t0 = clocks()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            if self._counter.recording:
                self._counter.add_interval(t0)

    def __getattr__(self, name):
        return getattr(self._work, name)


def track_phases(engine, counter: CollectiveCounter) -> None:
    """Label each collective with the engine call it happens in (forward, backward, step; "other": the
    loss's gathers and the gradient cache's own all-reduce), which is what decides whether it can overlap.
    Instance attributes shadow the engine's methods; nn.Module's __call__ reads ``self.forward``."""

    def phased(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            before, counter.phase = counter.phase, name
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase = before

        return call

    for name in ("forward", "backward", "step"):
        setattr(engine, name, phased(name, getattr(engine, name)))
    if hasattr(engine, "coalesce_grad_reduction"):  # its exit reduces the K backwards' gradients at once
        engine.coalesce_grad_reduction = _exit_phased(engine.coalesce_grad_reduction, counter, "boundary")


def _exit_phased(make_cm: Callable, counter: CollectiveCounter, name: str) -> Callable:
    def wrapped(*args, **kwargs):
        cm = make_cm(*args, **kwargs)

        class Exit:
            def __enter__(self):
                return cm.__enter__()

            def __exit__(self, *exc):
                before, counter.phase = counter.phase, name
                try:
                    return cm.__exit__(*exc)
                finally:
                    counter.phase = before

        return Exit()

    return wrapped


def _fill(name: str, args, kwargs) -> None:
    """What a real collective would have written, with this rank's own data standing in for every peer's."""
    import torch

    with torch.no_grad():
        _fill_outputs(name, args, kwargs)


def _fill_outputs(name: str, args, kwargs) -> None:
    import torch.distributed as dist

    if name in ("all_gather_into_tensor", "_all_gather_base", "all_gather_single"):
        out, inp = _arg(args, kwargs, 0, "output_tensor"), _arg(args, kwargs, 1, "input_tensor")
        flat = inp.reshape(-1)
        for slot in out.view(-1, inp.numel()):  # the own slot may be the input itself (in place)
            if slot.data_ptr() != flat.data_ptr():
                slot.copy_(flat)
    elif name == "all_gather":
        outs, inp = _arg(args, kwargs, 0, "tensor_list"), _arg(args, kwargs, 1, "tensor")
        for o in outs:
            if o.data_ptr() != inp.data_ptr():
                o.copy_(inp)
    elif name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single"):
        out, inp = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input")
        mine = inp.reshape(-1, out.numel())[dist.get_rank()]
        if mine.data_ptr() != out.data_ptr():
            out.copy_(mine.view_as(out))
    elif name == "reduce_scatter":
        out, inputs = _arg(args, kwargs, 0, "output"), _arg(args, kwargs, 1, "input_list")
        if inputs[dist.get_rank()].data_ptr() != out.data_ptr():
            out.copy_(inputs[dist.get_rank()])
    # all_reduce, broadcast, reduce: the tensor already holds finite data of the right shape


# ---------------------------------------------------------------------------------------------------
# the link model
def ring_factor(kind: str, n: int) -> float:
    """Bytes each rank moves over its slowest link per byte of the collective's buffer (nccl-tests' busbw
    factor): all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n, broadcast / reduce 1, none at n = 1."""
    if n <= 1 or kind == "barrier":
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


@dataclass
class LinkModel:
    gpus_per_node: int = 8
    intra_gbps: float = INTRA_NODE_GBPS  # GB/s bus bandwidth inside a node
    inter_gbps: float = INTER_NODE_GBPS  # GB/s per GPU between nodes
    intra_source: str = INTRA_NODE_SOURCE
    inter_source: str = INTER_NODE_SOURCE

    def busbw(self, n: int) -> float:
        """GB/s of a ring over ``n`` ranks: intra-node while the group fits in a node, else the per-GPU
        inter-node link (the slowest hop of a ring that leaves the node)."""
        return self.intra_gbps if n <= self.gpus_per_node else self.inter_gbps

    def seconds(self, kind: str, n: int, nbytes: float) -> float:
        f = ring_factor(kind, n)
        return 0.0 if f == 0.0 else nbytes * f / (self.busbw(n) * 1e9)

    def describe(self) -> str:
        return (
            f"intra-node {self.intra_gbps:g} GB/s ({self.intra_source}); inter-node {self.inter_gbps:g} GB/s per "
            f"GPU ({self.inter_source}); {self.gpus_per_node} GPUs per node"
        )


# What hides behind compute, per ZeRO stage and phase of the step (track_phases labels each call):
# * ZeRO-1/2 with overlap_comm: gradient reductions made inside a backward run on a side stream, hidden
#   behind the rest of that backward.
# * dsclip's gradient cache reduces the K backwards' gradients once, when DeepSpeed's
#   coalesce_grad_reduction block exits ("boundary"): after the last backward, before the optimizer
#   step that needs them, so nothing is left to hide it: exposed.
# * ZeRO-3: gathers (and reduce-scatters) inside forward and backward are prefetched / overlapped
#   (stage3_prefetch_bucket_size): hidden up to the compute they overlap.
# * The step's all-gather of updated parameters (ZeRO-1/2) waits for the optimizer: exposed. The loss's
#   all-gather of embeddings and the gradient cache's all-reduce (phase "other") sit on the critical path.
def overlappable(kind: str, phase: str, zero: int, overlap_comm: bool) -> bool:
    if kind == "barrier":
        return False
    if zero >= 3:
        return phase in ("forward", "backward")
    return overlap_comm and phase == "backward"


@dataclass
class CommEstimate:
    total_s: float  # every collective back to back
    exposed_s: float  # what the overlap cannot hide, given the compute it could hide behind
    per_kind: dict[str, dict]  # "kind in phase" -> {"calls", "bytes", "seconds", "overlappable"}


def estimate(
    traffic: Traffic, link: LinkModel, *, zero: int, overlap_comm: bool, hideable_compute_s: float
) -> CommEstimate:
    """Time of one step's traffic on ``link``. ``hideable_compute_s`` is the compute the overlappable part can
    hide behind (ZeRO-1/2: the last backward, ZeRO-3: forward + backward); only the excess is exposed."""
    per_kind: dict[str, dict] = {}
    over = total = 0.0
    for (kind, n, phase), b in traffic.bytes.items():
        s = link.seconds(kind, n, b)
        ov = overlappable(kind, phase, zero, overlap_comm)
        d = per_kind.setdefault(f"{kind} in {phase}", {"calls": 0, "bytes": 0, "seconds": 0.0, "overlappable": ov})
        d["calls"] += traffic.calls[(kind, n, phase)]
        d["bytes"] += b
        d["seconds"] += s
        total += s
        over += s if ov else 0.0
    exposed = (total - over) + max(0.0, over - max(0.0, hideable_compute_s))
    return CommEstimate(total, exposed, per_kind)
