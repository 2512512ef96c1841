"""ZeRO-3: the autograd functions around each hooked module's inputs and outputs without per-call binding.

ZeRO-3 learns when a module's backward starts and ends from two autograd functions it applies to the
module's outputs (``PreBackwardFunctionForModule``) and inputs (``PostBackwardFunctionModule``) on every
forward: with the shipped leaf blocks ~70 modules per forward at ViT-H-14's depth, each a few tensors. Both
are "new-style" functions (a ``setup_context``), and for those torch binds the call's arguments against
``inspect.signature(forward)`` on every ``apply`` (``torch.autograd.function._bind_default_args``): ~7 % of
ZeRO-3's forward host time on CPU in a py-spy profile; without it a two-rank step at ViT-H-14's depth takes
5-8 % less host time (bench/zero3_host.py, bench/results/zero3-host_cpu2_2026-12-05.md), time a GPU waits for.

This patch gives each of the engine's modules the same two functions in the "old" form (``forward(ctx,
tensor)`` running DeepSpeed's own ``forward`` and then its own ``setup_context`` on the same context,
DeepSpeed's own ``backward``), which torch applies without binding. The hooks look the functions up on the
module at every call (``module.pre_bwd_fn.apply``), so nothing else changes: the same counters and the same
pre/post-backward calls in the same order. tests/dist/test_zero3_patches.py checks the run bit for bit
against DeepSpeed's paths and that the replacement ran.
"""

from __future__ import annotations

import torch

NAME = "zero3_hook_fns"
SUMMARY = "ZeRO-3: the per-module backward-hook autograd functions without torch's per-call argument binding"
VERIFIED = ("0.19.2", "0.19.8")
STAGES = (3,)
TARGETS = {
    # defines PreBackwardFunctionForModule / PostBackwardFunctionModule and the hooks that apply them
    "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload._register_deepspeed_module": frozenset(
        {"4eede10c50d5", "70b285fb9850"}
    ),
}
FUNCTIONS = ("pre_bwd_fn", "post_bwd_fn")


def applies(engine) -> bool:
    return engine.zero_optimization_stage() == 3 and hasattr(engine, "module")


def install(engine) -> None:
    for module in engine.module.modules():
        for attr in FUNCTIONS:
            fn = module.__dict__.get(attr)
            if fn is not None and not getattr(fn, "dsclip_unbound", False):
                module.__dict__[attr] = _unbound(fn)


def _unbound(deepspeed_fn):
    """DeepSpeed's one-tensor autograd function in the form torch applies without binding arguments."""

    class Unbound(torch.autograd.Function):
        dsclip_unbound = True

        @staticmethod
        def forward(ctx, tensor):
            out = deepspeed_fn.forward(tensor)
            deepspeed_fn.setup_context(ctx, (tensor,), out)
            return out

        backward = staticmethod(deepspeed_fn.backward)

    Unbound.__name__ = Unbound.__qualname__ = f"Unbound{deepspeed_fn.__name__}"
    return Unbound
