"""Evaluation: zero-shot classification and image-text retrieval, run on every rank.

Pure metric functions on embeddings (``retrieval_metrics``, ``zeroshot_topk``, ``class_embeddings``)
and model-level helpers that shard the forward passes over ranks and all-gather the features.
"""

from .evaluator import (
    Evaluator,
    append_results,
    encode_dataset,
    evaluate_demo_zeroshot,
    evaluate_retrieval,
    evaluate_zeroshot,
    zeroshot_classifier,
)
from .retrieval import retrieval_metrics, retrieval_ranks
from .templates import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES, load_templates
from .zero_shot import class_embeddings, expand_prompts, zeroshot_topk

__all__ = [
    "Evaluator",
    "append_results",
    "OPENAI_IMAGENET_TEMPLATES",
    "SIMPLE_IMAGENET_TEMPLATES",
    "class_embeddings",
    "encode_dataset",
    "evaluate_demo_zeroshot",
    "evaluate_retrieval",
    "evaluate_zeroshot",
    "expand_prompts",
    "load_templates",
    "retrieval_metrics",
    "retrieval_ranks",
    "zeroshot_classifier",
    "zeroshot_topk",
]
