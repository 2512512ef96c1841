import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dsclip.eval import class_embeddings, expand_prompts, retrieval_metrics, retrieval_ranks, zeroshot_topk
from dsclip.eval.evaluator import encode_dataset, gather_rows, shard_indices


def _reference_ranks(img, txt, t2i):
    s = img @ txt.T  # (N, M)
    i2t = []
    for i in range(img.shape[0]):
        order = torch.argsort(s[i], descending=True).tolist()
        i2t.append(min(order.index(t) for t in range(txt.shape[0]) if t2i[t] == i))
    t2i_r = []
    for t in range(txt.shape[0]):
        order = torch.argsort(s[:, t], descending=True).tolist()
        t2i_r.append(order.index(int(t2i[t])))
    return torch.tensor(i2t), torch.tensor(t2i_r)


def test_retrieval_perfect_and_known():
    e = torch.eye(4)
    m = retrieval_metrics(e, e)
    assert m["image_to_text_R@1"] == 1.0 and m["text_to_image_mean_rank"] == 1.0
    assert m["image_to_text_median_rank"] == 1.0
    # image 0's caption matches image 1 better: text 0 ranks image 0 second
    txt = torch.tensor([[0.5, 1.0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    i2t, t2i = retrieval_ranks(e, txt)
    assert t2i.tolist() == [1, 0, 0, 0]
    assert i2t.tolist() == [0, 0, 0, 0]  # image 1 ties texts 0 and 1: ties count as hits
    m = retrieval_metrics(e, txt)
    assert m["text_to_image_R@1"] == 0.75 and m["text_to_image_R@5"] == 1.0
    assert abs(m["text_to_image_mean_rank"] - 1.25) < 1e-6


def test_retrieval_matches_argsort_multi_caption():
    g = torch.Generator().manual_seed(0)
    n, per = 37, 3
    img = F.normalize(torch.randn(n, 16, generator=g), dim=-1)
    t2i = torch.arange(n).repeat_interleave(per)[torch.randperm(n * per, generator=g)]
    txt = F.normalize(img[t2i] + 0.9 * torch.randn(n * per, 16, generator=g), dim=-1)
    ref_i2t, ref_t2i = _reference_ranks(img, txt, t2i)
    i2t, t2i_r = retrieval_ranks(img, txt, t2i, chunk_size=5)
    assert torch.equal(i2t, ref_i2t) and torch.equal(t2i_r, ref_t2i)
    m = retrieval_metrics(img, txt, t2i, chunk_size=7)
    assert abs(m["image_to_text_R@5"] - float((ref_i2t < 5).float().mean())) < 1e-9
    assert m["text_to_image_median_rank"] == float(torch.floor(ref_t2i.float().median()) + 1)


def test_retrieval_errors():
    import pytest

    with pytest.raises(ValueError, match="no caption"):
        retrieval_ranks(torch.eye(3), torch.eye(3)[:2], torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        retrieval_ranks(torch.eye(3), torch.eye(3)[:2])


def test_zeroshot_known():
    classifier = torch.eye(3)
    feats = torch.tensor([[1.0, 0.2, 0.1], [0.1, 0.2, 1.0], [0.3, 0.2, 0.1], [0.0, 0.5, 1.0]])
    labels = torch.tensor([0, 2, 1, 1])
    out = zeroshot_topk(feats, labels, classifier, ks=(1, 2, 5), chunk_size=3)
    assert out["top1"] == 0.5 and out["top2"] == 1.0 and out["top5"] == 1.0


def test_class_embeddings_and_prompts():
    assert expand_prompts(["cat", "dog"], ["a {c}.", "{c}!"]) == ["a cat.", "cat!", "a dog.", "dog!"]
    f = torch.tensor([[2.0, 0], [0, 1.0], [0, 3.0], [0, 1.0]])
    c = class_embeddings(f, 2)
    assert torch.allclose(c, torch.tensor([[2**-0.5, 2**-0.5], [0.0, 1.0]]))


def test_shard_gather_single_process():
    assert shard_indices(5, 1, 2) == [1, 3, 0]
    assert torch.equal(gather_rows(torch.arange(5)[:, None], 5), torch.arange(5)[:, None])


class CountingModel(nn.Module):
    """Stand-in CLIP: forward(image=) / forward(text=) -> dict of normalized features."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, image=None, text=None):
        self.calls += 1
        out = {}
        if image is not None:
            out["image_features"] = F.normalize(self.w(image.flatten(1)[:, :4]), dim=-1)
        if text is not None:
            out["text_features"] = F.normalize(self.w(text[:, :4].float()), dim=-1)
        return out


def _dist_encode(rank, world, n):
    torch.manual_seed(0)
    model = CountingModel()
    data = [torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    feats = encode_dataset(model, data, "image", batch_size=2)
    return feats, model.calls


@pytest.mark.dist
def test_encode_dataset_distributed_matches_single():
    from dsclip.testing.gloo_world import run_world

    n = 7
    (f0, c0), (f1, c1) = run_world(_dist_encode, 2, n, timeout=120)
    torch.manual_seed(0)
    single = encode_dataset(
        CountingModel(),
        [torch.randn(4, 2, 2, generator=torch.Generator().manual_seed(i)) for i in range(n)],
        "image",
        batch_size=2,
    )
    assert c0 == c1 == 2  # ceil(7/2)=4 rows per rank in batches of 2: same forward count everywhere
    assert torch.allclose(f0, single, atol=1e-6) and torch.allclose(f1, single, atol=1e-6)
