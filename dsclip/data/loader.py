"""TrainData: the one object the training loop pulls batches from, and its map-style implementation.

Contract (shared by every dataset type):
- ``batches(epoch, start_step=0)`` yields ``(images (B,3,H,W) float, tokens (B,L) long)``, exactly
  ``batch_size`` rows, ``steps_per_epoch - start_step`` times, on every rank: no rank can run out
  early and leave the others hanging in a collective.
- Deterministic per (seed, epoch): resuming at ``start_step`` yields exactly the batches an
  uninterrupted run would have seen from that step on.
- ``stats()`` returns cumulative bad-data counters (skipped samples by reason) for logging.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ..launch.supervise import worker_ignores_stop_signals
from .device_transform import SideStream
from .tokenizer import TRUNCATED, tokenize_counting

log = logging.getLogger(__name__)


def mix_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (seed, epoch, index, ...)."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFF for p in parts])
        .generate_state(2, np.uint32)
        .astype(np.uint64)
        .dot(np.array([1 << 31, 1], dtype=np.uint64))
        & ((1 << 63) - 1)
    )


class TrainData:
    """Base class; subclasses set ``num_samples``, ``steps_per_epoch``, ``batch_size`` and ``_open``.

    ``_open(epoch, start_step)`` returns one stream of ``(images, tokens, stats)`` that runs on past the
    end of ``epoch`` into the following epochs without a break. ``batches`` reads each epoch from that
    one stream, so the workers produce the next epoch's first batches while the current one ends
    (and while evaluation and checkpointing run at the boundary) instead of restarting cold: no
    epoch-boundary stall. The content of every step is unchanged, because it depends only on
    (seed, epoch, step); a request for any other position reopens the stream there.
    """

    num_samples: int  # samples per epoch, all ranks together (= steps_per_epoch * batch_size * world_size)
    steps_per_epoch: int  # micro-batches per epoch on each rank (an optimizer step takes accum_freq of them)
    batch_size: int
    # A requested position at most this many batches ahead of the open stream is reached by reading
    # (the loop leaves steps_per_epoch % accum_freq batches of an epoch unused); further: reopen.
    max_skip = 16
    # uint8 inputs: a DevicePrep (dsclip.data.device_transform), encoded ones a GpuDecodePrep
    # (dsclip.data.gpu_decode), run in the training process; None: floats
    device_prep = None

    def __init__(self) -> None:
        self._stats: Counter = Counter()
        self._stream: Iterator | None = None
        self._pos: tuple[int, int] | None = None  # (epoch, step) of the stream's next batch
        self._unread: list = []  # raw items read ahead and given back: read before the stream

    def batches(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if not 0 <= start_step <= self.steps_per_epoch:
            raise ValueError(f"start_step {start_step} outside [0, {self.steps_per_epoch}]")
        return self._epoch(epoch, start_step)

    def _epoch(self, epoch: int, start_step: int):
        want = self.steps_per_epoch - start_step
        if want == 0:
            return
        self._seek(epoch, start_step)
        prep = self.device_prep
        if prep is None:  # float batches: the step moves them
            for n in range(want):
                images, tokens, stats = self._read(n, want)
                if stats:
                    self._stats.update(stats)
                yield images, tokens
            return
        # uint8 or encoded batches are prepared on the device one batch ahead, on a side stream, so
        # batch n+1's copy (and decode, on the GPU path) runs while the step trains on batch n. On CUDA
        # the read-ahead runs in a thread: its host work (reading the loader, nvJPEG's host side, one
        # resize call per sample) then overlaps the step, which waits on the GPU with the GIL released.
        side = SideStream(prep.device)
        pool = None
        if side.stream is not None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="dsclip-prep", initializer=side.bind_thread)

        def start(n: int) -> Future:  # -> (raw item, prepared batch, stream position after it)
            if pool is not None:
                return pool.submit(self._read_prepared, n, want, prep, side)
            done: Future = Future()
            done.set_result(self._read_prepared(n, want, prep, side))
            return done

        ahead: Future | None = None
        try:
            for n in range(want):
                if ahead is None:
                    ahead = start(n)
                (raw, (images, tokens, counts), _), ahead = ahead.result(), None
                side.hand_over(images)  # before n+1 is queued: the step waits for n only
                if n + 1 < want:
                    ahead = start(n + 1)
                self._stats.update(raw[2] or {})  # counted when the batch is handed out, not when read
                self._stats.update(counts)
                yield images, tokens
        finally:
            if ahead is not None:
                try:
                    got = ahead.result()
                except Exception:  # the consumer is leaving anyway; a failed read-ahead reopens later
                    got = None
                if got is not None and got[2] == (self._stream, self._pos):
                    # the consumer stopped early (epoch end with accum_freq, a stop): the read-ahead
                    # batch goes back unread, so the stream's position stays the consumer's
                    self._unread.append(got[0])
                    self._retreat()
            if pool is not None:
                pool.shutdown(wait=True)

    def _read(self, n: int, want: int):
        item = self._unread.pop() if self._unread else next(self._stream, None)
        if item is None:  # would desynchronize ranks: fail loudly instead
            self._stream = self._pos = None
            raise RuntimeError(f"data produced {n} batches, expected {want}")
        self._advance()
        return item

    def _read_prepared(self, n: int, want: int, prep, side):
        raw = self._read(n, want)
        with side.context():
            ready = prep.prepare(raw[0], raw[1])  # -> (images, tokens, counts)
        return raw, ready, (self._stream, self._pos)

    def _advance(self) -> None:
        e, s = self._pos
        self._pos = (e + 1, 0) if s + 1 == self.steps_per_epoch else (e, s + 1)

    def _retreat(self) -> None:
        e, s = self._pos
        self._pos = (e - 1, self.steps_per_epoch - 1) if s == 0 else (e, s - 1)

    def _seek(self, epoch: int, start_step: int) -> None:
        if self._pos is not None:
            ahead = (epoch - self._pos[0]) * self.steps_per_epoch + start_step - self._pos[1]
            if 0 <= ahead <= self.max_skip:
                for _ in range(ahead):  # read and drop: cheaper than restarting the workers cold
                    if (self._unread.pop() if self._unread else next(self._stream, None)) is None:
                        break
                    self._advance()
                else:
                    return
        self._stream, self._pos = self._open(epoch, start_step), (epoch, start_step)
        self._unread = []

    def _open(self, epoch: int, start_step: int) -> Iterator:
        raise NotImplementedError

    def set_device(self, device, dtype=torch.float32) -> None:
        """Where (and in which dtype) uint8 batches are normalised, and encoded ones decoded: the step's
        device. Float inputs ignore it (the step moves them)."""
        if self.device_prep is not None:
            self.device_prep.device, self.device_prep.dtype = device, dtype

    def stats(self) -> dict[str, int]:
        """Cumulative bad-data counters of this rank, e.g. {"skipped_corrupt_image": 3}; empty when clean."""
        return dict(self._stats)

    def close(self) -> None:
        self._stream = self._pos = None
        self._unread = []


class EpochBatchSampler(Sampler):
    """Per-epoch permutation split across ranks: rank r's step k = perm[(k*world + r)*B : +B].

    Only full global batches are used (drop_last), so every rank gets ``steps`` batches of B per epoch.
    Yields lists of ``(epoch, index)`` keys so a dataset can seed its augmentations per sample.
    Iteration starts at ``set_epoch(epoch, start_step)`` and runs on through the following epochs
    (each with its own permutation), so the DataLoader keeps prefetching across epoch boundaries.
    The sampler is iterated in the main process, also with persistent workers.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int, seed: int):
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.steps = num_samples // (batch_size * world_size)
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.epoch, self.start_step = int(epoch), int(start_step)

    def __iter__(self):
        epoch, start = self.epoch, self.start_step
        b, w = self.batch_size, self.world_size
        while True:
            g = torch.Generator()
            g.manual_seed(mix_seed(self.seed, epoch, 0x5A17))
            perm = torch.randperm(self.num_samples, generator=g)
            for step in range(start, self.steps):
                base = (step * w + self.rank) * b
                yield [(epoch, int(i)) for i in perm[base : base + b]]
            epoch, start = epoch + 1, 0


class TokenizingCollate:
    """Runs in the worker: stack images, tokenize captions, sum per-sample bad-data counts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, samples):
        images = torch.stack([s[0] for s in samples])
        tokens, cut = tokenize_counting(self.tokenizer, [s[1] for s in samples])
        stats: Counter = Counter({TRUNCATED: cut} if cut else {})
        for s in samples:
            if len(s) > 2 and s[2]:
                stats.update(s[2])
        return images, tokens, dict(stats)


class _KeyedDataset(Dataset):
    """Adapts an index dataset to the sampler's (epoch, index) keys."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, index = key
        getter = getattr(self.dataset, "get_sample", None)
        return getter(index, epoch) if getter is not None else self.dataset[index]


class MapStyleTrainData(TrainData):
    """Any map-style dataset (demo, CSV) through a DataLoader with persistent workers."""

    def __init__(
        self,
        dataset,
        *,
        tokenizer,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        workers: int = 1,
        pin_memory: bool | None = None,
        name: str = "dataset",
    ):
        super().__init__()
        n = len(dataset)
        if n < batch_size * world_size:
            raise ValueError(
                f"{name} has {n} samples, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size} = {batch_size * world_size})"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = EpochBatchSampler(n, batch_size, rank, world_size, seed)
        self.steps_per_epoch = self.sampler.steps
        self.num_samples = self.steps_per_epoch * batch_size * world_size
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        kw = dict(persistent_workers=True, prefetch_factor=4) if workers > 0 else {}
        self.loader = signal_safe_loader(
            _KeyedDataset(dataset),
            batch_sampler=self.sampler,
            num_workers=workers,
            collate_fn=TokenizingCollate(tokenizer),
            pin_memory=pin_memory,
            **kw,
        )

    def _open(self, epoch: int, start_step: int):
        self.sampler.set_epoch(epoch, start_step)
        return iter(self.loader)  # persistent workers: a new iterator reuses them

    def close(self) -> None:
        super().close()
        shutdown_loader(self.loader)


def shutdown_loader(loader: DataLoader) -> None:
    """Stop a DataLoader's (persistent) worker processes now rather than at garbage collection."""
    it = getattr(loader, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
    loader._iterator = None


# Every loader whose workers ignore the stop signals. Python's exit handler (multiprocessing.util._exit_function)
# SIGTERMs each live worker and then joins it with no timeout: a worker that ignores SIGTERM and was never shut
# down makes the process hang forever after its last line. The owner of a loader closes it (the run's ExitStack,
# dsclip.train.loop); this set is the last line of defence and says when an owner forgot.
_signal_safe_loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()


def signal_safe_loader(dataset, **kwargs) -> DataLoader:
    """A DataLoader whose workers ignore SIGTERM/SIGUSR1 (a group signal must not kill them under the rank:
    dsclip.launch.supervise.worker_ignores_stop_signals). Its owner must close it (:func:`shutdown_loader`)."""
    loader = DataLoader(dataset, worker_init_fn=worker_ignores_stop_signals, **kwargs)
    _signal_safe_loaders.add(loader)
    return loader


def leftover_workers() -> int:
    """How many loaders still have worker processes running."""
    return sum(1 for dl in list(_signal_safe_loaders) if getattr(dl, "_iterator", None) is not None and dl.num_workers)


def _close_leftover_loaders() -> None:
    """At interpreter exit, before multiprocessing's handler (atexit runs last-registered first, and torch
    imported multiprocessing before this module): shut down what an owner left open, and say so."""
    if n := leftover_workers():
        log.warning("dsclip: %d data loader(s) still had workers at exit (an owner did not close them): closed now", n)
    for dl in list(_signal_safe_loaders):
        shutdown_loader(dl)


atexit.register(_close_leftover_loaders)
