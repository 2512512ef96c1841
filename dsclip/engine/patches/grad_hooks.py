"""Leave ZeRO-1/2's per-parameter gradient hooks out of the backward passes of a coalesced block.

Inside ``engine.coalesce_grad_reduction()`` DeepSpeed's ZeRO-1/2 hooks reduce nothing (``process_gradients``
returns at once; the block's exit reduces every ``param.grad`` in one pass), but each still fires once per
parameter per backward and runs DeepSpeed's hook bookkeeping in Python. The gradient cache runs K
backwards per step, so that cost is paid K times per step for nothing: 0.31 s of 10.8 s (3 %) over 7 steps of
bench/accumulation.py's model at world 1, K = 4 (cProfile, CPU). Without the hooks autograd accumulates
into ``param.grad`` exactly as it does with them, and the flush reads the same tensors.

The patch wraps this engine's ``coalesce_grad_reduction`` (an instance attribute: other engines and the
class keep DeepSpeed's): entering the block takes the hook functions out of the parameters' hook dicts
(torch's ``RemovableHandle.hooks_dict_ref``) and puts them back under the same keys before DeepSpeed's
flush runs, so DeepSpeed's handles stay valid. Re-creating them instead (``create_gradient_handling_hooks``)
costs a ``packaging.version.parse`` twice per parameter (47 ms per step for ViT-B-32 on this CPU), so that
is only the fallback for a torch whose handles hide their dict. ZeRO-3 is left alone: its hooks also
release gathered parameters. The DeepSpeed change that would retire it: not registering (or
short-circuiting in C++) the hooks while a coalesced block is open.
"""

from __future__ import annotations

import contextlib

NAME = "grad_hooks"
SUMMARY = "ZeRO-1/2: DeepSpeed's per-parameter gradient hooks out of the backwards of a coalesced block"
VERIFIED = ("0.19.8",)
_Z = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer."
STAGES = (1, 2)
TARGETS = {
    "deepspeed.runtime.engine:DeepSpeedEngine.coalesce_grad_reduction": frozenset({"79db9ff01808"}),
    _Z + "create_gradient_handling_hooks": frozenset({"889a2e66c36c"}),
    _Z + "process_gradients": frozenset({"13ff5f7e323e"}),
    _Z + "reduce_ready_partitions_and_remove_grads": frozenset({"d4d8eb3cbc90"}),
}


def applies(engine) -> bool:
    opt = getattr(engine, "optimizer", None)
    return (
        engine.zero_optimization_stage() in (1, 2)
        and hasattr(engine, "coalesce_grad_reduction")
        and hasattr(opt, "_coalesce_grad_reduction")
        and hasattr(opt, "create_gradient_handling_hooks")
        and isinstance(getattr(opt, "_grad_acc_hooks", None), list)
    )


def install(engine) -> None:
    coalesce = engine.coalesce_grad_reduction  # DeepSpeed's (bound) context manager

    @contextlib.contextmanager
    def coalesce_grad_reduction():
        with coalesce():  # outermost: its exit (the flush) runs after the hooks are back
            with hooks_suspended(engine.optimizer):
                yield

    engine.coalesce_grad_reduction = coalesce_grad_reduction


@contextlib.contextmanager
def hooks_suspended(opt):
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
