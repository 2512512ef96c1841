"""What one rank's training step sends, counted: :class:`CollectiveCounter` counts every collective a process
makes, per kind: calls and bytes, with the group size of each call. How long those bytes take on a cluster's
links is the planner's (dsclip.plan.comm: LinkModel, estimate).

It wraps ``torch.distributed``'s functions (module attributes), because every path ends there: dsclip's loss
and gradient cache call them directly, and DeepSpeed's ``TorchBackend`` calls them too, partly through
references it takes once when its backend is created (``get_all_gather_function``) - so the counter must be
installed *before* ``deepspeed.init_distributed``. DeepSpeed's own comms logger sees only what goes through
``deepspeed.comm``, not dsclip's loss, so it is not used. A call made inside another counted call
(``all_gather_object`` -> ``all_gather``) counts once. The same counter instruments a real gloo group and
torch's fake group, which is what lets a test hold the fake rank's bytes equal to a real rank's.

Under the fake group nothing arrives, so ``fill_outputs=True`` writes this rank's own shard where the peers'
would land (all-gather) and its own chunk of a reduce-scatter: gathered ZeRO-3 weights and reduced gradients
stay finite instead of being whatever ``torch.empty`` held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from dsclip.plan.comm import Traffic

# torch is imported where used: the rehearsal's parent (`dsclip plan --measure`) loads this module light
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "barrier", "send", "recv")


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
    # the ring losses' point-to-point exchange (dsclip.losses.distributed.Ring): counted per op, as "send" and
    # "recv" (:func:`_p2p_ops`), not as one kind
    "batch_isend_irecv": ("p2p", lambda a, k: 0),
    # object collectives pickle into tensors and call the ones above; counted once, as what they call
    "all_gather_object": ("all_gather", lambda a, k: 0),
    "broadcast_object_list": ("broadcast", lambda a, k: 0),
}


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
                if kind == "p2p":
                    for op_kind, op in _p2p_ops(args, kwargs):
                        self.traffic.add(op_kind, dist.get_world_size(op.group), _nbytes(op.tensor), self.phase)
                else:
                    self.traffic.add(kind, dist.get_world_size(kwargs.get("group")), size(args, kwargs), self.phase)
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


def _p2p_ops(args, kwargs) -> list[tuple[str, object]]:
    """("send" | "recv", P2POp) of each op of a ``batch_isend_irecv`` call. By the op's function name: torch
    checks ``op.op is isend`` itself, so the counter never wraps isend / irecv."""
    ops = _arg(args, kwargs, 0, "p2p_op_list") or []
    return [("send" if getattr(op.op, "__name__", "") == "isend" else "recv", op) for op in ops]


def _fill_received(args, kwargs) -> None:
    """The fake group's p2p receives land nowhere, so their buffers hold whatever ``torch.empty`` left (a ring
    loss on them is not finite): each receive gets a copy of what this rank sends in the same call (the ring's
    blocks are the same size on every rank, so the peer would have sent alike), zeros where no send matches."""
    ops = _p2p_ops(args, kwargs)
    sends = [op.tensor for kind, op in ops if kind == "send"]
    for i, recv in enumerate(op.tensor for kind, op in ops if kind == "recv"):
        send = sends[i] if i < len(sends) else None
        if send is not None and send.numel() == recv.numel() and send.dtype == recv.dtype:
            recv.copy_(send.reshape(recv.shape))
        else:
            recv.zero_()


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
    elif name == "batch_isend_irecv":
        _fill_received(args, kwargs)
    # all_reduce, broadcast, reduce: the tensor already holds finite data of the right shape
