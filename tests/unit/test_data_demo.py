import ast
import pathlib

import numpy as np
import pytest
import torch

from dsclip.data import DataConfig, build_tokenizer, build_train_data
from dsclip.data.demo import SHAPES, DemoDataset, demo_zeroshot_classes, demo_zeroshot_templates
from dsclip.data.transforms import image_transform


def test_deterministic_and_distinct():
    a, b = DemoDataset(100, 32, seed=0), DemoDataset(100, 32, seed=0)
    img, cap = a[7]
    assert img.shape == (3, 32, 32) and img.dtype == torch.float32 and isinstance(cap, str)
    assert torch.equal(img, b[7][0]) and cap == b[7][1]
    assert not torch.equal(a[7][0], a[8][0])
    h = DemoDataset.heldout(100, 32)
    assert not torch.equal(h[7][0], a[7][0])
    for i in range(20):
        at = a.attributes(i)
        assert at["shape"] in a.caption(i)


def test_image_size_and_classes():
    ds = DemoDataset(10, image_size=48)
    assert ds[0][0].shape == (3, 48, 48)
    assert ds.render(0).dtype == np.uint8
    assert demo_zeroshot_classes() == list(SHAPES)
    assert all("{c}" in t for t in demo_zeroshot_templates())
    assert len(demo_zeroshot_classes("color_shape")) == len(SHAPES) * 8
    labels = [ds.label(i) for i in range(10)]
    assert all(0 <= x < len(SHAPES) for x in labels)


def test_transforms():
    from PIL import Image

    img = Image.fromarray(DemoDataset(1, 64).render(0))
    assert image_transform(32, True)(img).shape == (3, 32, 32)
    assert image_transform(32, False)(Image.new("RGBA", (80, 40))).shape == (3, 32, 32)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(DataConfig(), 24, tmp_path_factory.mktemp("c"))


def _collect(td, epoch, start=0):
    return [(i.clone(), t.clone()) for i, t in td.batches(epoch, start)]


def test_train_data_ranks_resume(tok):
    cfg = DataConfig(dataset_type="demo", demo_num_samples=70, workers=0)
    tds = [
        build_train_data(cfg, tokenizer=tok, image_size=32, batch_size=8, rank=r, world_size=2, seed=3)
        for r in range(2)
    ]
    assert tds[0].steps_per_epoch == tds[1].steps_per_epoch == 70 // 16
    assert tds[0].num_samples == 64
    e0 = [_collect(td, 0) for td in tds]
    for batches in e0:
        assert len(batches) == 4 and all(i.shape == (8, 3, 32, 32) and t.shape == (8, 24) for i, t in batches)
    # ranks disjoint within the epoch
    flat = [x.numpy().tobytes() for batches in e0 for images, _ in batches for x in images]
    assert len(flat) == 64 and len(set(flat)) == 64
    # deterministic, epoch-dependent, resumable
    again = _collect(tds[1], 0)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(e0[1], again))
    e1 = _collect(tds[1], 1)
    assert not torch.equal(e1[0][0], e0[1][0][0])
    resumed = _collect(tds[1], 1, start=2)
    assert len(resumed) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(resumed, e1[2:]))
    assert tds[0].stats() == {}


def test_train_data_workers_match_main_process(tok):
    base = dict(dataset_type="demo", demo_num_samples=48)
    a = build_train_data(
        DataConfig(**base, workers=0),
        tokenizer=tok,
        image_size=32,
        batch_size=8,
        rank=0,
        world_size=1,
        seed=1,
    )
    b = build_train_data(
        DataConfig(**base, workers=2),
        tokenizer=tok,
        image_size=32,
        batch_size=8,
        rank=0,
        world_size=1,
        seed=1,
    )
    try:
        for epoch in (0, 1):  # second epoch reuses the persistent workers
            x, y = _collect(a, epoch), _collect(b, epoch)
            assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(x, y))
        it = b.batches(2)
        next(it)
        del it  # abandon an epoch mid-way, then start another
        assert len(_collect(b, 2, 3)) == 3
    finally:
        b.close()


def test_too_small(tok):
    with pytest.raises(ValueError, match="fewer than one global batch"):
        build_train_data(
            DataConfig(demo_num_samples=10, workers=0),
            tokenizer=tok,
            image_size=32,
            batch_size=8,
            rank=0,
            world_size=2,
            seed=0,
        )


def test_no_deepspeed_imports():
    root = pathlib.Path(__file__).resolve().parents[2] / "dsclip"
    for sub in ("data", "eval"):
        for f in (root / sub).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module]
                assert not any(n.split(".")[0] == "deepspeed" for n in names), f
