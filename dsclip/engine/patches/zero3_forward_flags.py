"""ZeRO-3: the engine's per-forward walk over every module replaced by a recorded list, and plain parameter
dicts inside the leaf blocks that zero3_blocks gathers.

ZeRO-3 replaces each module's ``_parameters`` by a ``ZeROOrderedDict`` whose ``__getitem__`` runs on every
parameter access: in a forward, a parameter found not gathered is registered as "external" to the running
module and gathered on the spot (the safety net for weights used outside their own module). To know that a
forward is running, the engine walks all of the model's modules before and after each forward (~1,250 at
ViT-H-14's depth), re-wrapping any plain dict and setting ``_in_forward`` on each. In a py-spy profile of
the thin ViT-H-14 the walk took ~7 % and the lookups ~7 % of ZeRO-3's forward host time, time a GPU waits for.

This patch, on an engine where zero3_blocks runs:

- records the engine's ``ZeROOrderedDict``s once and sets their ``_in_forward`` flag from that list; the
  engine's own prologue and epilogue run with the walk skipped (they are DeepSpeed's, called with the
  engine's ``zero_optimization_partition_weights`` answering False for their duration: the walk is the only
  thing that test gates in them, which the fingerprints pin);
- gives the modules inside each leaf block a plain dict with the same parameters in the same order. There
  the safety net has nothing to catch: zero3_blocks gathers all of a block's parameters before its forward
  (and for a checkpoint's recompute), and outside a forward a ``ZeROOrderedDict`` returns the parameter as a
  plain dict does.

The model's structure is taken as it is when the engine is built, as DeepSpeed's own hooks are (a module
added later gets neither). tests/dist/test_zero3_blocks.py runs with it (bit for bit DeepSpeed's hooks and
walk) and checks that the leaf interiors hold plain dicts and the flags are set during a forward only.
"""

from __future__ import annotations

NAME = "zero3_forward_flags"
SUMMARY = "ZeRO-3: the engine's per-forward walk over every module from a recorded list; plain dicts inside leaf blocks"
VERIFIED = ("0.19.8",)
STAGES = (3,)
REQUIRES = ("zero3_blocks",)  # reads its blocks: only their interiors, which it gathers, lose the safety net
_E = "deepspeed.runtime.engine:DeepSpeedEngine."
TARGETS = {
    # the walk (gated by zero_optimization_partition_weights, and nothing else gated by it) in both
    _E + "_forward_prologue": frozenset({"37d9c8e383b0"}),
    _E + "_forward_epilogue": frozenset({"366bd21293c7"}),
    # the safety net the leaf interiors give up
    "deepspeed.runtime.zero.parameter_offload:ZeROOrderedDict.__getitem__": frozenset({"2e025aef27af"}),
}


def applies(engine) -> bool:
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return (
        engine.zero_optimization_stage() == 3
        and getattr(offload, "dsclip_block_hooks", None) is not None  # zero3_blocks installed on this engine
        and callable(getattr(engine, "_forward_prologue", None))
        and callable(getattr(engine, "_forward_epilogue", None))
    )


def install(engine) -> None:
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict

    from dsclip.engine.patches.zero3_blocks import modules_inside

    inside = modules_inside(engine.optimizer.parameter_offload.dsclip_block_hooks.blocks)
    flags = []
    for module in engine.module.modules():
        params = module._parameters
        if not isinstance(params, ZeROOrderedDict):
            continue
        if id(module) in inside:
            module._parameters = dict(params)
        else:
            flags.append(params)
    deepspeed_prologue, deepspeed_epilogue = engine._forward_prologue, engine._forward_epilogue

    def without_walk(fn, *args):
        engine.zero_optimization_partition_weights = _false
        try:
            return fn(*args)
        finally:
            del engine.zero_optimization_partition_weights  # the class's method again

    def forward_prologue(inputs, kwargs):
        for params in flags:
            params._in_forward = True
        return without_walk(deepspeed_prologue, inputs, kwargs)

    def forward_epilogue():
        for params in flags:
            params._in_forward = False
        return without_walk(deepspeed_epilogue)

    engine._forward_prologue = forward_prologue
    engine._forward_epilogue = forward_epilogue
    engine.dsclip_forward_flags = flags  # for tests


def _false() -> bool:
    return False
