"""Asynchronous checkpoint saves through DeepSpeed's own seam: a ``CheckpointEngine`` of dsclip's, set on the
engine (``engine.checkpoint_engine``).

DeepSpeed's ``save_checkpoint`` hands every file it writes (each rank's ZeRO shard, data-parallel rank 0's
module file) to ``checkpoint_engine.save(state_dict, path)``, and dsclip's per-rank files (the sharded EMA) go
the same way. While a save is *captured* (:meth:`DsclipCheckpointEngine.capture`), ``save`` copies the state to
host memory (a memcpy on CPU; on GPU a device-to-host copy into pinned memory, one stream sync at the end) and
returns: the step loop stops only for that copy. :class:`BackgroundWrite` then writes the files with the
wrapped engine's own ``save`` (DeepSpeed's file layout and format unchanged) and checksums them for the
manifest, in one thread per rank, while training goes on. Completing the tag (the manifest, the rename,
``latest``) needs every rank's files on disk, so it is the caller's collective, on the main thread
(dsclip.checkpoint.ds_checkpoint.Checkpointer): no collective ever runs in the writer thread.

``load`` is :func:`dsclip.checkpoint.safe_load.load_data`: DeepSpeed's loads of a resume read data only.

:class:`SaveTimes` is what each save cost (``Checkpointer.save_times``), read by goodput accounting.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

from dsclip.checkpoint import manifest
from dsclip.checkpoint.safe_load import load_data


@dataclass
class SaveTimes:
    """What one save cost this rank, in seconds (``Checkpointer.save_times``, oldest first; goodput reads it).

    ``stall_s``: the step loop stopped for the save itself (asynchronous: the copy to host memory; blocking:
    the whole write). ``wait_s``: the step loop later waited for this save's background write to finish
    (the next save came while it was still writing, or the run's end, a stop signal or the divergence guard
    waited for it). ``write_s``: the background write itself (files + checksums), overlapping training.
    ``bytes``: the bytes this rank wrote. ``complete``: the tag was renamed into place and ``latest`` moved.
    Time lost to training by this save: ``stall_s + wait_s``."""

    tag: str
    step: int
    asynchronous: bool
    stall_s: float = 0.0
    wait_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    complete: bool = False

    @property
    def lost_s(self) -> float:
        return self.stall_s + self.wait_s


class HostBuffers:
    """Host memory for the copies, kept from one save to the next: allocating (and on GPU pinning) gigabytes
    at every save costs more than the copy itself (first-touch page faults: the measured CPU stall halved
    from the second save on). Buffers are flat, by (dtype, elements); the background writer gives each
    file's buffers back once the file is written. What is kept is what the start-up check counted."""

    def __init__(self):
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.dtype, t.numel())
        with self._lock:
            free = self._free.get(key)
            buf = free.pop() if free else None
        if buf is None:
            pin = t.device.type != "cpu" and torch.cuda.is_available()
            buf = torch.empty(t.numel(), dtype=t.dtype, device="cpu", pin_memory=pin)
        return buf.view(t.shape)

    def give_back(self, obj) -> None:
        seen = set()
        for t in _tensors(obj):
            if id(t) not in seen:
                seen.add(id(t))
                flat = t.view(-1)
                with self._lock:
                    self._free.setdefault((flat.dtype, flat.numel()), []).append(flat)


def _tensors(obj):
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)


def host_copy(obj, memo: dict | None = None, buffers: HostBuffers | None = None):
    """A copy of ``obj`` (nested dicts/lists/tuples of tensors and plain values) whose tensors live in host
    memory and share nothing with the originals: training may change the originals as soon as this returns
    (after :func:`sync_copies`). A tensor met twice is copied once (the copies share as the originals did).
    ``buffers``: where the copies' memory comes from (default: newly allocated)."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in memo:
            memo[key] = _tensor_copy(obj, buffers)
        return memo[key]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict's type (OrderedDict, defaultdict)
        for k, v in obj.items():
            out[k] = host_copy(v, memo, buffers)
        return out
    if isinstance(obj, list):
        return [host_copy(v, memo, buffers) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v, memo, buffers) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)  # namedtuples too
    return copy.deepcopy(obj)


def _tensor_copy(t: torch.Tensor, buffers: HostBuffers | None) -> torch.Tensor:
    t = t.detach()
    if buffers is None and t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)  # compact: a view of a flat buffer keeps only its own
    out = (buffers or HostBuffers()).take(t)
    # a device tensor: ordered on the current stream, sync_copies waits once for all
    out.copy_(t, non_blocking=t.device.type != "cpu")
    return out


def sync_copies() -> None:
    """Wait for the device-to-host copies :func:`host_copy` queued (a no-op on CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def nbytes(obj) -> int:
    """Bytes of the tensors in ``obj`` (each storage once)."""
    seen, total = set(), 0
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            key = (o.untyped_storage().data_ptr(), o.storage_offset(), o.numel())
            if key not in seen:
                seen.add(key)
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total


class DsclipCheckpointEngine(CheckpointEngine):
    """DeepSpeed's checkpoint seam, dsclip's: loads are data-only; saves pass through to ``inner`` (DeepSpeed's
    torch engine: its format settings) except while :meth:`capture` collects them as host copies."""

    def __init__(self, inner: CheckpointEngine):
        super().__init__(None)
        self.name = "DsclipCheckpointEngine"
        self.inner = inner
        self._captured: list[tuple[str, object]] | None = None
        self.buffers = HostBuffers()  # the copies' memory, reused by every save

    @classmethod
    def install(cls, engine) -> DsclipCheckpointEngine:
        """Set on ``engine`` (idempotent; before any load or save): DeepSpeed reads ``engine.checkpoint_engine``
        at every save and load."""
        current = engine.checkpoint_engine
        if not isinstance(current, cls):
            engine.checkpoint_engine = cls(current)
        return engine.checkpoint_engine

    def create(self, info):
        return self.inner.create(info)

    def makedirs(self, path, exist_ok=False):
        self.inner.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict, path: str):
        if self._captured is not None:
            self._captured.append((str(path), host_copy(state_dict, buffers=self.buffers)))
            return
        self.inner.save(state_dict, path)

    def write(self, state_dict, path: str) -> None:
        """The real write (the background writer's): the wrapped engine's format; then the copy's memory is
        free for the next save."""
        self.inner.save(state_dict, path)
        self.buffers.give_back(state_dict)

    def load(self, path: str, map_location=None):
        return load_data(path, map_location=map_location)

    def commit(self, info):
        return True

    def preserves_storage_sharing(self):
        # DeepSpeed clones the module's tensors before save() when this is True (so views do not drag their
        # flat buffers into the file); a captured save copies every tensor compactly anyway
        return self._captured is None and self.inner.preserves_storage_sharing()

    def is_decoupled(self):
        return False

    def capture(self):
        """Context: the ``save`` calls inside it are host copies; ``.files`` afterwards: ``[(path, copy)]``."""
        return _Capture(self)


class _Capture:
    def __init__(self, ce: DsclipCheckpointEngine):
        self.ce, self.files = ce, []

    def __enter__(self):
        self.ce._captured = self.files
        return self

    def __exit__(self, *exc):
        self.ce._captured = None
        sync_copies()
        return False


@dataclass
class BackgroundWrite:
    """One rank's files of one save, written by one thread (``write_file(obj, path)`` each), then checksummed
    relative to ``tag_dir`` for the manifest. The thread never touches the process group; :meth:`wait` joins
    it. ``error``: what the write raised (the caller tells a full disk from other failures)."""

    files: list[tuple[str, object]]
    tag_dir: Path
    write_file: object
    times: SaveTimes
    written: list[str] = field(default_factory=list)
    sums: dict = field(default_factory=dict)
    error: BaseException | None = None

    def __post_init__(self):
        self.times.bytes = sum(nbytes(obj) for _, obj in self.files)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dsclip-save-{self.times.tag}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self.error is not None:  # the capture already failed (a full disk while DeepSpeed made its folders)
            self.files.clear()
            self._done.set()
            return
        try:
            while self.files:
                path, obj = self.files.pop(0)  # the host copy is freed as soon as its file is written
                self.write_file(obj, path)
                del obj
                self.written.append(path)
            self.sums = manifest.entries(self.tag_dir, self.written)
        except BaseException as e:  # handed to the main thread, which decides collectively what happens
            self.error = e
            self.files.clear()
        finally:
            self.times.write_s = time.perf_counter() - t0
            self._done.set()

    @property
    def busy(self) -> bool:
        return not self._done.is_set()

    def wait(self) -> float:
        """Block until the write is done; the seconds waited."""
        t0 = time.perf_counter()
        self._done.wait()
        self._thread.join()
        return time.perf_counter() - t0


def install_checkpoint_engine(engine, checkpointer, precision: str, world_size: int) -> None:
    """dsclip's checkpoint engine on ``engine`` (every load data-only, saves capturable), and with
    --async-save the host memory its copy needs checked on every node (collective)."""
    DsclipCheckpointEngine.install(engine)
    if checkpointer.async_save:
        check_host_memory(engine, precision, world_size, rank=checkpointer.rank, ema="ema" in checkpointer.rank_state)


def _available_bytes() -> int | None:
    """MemAvailable of this node (Linux), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(engine, precision: str, world_size: int, *, rank: int, ema: bool) -> None:
    """Before the first step: the copies every rank of each node makes at a save (the planner's
    ``checkpoint_copy_bytes``, as ``dsclip plan`` counts it against --host-memory) fit the node's available
    memory; else one ConfigError line on every rank naming both and the fix (collective)."""
    import socket

    from dsclip.config_base import ConfigError
    from dsclip.dist import all_ranks
    from dsclip.plan.memory import checkpoint_copy_bytes

    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    need = checkpoint_copy_bytes(params, world_size, precision, ema=ema, writer=rank == 0)
    reports = all_ranks((socket.gethostname(), need, _available_bytes()))
    host = reports[rank][0]
    on_node = [(n, a) for h, n, a in reports if h == host]
    total, available = sum(n for n, _ in on_node), on_node[0][1]
    if available is not None and total > available:
        raise ConfigError(
            f"--async-save copies each rank's checkpoint state to host memory: {total / 2**30:.1f} GiB on {host} "
            f"({len(on_node)} ranks) but {available / 2**30:.1f} GiB is available there; train with "
            "--no-async-save (saves then stall for the whole write) or free host memory"
        )
