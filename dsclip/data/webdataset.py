"""Webdataset streaming input: deterministic, rank/worker split, exact batch counts, bad-data tolerant.

How a rank's epoch is produced
------------------------------
* ``steps_per_epoch = train_num_samples // (batch_size * world_size)``: the same on every rank.
* The rank's steps are dealt round-robin to W = max(1, workers) *logical workers*: logical worker L
  makes steps L, L+W, L+2W, ... and yields exactly that many batches, each of exactly
  ``batch_size`` samples. The DataLoader fetches round-robin from its workers, so it returns the
  steps in order and stops after exactly ``steps_per_epoch`` batches on every rank — a rank whose
  shards hold fewer samples repeats its data (a new shuffled pass) instead of ending early and
  leaving the other ranks hanging in a collective.
* Sharding: the R*W (rank, logical worker) slots split the shard list (after a per-epoch shuffle
  shared by all ranks): slot g reads shards g, g+R*W, ...; with fewer shards than slots, every slot
  reads all shards and keeps every (R*W)-th sample instead. Without resampling, an epoch whose
  train_num_samples equals the data size sees every sample once when the shards divide evenly.
  With ``dataset_resampled``, each slot draws shards with replacement (weighted by the upsampling
  factors), as OpenCLIP.
* Shuffling: a per-slot sample shuffle buffer over *references* (shard, sample number); every random
  choice comes from (seed, epoch, rank, slot), and the augmentation of step k from (seed, epoch, rank, k).
  A sample's bytes are read (one ``pread``, dsclip.data.tar_index) only when its batch is made.
* Decoding happens after batching, in the worker: a sample whose image fails to decode is replaced
  by another good sample of the same batch (and counted), so batch composition never depends on
  decoding. Which samples exist and which are bad rows (no image, no caption, a non-UTF-8 caption)
  comes from each shard's index (its header: counts and bad rows, read once by the main process).
  So ``batches(epoch, start_step)`` replays the shard order, the split and the shuffle up to the
  resume point on references alone (~2 us of CPU per skipped sample, no I/O) and then reads what a
  fresh start reads: the samples of its first batches. Remote and compressed shards have no index:
  they are streamed, and a resume re-reads them up to its position.
* Determinism holds for a fixed (seed, world_size, batch_size, workers, shard list).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import random
from collections import deque
from collections.abc import Iterator
from itertools import islice

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..launch.supervise import worker_ignores_stop_signals
from .device_transform import DevicePrep
from .fast_transforms import fast_train_transform
from .gpu_decode import CPU_DECODED, EncodedTrainTransform, GpuDecodePrep, cpu_decoded_count
from .loader import TrainData, mix_seed, shutdown_loader
from .sample_keys import DEFAULT_KEYS, SampleKeys
from .shards import (
    NO_LIMITS,
    BadData,
    ImageLimits,
    ShardError,
    check_first_shard,
    check_sample,
    dataset_size,
    decode_image,
    is_remote,
    iter_tar,
)
from .shards import parse_sources as parse_sources
from .tar_index import SampleReader, ShardIndex, find_indexes, load_or_build
from .tokenizer import TRUNCATED, tokenize_counting
from .transforms import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, image_transform, per_channel, seeded_rngs

log = logging.getLogger("dsclip.data")
_UNKNOWN = "unknown"  # a shard whose index is not loaded yet


class _ShuffleBuffer:
    """Deterministic sample shuffle buffer, webdataset's algorithm: while filling, read two samples per
    output; start emitting once ``initial`` are buffered; emit a uniformly random buffered sample."""

    def __init__(self, size: int, rng: random.Random, initial: int | None = None):
        self.size, self.rng = size, rng
        self.initial = min(size, initial if initial is not None else max(1, size // 5))

    def _pop(self, buf: list) -> dict:
        i = self.rng.randrange(len(buf))
        buf[i], buf[-1] = buf[-1], buf[i]
        return buf.pop()

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        if self.size <= 1:
            yield from samples
            return
        it = iter(samples)
        buf: list[dict] = []
        for s in it:
            buf.append(s)
            if len(buf) < self.size:
                nxt = next(it, None)
                if nxt is not None:
                    buf.append(nxt)
            if len(buf) >= self.initial:
                yield self._pop(buf)
        while buf:
            yield self._pop(buf)


class WdsBatches(IterableDataset):
    """Yields this rank's batches ``(images, tokens, bad_data_counts)`` for the epoch in ``self.state``.

    ``state`` is shared memory (epoch, start_step) so persistent workers see the new epoch.
    """

    def __init__(
        self,
        sources,
        *,
        tokenizer,
        transform,
        batch_size,
        rank,
        world_size,
        seed,
        workers,
        steps_per_epoch,
        resampled,
        shuffle_buffer,
        image_limits: ImageLimits = NO_LIMITS,
        keys: SampleKeys = DEFAULT_KEYS,
    ):
        super().__init__()
        self.image_limits = image_limits
        self.keys = keys  # member suffix -> image / caption (dsclip.data.sample_keys)
        self.urls = [u for urls, _ in sources for u in urls]
        self.weights = [w for urls, w in sources for _ in urls]
        # per shard: its index's header (read here, so a changed shard stops the run before it starts), None
        # for a streamed (remote) shard, _UNKNOWN where the index is missing: the worker reaching it builds it
        found = find_indexes(self.urls, self.keys)
        self.indexes = [None if is_remote(u) else idx or _UNKNOWN for u, idx in zip(self.urls, found)]
        self.tokenizer, self.transform = tokenizer, transform
        self._takes_bytes = getattr(transform, "takes_bytes", False)
        self._collate = getattr(transform, "collate", torch.stack)  # the GPU path ships encoded batches
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.num_slots = max(1, workers)
        self.steps_per_epoch, self.resampled, self.shuffle_buffer = steps_per_epoch, resampled, shuffle_buffer
        self.state = mp.Array("q", [0, 0])  # epoch, start_step

    # -- sample stream of one (rank, logical worker) slot, as references: read only when batched ------
    def _shard_index(self, n: int) -> ShardIndex | None:
        """Shard n's index (its header read by the main process, or built here when missing); None: streamed."""
        idx = self.indexes[n]
        if idx is _UNKNOWN:
            idx = self.indexes[n] = load_or_build(self.urls[n], self.keys)
        return idx

    def _shard_refs(self, n: int, bad: BadData) -> Iterator:
        """Shard n's valid samples in file order, as (n, sample number); its bad samples are counted as the
        stream passes them, as :func:`iter_tar` + :func:`check_sample` do. A streamed shard yields the samples."""
        url, idx = self.urls[n], self._shard_index(n)
        if idx is None:
            yield from (s for s in iter_tar(url, bad) if check_sample(s, bad, self.keys))
            return
        for i in range(idx.samples):
            problem = idx.bad.get(i) if idx.bad else None
            if problem is None:
                yield n, i
            else:
                bad.add(problem[0], f"{url}:{problem[1]}")
        if idx.end is not None:
            bad.add(idx.end[0], url + idx.end[1])

    def _raw_stream(self, epoch: int, slot: int, bad: BadData) -> Iterator:
        """Infinite stream of valid sample references, shuffled; passes are shuffled separately so the first
        pass (the whole epoch when the data suffices) holds exactly this slot's share. Every decision here is
        made on references, so skipping to a resume point reads no shard bytes."""
        total_slots = self.world_size * self.num_slots
        g = self.rank * self.num_slots + slot  # global slot id
        rng = random.Random(mix_seed(self.seed, epoch, self.rank, slot, 0xD5))
        shuffle = _ShuffleBuffer(self.shuffle_buffer, random.Random(mix_seed(self.seed, epoch, self.rank, slot, 0xB0F)))
        shard_numbers = range(len(self.urls))
        if self.resampled:

            def resampled():
                while True:  # shards drawn with replacement
                    (n,) = rng.choices(shard_numbers, weights=self.weights)
                    yield from self._shard_refs(n, bad)

            yield from shuffle(resampled())
            return

        def one_pass(order):
            if len(order) >= total_slots:
                for n in order[g::total_slots]:
                    yield from self._shard_refs(n, bad)
            else:  # fewer shards than slots: split by sample position instead
                i = 0
                for n in order:
                    for s in self._shard_refs(n, bad):
                        if i % total_slots == g:
                            yield s
                        i += 1

        n_pass = 0
        while True:  # more than one pass only if this slot's share runs short of its steps
            order = list(shard_numbers)
            random.Random(mix_seed(self.seed, epoch, n_pass, 0x5EED)).shuffle(order)  # same on all ranks
            got = 0
            for s in shuffle(one_pass(order)):
                got += 1
                yield s
            if got == 0:
                raise RuntimeError(f"no valid samples in the shards of rank {self.rank} slot {slot}")
            n_pass += 1

    def _read(self, refs: list, reader: SampleReader) -> list[dict]:
        """The samples references name (a streamed shard's sample is its own reference)."""
        indexed = [(self.indexes[r[0]], r[1]) for r in refs if not isinstance(r, dict)]
        read = iter(reader.read_many(indexed))
        return [r if isinstance(r, dict) else next(read) for r in refs]

    def _decode_batch(self, raw: list[dict], epoch: int, step: int, bad: BadData):
        images, captions, bad_idx = [], [], []
        rng = random.Random(mix_seed(self.seed, epoch, self.rank, step, 0xCA9))
        with seeded_rngs(mix_seed(self.seed, epoch, self.rank, step, 0xA06)):  # never disturb the process's RNGs
            for j, s in enumerate(raw):
                try:
                    data = self.keys.image(s)  # the fast transform decodes the bytes itself (draft, crop first)
                    problem = self.image_limits.check(data)  # the header only: before any pixel is decoded
                    if problem is None:
                        images.append(self.transform(data if self._takes_bytes else decode_image(data)))
                        if cpu_decoded_count(images[-1]):  # the GPU path's worker decoded it: not for nvJPEG
                            bad.counts[CPU_DECODED] += 1
                except Exception as e:  # PIL raises many types for corrupt data
                    problem = "corrupt_image", f"{e.__class__.__name__}: {e}"
                if problem is not None:
                    bad.add(problem[0], f"{s['__url__']}:{s['__key__']} ({problem[1]})")
                    images.append(None)
                    bad_idx.append(j)
                caps = self.keys.captions(s)
                captions.append(caps[rng.randrange(len(caps))] if len(caps) > 1 else caps[0])
        good = [j for j in range(len(raw)) if images[j] is not None]
        if not good:
            return None
        for j in bad_idx:  # keep B rows and the batch composition: reuse a good sample of this batch
            k = good[rng.randrange(len(good))]
            images[j], captions[j] = images[k], captions[k]
        tokens, cut = tokenize_counting(self.tokenizer, captions)
        bad.counts[TRUNCATED] += cut  # counted, not warned per sample: the trainer warns once on the share
        return self._collate(images), tokens

    def _epoch_batches(self, epoch: int, slot: int, start: int, bad: BadData, reader: SampleReader):
        """Logical slot ``slot``'s batches of ``epoch`` from step ``start`` on (steps slot, slot+W, ...)."""
        steps = [k for k in range(start, self.steps_per_epoch) if k % self.num_slots == slot]
        if not steps:
            return
        n_skip = len(range(slot, min(start, self.steps_per_epoch), self.num_slots))  # its steps before start
        stream = self._raw_stream(epoch, slot, bad)
        B = self.batch_size
        deque(islice(stream, n_skip * B), maxlen=0)  # resume: skip references, nothing read or decoded
        bad.take()  # problems met while skipping were counted by the original run
        for step in steps:
            out = None
            while out is None:  # None only if all B images are corrupt: then take the next B samples
                out = self._decode_batch(self._read([next(stream) for _ in range(B)], reader), epoch, step, bad)
            yield out[0], out[1], bad.take()

    def __iter__(self):
        """From (epoch, start_step) in ``state`` on, through the following epochs without end.

        The DataLoader takes item n from worker n % W. Item n is step s of epoch e where
        n = offset_e + s, offset_e = (e - epoch0)·steps_per_epoch - start_step; so in epoch e worker w
        serves logical slot (w - offset_e) % W, and fetch order = step order across epoch boundaries.
        """
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None and info.num_workers != self.num_slots:
            raise RuntimeError(f"expected {self.num_slots} workers, got {info.num_workers}")
        epoch, start = int(self.state[0]), int(self.state[1])
        offset = -start
        bad = BadData()
        reader = SampleReader()
        try:
            while True:
                yield from self._epoch_batches(epoch, (worker - offset) % self.num_slots, start, bad, reader)
                epoch, start, offset = epoch + 1, 0, offset + self.steps_per_epoch
        finally:
            reader.close()


class WdsTrainData(TrainData):
    def __init__(self, dataset: WdsBatches, loader: DataLoader, num_samples: int):
        super().__init__()
        self.dataset, self.loader = dataset, loader
        self.batch_size = dataset.batch_size
        self.steps_per_epoch = dataset.steps_per_epoch
        self.num_samples = num_samples

    def _open(self, epoch: int, start_step: int):
        self.dataset.state[0], self.dataset.state[1] = epoch, start_step
        return iter(self.loader)  # persistent workers read the new state when the iterator resets them

    def close(self) -> None:
        super().close()
        shutdown_loader(self.loader)


def build_wds_train_data(data_cfg, *, tokenizer, image_size, batch_size, rank, world_size, seed) -> WdsTrainData:
    """Streaming training input from webdataset shards (see the module docstring)."""
    if data_cfg.train_data_upsampling_factors and not data_cfg.dataset_resampled:
        raise ShardError("--train-data-upsampling-factors needs --dataset-resampled")
    sources = parse_sources(data_cfg.train_data, data_cfg.train_data_upsampling_factors)
    all_urls = [u for urls, _ in sources for u in urls]
    num = data_cfg.train_num_samples or dataset_size(all_urls)
    if not num:
        raise ShardError("--train-num-samples is required for webdataset input (no complete sizes.json found)")
    steps = num // (batch_size * world_size)
    if steps < 1:
        raise ShardError(f"train_num_samples {num} < one global batch ({batch_size} x {world_size})")
    keys = data_cfg.sample_keys()
    first = find_indexes(all_urls[:1], keys)[0] if all_urls else None
    if first is None or first.samples == len(first.bad):  # an index under these keys with a good sample: they match
        check_first_shard(all_urls, keys)  # one line now, not "no valid samples" after reading every shard
    workers = max(0, data_cfg.workers)
    n_slots = max(1, workers) * world_size
    if not data_cfg.dataset_resampled and len(all_urls) < n_slots:
        log.info(
            "%d shards < %d (rank, worker) slots: splitting by sample instead of by shard",
            len(all_urls),
            n_slots,
        )
    transform = train_transform(data_cfg, image_size)
    ds = WdsBatches(
        sources,
        tokenizer=tokenizer,
        transform=transform,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        workers=workers,
        steps_per_epoch=steps,
        resampled=data_cfg.dataset_resampled,
        shuffle_buffer=data_cfg.shuffle_buffer,
        image_limits=data_cfg.image_limits(),
        keys=keys,
    )
    kw = dict(persistent_workers=True, prefetch_factor=2) if workers > 0 else {}
    # the workers ignore stop signals: one sent to the whole process group must not kill them under the rank
    kw["worker_init_fn"] = worker_ignores_stop_signals
    loader = DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=torch.cuda.is_available(), **kw)
    data = WdsTrainData(ds, loader, steps * batch_size * world_size)
    mean = per_channel(data_cfg.image_mean, OPENAI_DATASET_MEAN)
    std = per_channel(data_cfg.image_std, OPENAI_DATASET_STD)
    if isinstance(transform, EncodedTrainTransform):  # encoded JPEGs: decoded and cropped on the device
        data.device_prep = GpuDecodePrep(transform.size, mean, std)
    elif getattr(transform, "takes_bytes", False):  # uint8 batches: normalised in the training process
        data.device_prep = DevicePrep(mean, std)
    return data


def decode_mode(data_cfg) -> str:
    """``--data-decode`` resolved: ``auto`` is ``gpu`` where CUDA is present, else ``cpu``."""
    mode = getattr(data_cfg, "data_decode", "pil")
    if mode == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return mode


def train_transform(data_cfg, image_size):
    """``--data-decode``: ``pil`` is the float PIL path (image_transform); ``cpu`` the uint8 fast path and
    ``gpu`` the encoded-bytes path (dsclip.data.gpu_decode), where the augmentation allows them."""
    mode = decode_mode(data_cfg)
    fast = fast_train_transform(image_size, data_cfg.aug_cfg) if mode != "pil" else None
    if fast is None:
        if mode != "pil":
            log.info("--aug-cfg needs the PIL transform (use_timm / color jitter / grayscale): --data-decode pil")
        return image_transform(image_size, is_train=True, **data_cfg.preprocess_args())
    if mode == "gpu":
        return EncodedTrainTransform(fast.size, fast.scale, fast.ratio)
    return fast
