"""Evaluation: zero-shot classification and image-text retrieval, run on every rank.

Pure metric functions on embeddings (``retrieval_metrics``, ``zeroshot_topk``, ``class_embeddings``)
and model-level helpers that shard the forward passes over ranks and all-gather the features.
"""

from dsclip.lazy_exports import lazy_exports

# The evaluator and the metric functions load torch, so they are imported on first use (PEP 562): the
# package is reached by `dsclip eval --help`, which must not load torch (issue #33). name -> submodule.
_LAZY = {
    **dict.fromkeys(
        (
            "Evaluator",
            "append_results",
            "encode_dataset",
            "evaluate_demo_zeroshot",
            "evaluate_retrieval",
            "evaluate_zeroshot",
            "zeroshot_classifier",
        ),
        "evaluator",
    ),
    "retrieval_metrics": "retrieval",
    "retrieval_ranks": "retrieval",
    "OPENAI_IMAGENET_TEMPLATES": "templates",
    "SIMPLE_IMAGENET_TEMPLATES": "templates",
    "load_templates": "templates",
    "class_embeddings": "zero_shot",
    "expand_prompts": "zero_shot",
    "zeroshot_topk": "zero_shot",
}


__getattr__ = lazy_exports(__name__, _LAZY)


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
