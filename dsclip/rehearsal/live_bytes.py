"""The bytes of tensor storage alive at once on a CPU rank: the CPU rehearsal's ``max_memory_allocated``.

A CPU rank's resident set is not what a GPU's allocator would hold: ``torch.empty`` buckets commit no pages
until written, freed blocks stay in glibc's arenas, and the interpreter and libraries sit beside the tensors.
What a GPU budget counts is the tensors alive together, so this counts exactly that: every storage an aten op
returns (factories, outputs, ``resize_``'d inputs) while the mode is on, held by a weak reference whose
callback subtracts its bytes when the storage dies. torch keeps one Python object per live storage (PyObject
preservation), so a storage seen twice (views, in-place ops) is counted once, and its bytes follow ``resize_``.

Storages made before the mode was entered are not counted, nor views of them or in-place ops on them (the
rehearsal's synthetic batches, which a GPU rank keeps in host memory); nor are storages C++ code allocates
without returning them through an aten op while the mode is on (none on the rehearsal's path: DeepSpeed's CPU
Adam writes into tensors torch made).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_RETURNS_AN_INPUT: dict = {}  # op overload -> whether an output may share an input's storage


def _may_return_an_input(func) -> bool:
    """Views, in-place and out= ops (an aliased return in the schema), and every op outside aten: c10d's
    collectives return their input tensors with no alias annotation. Other aten ops return fresh storage, so the
    (costly) look at their inputs' storages is skipped: the count's overhead on a step is mostly that look."""
    known = _RETURNS_AN_INPUT.get(func)
    if known is None:
        schema = func._schema
        known = not schema.name.startswith("aten::") or any(r.alias_info is not None for r in schema.returns)
        _RETURNS_AN_INPUT[func] = known
    return known


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes(device="cpu") as live: ...``; then ``live.current`` and ``live.peak`` (bytes).

    ``reset_peak()`` starts a new peak from what is alive now (as ``torch.cuda.reset_peak_memory_stats``)."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = torch.device(device).type
        self.current = 0
        self.peak = 0
        self._live: dict[int, list] = {}  # id(storage object) -> [weak reference, bytes counted]

    def reset_peak(self) -> None:
        self.peak = self.current

    def _forget(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[1]

    def _storage(self, t: torch.Tensor):
        if t.device.type != self.device:
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse / nested / wrapper tensors own no plain storage
            return None

    def _see(self, t: torch.Tensor, inputs: set) -> None:
        storage = self._storage(t)
        if storage is None:
            return
        key = id(storage)
        nbytes = storage.nbytes()
        entry = self._live.get(key)
        if entry is None and key in inputs:
            return  # a view of (or an in-place op on) a storage made before the mode: not this count's
        if entry is not None and entry[0]() is storage:
            self.current += nbytes - entry[1]  # resize_ (or a storage swapped in place): its bytes now
            entry[1] = nbytes
        else:
            # a new storage (or a new object at a dead one's id, whose callback is still pending)
            if entry is not None:
                self._forget(key)
            ref = weakref.ref(storage, lambda _r, key=key, live=self: live._dead(key, _r))
            self._live[key] = [ref, nbytes]
            self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _dead(self, key: int, ref) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            self._forget(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = set()
        if _may_return_an_input(func):  # only then can an output's storage be one made before the mode
            inputs = {
                id(s) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)
                for s in (self._storage(a),) if s is not None
            }  # fmt: skip
        out = func(*args, **(kwargs or {}))
        # in-place ops (resize_ included) return their input: it is seen again, at its new size
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._see(t, inputs)
        return out
