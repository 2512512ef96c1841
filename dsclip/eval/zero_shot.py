"""Zero-shot classification: class embeddings from prompt templates, top-k accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_prompts(classnames: list[str], templates: list[str]) -> list[str]:
    """Class-major prompt list: prompts[c * T + t] = templates[t] with {c} -> classnames[c]."""
    return [t.replace("{c}", c) for c in classnames for t in templates]


def class_embeddings(prompt_features: torch.Tensor, num_classes: int) -> torch.Tensor:
    """(C*T, D) prompt features (class-major) -> (C, D) classifier: normalize, mean over templates,
    renormalize (OpenCLIP's build_zero_shot_classifier)."""
    d = prompt_features.shape[-1]
    f = F.normalize(prompt_features.float(), dim=-1).view(num_classes, -1, d)
    return F.normalize(f.mean(dim=1), dim=-1)


@torch.no_grad()
def zeroshot_topk(
    image_features: torch.Tensor,
    labels: torch.Tensor,
    classifier: torch.Tensor,
    ks: tuple[int, ...] = (1, 5),
    chunk_size: int = 4096,
) -> dict[str, float]:
    """Top-k accuracy of ``image_features (N, D)`` against ``classifier (C, D)``: {"top1": .., "top5": ..}.

    k larger than C counts as C (every sample is a hit). Ties are broken by topk's order.
    """
    labels = torch.as_tensor(labels, device=image_features.device).long()
    classifier = classifier.to(image_features.device, image_features.dtype)
    n, c = image_features.shape[0], classifier.shape[0]
    if n == 0:
        raise ValueError("zero-shot evaluation on an empty set")
    hits = {k: 0 for k in ks}
    kmax = min(max(ks), c)
    for s in range(0, n, chunk_size):
        logits = image_features[s : s + chunk_size] @ classifier.T  # (b, C)
        pred = logits.topk(kmax, dim=1).indices  # (b, kmax)
        correct = pred == labels[s : s + chunk_size, None]
        for k in ks:
            hits[k] += int(correct[:, : min(k, c)].any(dim=1).sum())
    return {f"top{k}": hits[k] / n for k in ks}
