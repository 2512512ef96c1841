"""Leave ZeRO-1/2's per-parameter gradient hooks out of backward passes whose reduction is coalesced.

Inside ``engine.coalesce_grad_reduction()`` DeepSpeed's ZeRO-1/2 hooks reduce nothing (their
``process_gradients`` returns at once; the block's exit reduces every ``param.grad`` in one pass),
but each still fires once per parameter per backward and runs DeepSpeed's hook-count bookkeeping
(Python, ~0.07 ms per call on this CPU). The gradient cache runs K backwards per step, so that cost is
paid K times per step for nothing: 4,403 calls, 0.31 s of 10.8 s (3 %) over 7 steps of the
bench/accumulation.py model at world 1, K = 4, micro-batch 8 (cProfile).
Without the hooks autograd accumulates into ``param.grad`` exactly as it does with them, and the
flush reads the same tensors. ZeRO-3 is left alone: its hooks also release gathered parameters.
"""

from __future__ import annotations

import contextlib


def hooks_removable(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    return (
        engine.zero_optimization_stage() in (1, 2)
        and hasattr(opt, "_coalesce_grad_reduction")
        and hasattr(opt, "create_gradient_handling_hooks")
        and isinstance(getattr(opt, "_grad_acc_hooks", None), list)
    )


@contextlib.contextmanager
def zero_grad_hooks_suspended(engine):
    """Within a ``coalesce_grad_reduction`` block: take the hooks out, put them back on exit.

    The hook functions are taken out of the parameters' hook dicts and put back under the same keys,
    so DeepSpeed's handles stay valid. Re-creating them instead (``create_gradient_handling_hooks``)
    costs a ``packaging.version.parse`` of torch's version twice per parameter in DeepSpeed's
    ``register_grad_hook``: 47 ms per step for ViT-B-32's 302 tensors on this CPU, during which a GPU
    idles (bench/gpu_profile.py)."""
    opt = engine.optimizer
    if not opt._grad_acc_hooks:  # DeepSpeed registered none (no partitioning/overlap/contiguous grads)
        yield
        return
    taken = _take_hooks(opt._grad_acc_hooks)
    if taken is None:  # a torch whose handles do not expose their dict: remove and re-create
        for h in opt._grad_acc_hooks:
            h.remove()
        opt._grad_acc_hooks = []
        try:
            yield
        finally:
            opt.create_gradient_handling_hooks()  # the same hooks DeepSpeed made in its constructor
        return
    try:
        yield
    finally:
        for hooks, key, fn in taken:
            hooks[key] = fn


def _take_hooks(handles) -> list | None:
    """Remove each handle's hook from its dict; return (dict, key, function) to put back, or None."""
    found = []
    for h in handles:
        hooks = h.hooks_dict_ref() if callable(getattr(h, "hooks_dict_ref", None)) else None
        if hooks is None or getattr(h, "id", None) not in hooks:
            return None
        found.append((hooks, h.id, hooks[h.id]))
    for hooks, key, _ in found:
        del hooks[key]
    return found
