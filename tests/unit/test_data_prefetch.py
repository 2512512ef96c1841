"""One data stream across epochs (no epoch-boundary stall) without changing what any step sees.

For the demo, CSV and webdataset inputs: reading epochs back to back from one TrainData opens its
stream once (the workers were already producing the next epoch's first batches while the previous
one ended), and every batch equals the one a freshly built TrainData gives for that (epoch, step),
which is what a resumed run reads. ``webdataset-gpu`` is the GPU input path (``--data-decode gpu``:
encoded JPEGs decoded and cropped in the training process, read one batch ahead) run on CPU, the
device being CPU until ``set_device`` (build_train_data does not ask for CUDA): a fresh TrainData
started mid-epoch -- a run resumed after a kill -- gets the very crops the first one got.
"""

from __future__ import annotations

import pytest
import torch

from dsclip.data import DataConfig, build_tokenizer, build_train_data
from tests.unit.test_data_csv import _table
from tests.unit.test_data_wds import IdTokenizer, make_shards


@pytest.fixture(scope="module")
def demo_tok(tmp_path_factory):
    return build_tokenizer(DataConfig(), 24, tmp_path_factory.mktemp("c"))


def _builder(kind, tmp_path, workers, demo_tok):
    """A function returning a fresh TrainData of ``kind`` with an odd number of steps per epoch, so
    epoch boundaries fall in the middle of the workers' round-robin."""
    if kind == "demo":
        cfg = DataConfig(dataset_type="demo", demo_num_samples=40, workers=workers)
        kw = dict(tokenizer=demo_tok, image_size=32, batch_size=8)
    elif kind == "csv":
        cfg = DataConfig(train_data=_table(tmp_path, n=21, bad={4}), workers=workers)
        kw = dict(tokenizer=IdTokenizer(), image_size=16, batch_size=4)
    else:
        pattern = make_shards(tmp_path / "d", 4, 10)  # jpg, png and webp: the GPU path's both kinds of row
        decode = "gpu" if kind == "webdataset-gpu" else "auto"  # auto: the CPU path on this machine
        cfg = DataConfig(train_data=pattern, workers=workers, shuffle_buffer=8, data_decode=decode)
        kw = dict(tokenizer=IdTokenizer(), image_size=16, batch_size=7)
    return lambda: build_train_data(cfg, rank=0, world_size=1, seed=5, **kw)


def _read(td, epoch, start=0, stop=None):
    out = []
    for n, (images, tokens) in enumerate(td.batches(epoch, start)):
        out.append((images.clone(), tokens.clone()))
        if stop is not None and n + 1 == stop:
            break  # the loop leaves an epoch early (steps_per_epoch % accum_freq, preemption)
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["demo", "csv", "webdataset", "webdataset-gpu"])
def test_one_stream_across_epochs_same_batches(kind, workers, tmp_path, demo_tok):
    build = _builder(kind, tmp_path, workers, demo_tok)
    td = build()
    steps = td.steps_per_epoch
    assert steps % 2 == 1, steps
    opens = []
    real_open = td._open

    def counting_open(epoch, start):
        opens.append((epoch, start))
        return real_open(epoch, start)

    td._open = counting_open
    fresh = []
    try:
        got = [_read(td, 0)]
        if workers:  # the next epoch's first batches were requested from the workers before it began
            assert td._stream._send_idx > steps
        got.append(_read(td, 1, stop=steps - 1))  # one batch of epoch 1 left unread...
        got.append(_read(td, 2))  # ...is skipped over, not a reason to restart
        got.append(_read(td, 4, start=2))  # a short jump ahead is read over too
        got.append(_read(td, 1, start=2))  # a jump backwards (or far ahead) reopens at that position
        assert opens == [(0, 0), (1, 2)], opens
        for epoch, start, n in ((0, 0, None), (1, 0, steps - 1), (2, 0, None), (4, 2, None), (1, 2, None)):
            ref = build()  # what a run started (or resumed) at this position reads
            fresh.append(ref)
            assert _same(_read(ref, epoch, start, stop=n), got.pop(0)), (epoch, start)
        assert len(_read(td, 3, start=steps)) == 0
    finally:
        for t in [td, *fresh]:
            t.close()
