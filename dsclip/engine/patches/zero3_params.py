"""ZeRO-3: each module's parameter list built once, not on every fetch and release.

ZeRO-3's coordinator asks a module for its parameters (``iter_params`` -> ``module.named_parameters``, a
walk over the module's subtree) several times per fetch and per release: a transformer block that is a
ZeRO-3 leaf (ds_configs/zero3*.json) is walked, with its ~15 submodules, about ten times per forward and
backward, and the step walks the whole model twice (``release_and_reset_all``). With ViT-H-14's tensors that
is ~5,000 walks a step, 10 % of ZeRO-3's host time on CPU (bench/zero3_host.py), time the GPU waits for the
host. Under ZeRO-3 a module's parameters are fixed once ``deepspeed.initialize`` has partitioned them (a
parameter added later would not be partitioned at all), so this patch records each module's own and
subtree parameter tuples at install and answers from them; DeepSpeed's external parameters
(``register_external_parameter``) are still read live on every call.

DeepSpeed looks ``iter_params`` up as a module global of ``partitioned_param_coordinator`` and
``parameter_offload``, so the patch puts a dispatcher there (once per process): a module that carries this
engine's tuples is answered from them, any other module (an engine built with the patch off, a module
wrapped later) by DeepSpeed's own ``iter_params``. It is the seam's one module-level change, and it is
behaviour-preserving by construction: the same parameters in the same order (tests/dist/test_zero3_patches.py
compares both paths, and the ZeRO-3 exactness tests run with it on and off).
"""

from __future__ import annotations

import itertools

NAME = "zero3_params"
SUMMARY = "ZeRO-3: each module's parameter list built once at install, not walked on every fetch and release"
VERIFIED = ("0.19.2", "0.19.8")  # the same targets in both (CI's oldest runs it: make test-ds-floor)
STAGES = (3,)
_C = "deepspeed.runtime.zero.partitioned_param_coordinator:"
TARGETS = {
    _C + "iter_params": frozenset({"594f9e285a48"}),
    _C + "get_all_parameters": frozenset({"859e0b924ea8"}),
    "deepspeed.runtime.zero.parameter_offload:iter_params": frozenset({"594f9e285a48"}),
}
LISTS = "_dsclip_param_lists"  # module.__dict__ key: (own parameters, the subtree's), as named_parameters yields


def applies(engine) -> bool:
    return engine.zero_optimization_stage() == 3 and hasattr(engine, "module")


def install(engine) -> None:
    _install_dispatcher()
    for module in engine.module.modules():
        module.__dict__[LISTS] = (
            tuple(p for _, p in module.named_parameters(recurse=False)),
            tuple(p for _, p in module.named_parameters(recurse=True)),
        )


def _install_dispatcher() -> None:
    import deepspeed.runtime.zero.parameter_offload as offload
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    if getattr(coordinator.iter_params, "dsclip_dispatcher", False):
        return
    deepspeed_iter_params = coordinator.iter_params

    def iter_params(module, recurse=False):
        lists = module.__dict__.get(LISTS)
        if lists is None:
            return deepspeed_iter_params(module, recurse)
        own = lists[1] if recurse else lists[0]
        external = module.ds_external_parameters() if hasattr(module, "ds_external_parameters") else ()
        if external:
            return itertools.chain(own, (p for _, p in external))
        return iter(own)

    iter_params.dsclip_dispatcher = True
    # the version guard of a later engine in this process (bench/gpu_bench.py builds several) fingerprints
    # DeepSpeed's function, not this dispatcher
    iter_params.__wrapped__ = deepspeed_iter_params
    coordinator.iter_params = iter_params
    offload.iter_params = iter_params
