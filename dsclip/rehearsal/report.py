"""The rehearsal beside the plan: what ``dsclip plan ... --measure`` prints under the plan.

Measured (peak memory, the optimizer partition, host time per step) next to the plan's figures; the
communication time is the planner's link model (dsclip.plan.comm) over the bytes the rehearsal counted,
printed apart from the measured host time, with the link figures and their sources.
"""

from __future__ import annotations

from dsclip.plan.comm import LinkModel, Traffic, estimate, hideable_compute_s
from dsclip.plan.memory import model_state_bytes
from dsclip.plan.planner import Plan

GiB = 2**30


def _ms(s: float) -> str:
    return f"{s * 1e3:9.3f} ms"


def _peak_vs_plan(r, tensor_bytes: float) -> str:
    """The plan's tensors at the step's peak (memory_gb's total less the reserve: what max_memory_allocated and
    the CPU's LiveTensorBytes count) and the measured peak's ratio to it."""
    if not tensor_bytes:
        return "not planned"
    ratio = r.peak_bytes / tensor_bytes
    return f"{tensor_bytes / GiB:.3f} GiB of tensors (its total less the reserve), measured/plan {ratio:.3f}"


def format_report(r, plan: Plan, link: LinkModel, device: str) -> str:
    spec = r.spec
    lines = ["  losses are meaningless here: collectives move no data (each rank's own shard stands in for its peers')"]
    if r.skipped:
        lines.append(f"  {r.skipped} step(s) skipped by DeepSpeed (overflow / non-finite): not timed")
    if not r.step_s:
        lines.append("  no step was applied: no step time to report")
        return "\n".join(lines)
    step = sorted(r.step_s)[len(r.step_s) // 2]
    planned = _peak_vs_plan(r, plan.tensor_bytes)
    lines.append(f"  peak memory  measured {r.peak_bytes / GiB:.3f} GiB ({r.peak_kind}); plan {planned}")
    states = model_state_bytes(r.params, plan.gpus, plan.zero, plan.precision)
    lines.append(
        f"  optimizer partition  measured {r.optimizer_bytes / GiB:.4f} GiB ({r.optimizer_numel} fp32 elements "
        f"= params/{r.params / max(1, r.optimizer_numel):.2f}); plan {states['optimizer'] / GiB:.4f} GiB"
    )
    lines.append(
        f"  step time    measured {_ms(step)} host wall time per step (median of {len(r.step_s)}, {device}); "
        f"plan {_ms(plan.compute_s)} (GPU compute at MFU {plan.mfu:g}, {plan.mfu_source.split(';')[0]})"
    )
    traffic = Traffic()
    for kind, n, phase, calls, nbytes in r.traffic:
        traffic.calls[(kind, n, phase)], traffic.bytes[(kind, n, phase)] = calls, nbytes
    compute = step if device == "cuda" else plan.compute_s
    overlap = bool(spec["ds_config"].get("zero_optimization", {}).get("overlap_comm", False))
    est = estimate(
        traffic, link, zero=plan.zero, overlap_comm=overlap,
        hideable_compute_s=hideable_compute_s(compute, plan.zero),
    )  # fmt: skip
    lines.append(f"  communication per step (model, not measured; {link.describe()}):")
    for kind, d in sorted(est.per_kind.items()):
        hide = "overlappable" if d["overlappable"] else "exposed"
        lines.append(
            f"    {kind:<27} {d['calls']:>5} calls {d['bytes'] / 2**20:>10.1f} MiB {_ms(d['seconds'])}  {hide}"
        )
    lines.append(
        f"  communication  {_ms(est.total_s)} back to back, {_ms(est.exposed_s)} exposed; "
        f"step = {'measured' if device == 'cuda' else 'plan'} compute {_ms(compute)} + exposed "
        f"{_ms(est.exposed_s)} = {_ms(compute + est.exposed_s)}"
    )
    if plan.comm_link:  # the planner's own figure: bytes derived from the configuration, not counted
        lines.append(
            f"  the plan's communication (dsclip/plan/comm.py, bytes derived, not counted): {_ms(plan.comm_total_s)} "
            f"back to back, {_ms(plan.comm_s)} exposed beside its compute {_ms(plan.compute_s)}"
        )
    return "\n".join(lines)


def format_reductions(results: list, plan: Plan) -> str:
    """Each gradient reduction rehearsed, beside the plan's figures for it: the gradient bytes the rank held at
    once (dsclip.engine.accumulation.held_gradient_storages) and the bytes of each collective per step."""
    lines = ["gradient reductions, rehearsed (the plan's figures beside each):"]
    for r in results:
        mode = r.spec["grad_reduction"]
        row = plan.reductions.get(mode, {})
        chosen = " (chosen)" if mode == plan.grad_reduction else ""
        planned = row.get("grads_gb")
        lines.append(
            f"  {mode}{chosen}: gradients held {r.grad_bytes / GiB:.4f} GiB measured"
            + (f", plan {planned:.4f} GiB" if planned is not None else "")
            + f"; peak memory {r.peak_bytes / GiB:.3f} GiB measured, plan "
            + _peak_vs_plan(r, row.get("tensor_bytes", 0.0))
        )
        counted: dict[str, int] = {}
        for kind, _, phase, _, nbytes in r.traffic:
            counted[f"{kind} in {phase}"] = counted.get(f"{kind} in {phase}", 0) + nbytes
        derived = row.get("comm_bytes", {})
        for key in sorted(set(counted) | set(derived)):
            plan_b = derived.get(key)
            lines.append(
                f"    {key:<27} {counted.get(key, 0) / 2**20:>10.2f} MiB counted"
                + (f", plan {plan_b / 2**20:.2f} MiB" if plan_b is not None else ", plan: not derived (small)")
            )
    return "\n".join(lines)
