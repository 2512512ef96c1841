"""Image-text retrieval metrics from embeddings, chunked, without an N x M argsort.

The rank of a positive is the number of candidates scoring strictly higher than it (0 = top hit),
counted chunk by chunk on whatever device the features live on. Memory is O(chunk x M).
Several captions per image are allowed: ``text_to_image[t]`` is the image index of caption t.
- image -> text: an image's rank is that of its best-scoring caption (a hit at K if any of its
  captions is in the top K), the usual COCO/Flickr protocol.
- text -> image: each caption has exactly one positive image.
Names follow OpenCLIP: ``image_to_text_R@1``, ``image_to_text_mean_rank`` (1-based),
``image_to_text_median_rank`` (1-based, floor), same for ``text_to_image``.
"""

from __future__ import annotations

import torch


def _summary(prefix: str, ranks: torch.Tensor, ks) -> dict[str, float]:
    ranks = ranks.float()
    out = {f"{prefix}_R@{k}": float((ranks < k).float().mean()) for k in ks}
    out[f"{prefix}_mean_rank"] = float(ranks.mean() + 1)
    out[f"{prefix}_median_rank"] = float(torch.floor(ranks.median()) + 1)  # median() = lower median, as np.floor
    return out


@torch.no_grad()
def retrieval_ranks(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor | None = None,
    *,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based ranks: (image->text ranks (N,), text->image ranks (M,)). Features need not be normalized
    (scores are plain dot products); ``text_to_image`` defaults to arange (one caption per image)."""
    n, m = image_features.shape[0], text_features.shape[0]
    dev = image_features.device
    text_features = text_features.to(dev, image_features.dtype)
    if text_to_image is None:
        if n != m:
            raise ValueError(f"{n} images and {m} texts: pass text_to_image")
        text_to_image = torch.arange(n, device=dev)
    text_to_image = torch.as_tensor(text_to_image, device=dev).long()
    if text_to_image.shape != (m,):
        raise ValueError(f"text_to_image must have shape ({m},), got {tuple(text_to_image.shape)}")
    if m and (text_to_image.min() < 0 or text_to_image.max() >= n):
        raise ValueError("text_to_image holds an image index out of range")
    counts = torch.bincount(text_to_image, minlength=n)
    if n and counts.min() == 0:
        raise ValueError(f"{int((counts == 0).sum())} image(s) have no caption")

    i2t = torch.empty(n, dtype=torch.long, device=dev)
    for s in range(0, n, chunk_size):
        scores = image_features[s : s + chunk_size] @ text_features.T  # (c, M)
        ids = torch.arange(s, s + scores.shape[0], device=dev)
        positive = text_to_image[None, :] == ids[:, None]  # (c, M)
        best = scores.masked_fill(~positive, float("-inf")).amax(dim=1, keepdim=True)  # (c, 1)
        i2t[s : s + scores.shape[0]] = (scores > best).sum(dim=1)
    t2i = torch.empty(m, dtype=torch.long, device=dev)
    for s in range(0, m, chunk_size):
        scores = text_features[s : s + chunk_size] @ image_features.T  # (c, N)
        pos = scores.gather(1, text_to_image[s : s + scores.shape[0], None])  # same numbers as in `scores`
        t2i[s : s + scores.shape[0]] = (scores > pos).sum(dim=1)
    return i2t, t2i


def retrieval_metrics(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor | None = None,
    *,
    ks: tuple[int, ...] = (1, 5, 10),
    chunk_size: int = 1024,
) -> dict[str, float]:
    """Recall@K and mean/median rank both ways (see module doc)."""
    i2t, t2i = retrieval_ranks(image_features, text_features, text_to_image, chunk_size=chunk_size)
    return {**_summary("image_to_text", i2t, ks), **_summary("text_to_image", t2i, ks)}
