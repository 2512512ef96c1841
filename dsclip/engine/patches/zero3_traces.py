"""ZeRO-3 under the gradient cache: one fetch trace for the no-grad forwards, one for the forward+backward units.

ZeRO-3 prefetches the next modules' weights while the current one computes, and keeps weights that are used
again soon (``stage3_max_reuse_distance``), only once it holds a complete trace: the order in which modules
were fetched during one unit of work, a unit being everything from one root-module forward to the next
(``_start_of_forward_hook`` -> ``reset_step``). A unit that does not repeat the recorded order invalidates
the trace and recording starts again. The gradient cache at K > 1 alternates two kinds of unit: pass 1's
no-grad forwards (a forward alone) and the forward+backward of each chunk with a graph. The single trace
therefore never completes (checked: invalidated on every step at K = 2), so under ZeRO-3 with
``--accum-freq`` > 1, the configuration ViT-H/bigG need, no fetch is ever prefetched and no weight kept for
its reuse: every all-gather is exposed, where at K = 1 they overlap compute.

The patch gives the no-grad forwards a coordinator of their own, built with the same settings and sharing
the engine's in-flight registry and all-gather stream, and routes each unit to one of the two at the start of
its root forward (a forward pre-hook that runs before DeepSpeed's): grad enabled -> DeepSpeed's coordinator,
no grad -> the second one. Each then sees one kind of unit, repeated, and completes its trace after one step.
Evaluation forwards (no grad) use the second one as well. A model with frozen parameters (LiT) gets it only
with dsclip/engine/input_grads.py's hooks in place (see ``applies``). Which coordinator fetches a weight changes when it
is gathered, not its value: gradients and weights are bit for bit DeepSpeed's (tests/dist/test_zero3_patches.py),
and the big-batch reference tests at ZeRO-3, K = 2 and 4, run with it (tests/dist/test_gradcache.py).
"""

from __future__ import annotations

import torch

from dsclip.engine.input_grads import input_grads_covered

NAME = "zero3_traces"
SUMMARY = "ZeRO-3 + gradient cache: no-grad forwards get their own fetch trace, so both traces complete and prefetch"
VERIFIED = ("0.19.8",)
STAGES = (3,)
_C = "deepspeed.runtime.zero.partitioned_param_coordinator:PartitionedParameterCoordinator."
_O = "deepspeed.runtime.zero.parameter_offload:DeepSpeedZeRoOffload."
TARGETS = {
    _C + "__init__": frozenset({"9c88f61b821b"}),  # the settings read back from the first coordinator
    _C + "reset_step": frozenset({"9a5aa8d98634"}),
    _O + "get_param_coordinator": frozenset({"3867d94da97f"}),
    _O + "setup_zero_stage3_hooks": frozenset({"d8288b339f2a"}),  # the root forward pre-hook -> reset_step
}
_P = "_PartitionedParameterCoordinator__"  # its name-mangled private attributes


def applies(engine) -> bool:
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    return (
        engine.zero_optimization_stage() == 3
        and offload is not None
        and hasattr(offload, "param_coordinator")
        and hasattr(offload.param_coordinator, _P + "inflight_param_registry")
        and getattr(offload, "module", None) is engine.module
        # Frozen parameters (LiT's --lock-image / --lock-text) need the trainable modules' inputs to require
        # grad (dsclip/engine/input_grads.py, installed by build_engine): without that, DeepSpeed reduced a
        # module's weights before their gradients existed, with either trace layout
        and input_grads_covered(engine.module)
    )


def install(engine) -> None:
    offload = engine.optimizer.parameter_offload
    with_grad = offload.param_coordinator
    without_grad = twin(with_grad, offload.timers)
    current = [with_grad]

    def choose(module, args):
        # before DeepSpeed's own pre-hook, whose reset_step starts the unit on the coordinator chosen here
        current[0] = with_grad if torch.is_grad_enabled() else without_grad

    offload.get_param_coordinator = lambda: current[0]
    offload.dsclip_no_grad_coordinator = without_grad  # for tests and bench/
    engine.module.register_forward_pre_hook(choose, prepend=True)


def twin(coordinator, timers):
    """A coordinator with ``coordinator``'s settings, its own trace, and the same in-flight registry and stream."""
    cls = type(coordinator)
    return cls(
        prefetch_bucket_sz=getattr(coordinator, _P + "prefetch_bucket_sz"),
        max_reuse_distance_in_numel=getattr(coordinator, _P + "max_reuse_dist_in_numel"),
        max_available_parameters_in_numel=getattr(coordinator, _P + "max_n_available_params"),
        allgather_stream=getattr(coordinator, _P + "allgather_stream"),
        inflight_param_registry=getattr(coordinator, _P + "inflight_param_registry"),
        prefetch_nvme=getattr(coordinator, _P + "prefetch_nvme"),
        timers=timers,
        zero_quantized_weights=coordinator.zero_quantized_weights,
        zero_quantized_nontrainable_weights=coordinator.zero_quantized_nontrainable_weights,
        fast_sharding_for_leaf_module=coordinator.fast_sharding_for_leaf_module,
        log_trace_cache_warnings=getattr(coordinator, _P + "log_trace_cache_warnings"),
    )
