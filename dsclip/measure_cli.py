"""``dsclip plan ... --measure``: the plan, then rank 0 of the planned job rehearsed on this machine.

The flags and the report live here so the planner's own command line (plan_cli.py) only adds them and
hands over. The rehearsal itself is dsclip.rehearsal; the communication time is dsclip.comm_model's,
printed apart from the measured host time, with the link figures and their sources.
"""

from __future__ import annotations

import argparse
import sys

from dsclip.comm_model import INTER_NODE_GBPS, INTRA_NODE_GBPS, LinkModel, Traffic, estimate  # no torch at import
from dsclip.plan import Plan, model_state_bytes
from dsclip.plan_comm import hideable_compute_s

GiB = 2**30


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rehearsal (--measure)")
    g.add_argument(
        "--measure",
        action="store_true",
        help="plan-only: also run rank 0 of the planned job on this machine under torch's fake process group "
        "(world = --gpus) for a few steps on synthetic batches, and print measured memory and step time beside "
        "the plan, with the communication model's time apart. Losses are meaningless (collectives move no data)",
    )
    g.add_argument(
        "--measure-steps", type=int, default=3, help="plan-only: timed steps of --measure (after one warm-up)"
    )
    g.add_argument(
        "--measure-device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="plan-only: where --measure runs rank 0 (auto: cuda when one is visible)",
    )
    g.add_argument(
        "--intra-node-gbps",
        type=float,
        default=INTRA_NODE_GBPS,
        help="plan-only: NVLink/NVSwitch bus bandwidth inside a node, GB/s (nccl-tests busbw): the plan's "
        "communication time and --measure's",
    )
    g.add_argument(
        "--inter-node-gbps",
        type=float,
        default=INTER_NODE_GBPS,
        help="plan-only: network bandwidth per GPU between nodes, GB/s (400 Gb/s InfiniBand = 50): the plan's "
        "communication time once --gpus exceeds --gpus-per-node, and --measure's",
    )


def _device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def link_from_args(a) -> LinkModel:
    link = LinkModel(gpus_per_node=a.gpus_per_node, intra_gbps=a.intra_node_gbps, inter_gbps=a.inter_node_gbps)
    if a.intra_node_gbps != INTRA_NODE_GBPS:
        link.intra_source = "given (--intra-node-gbps)"
    if a.inter_node_gbps != INTER_NODE_GBPS:
        link.inter_source = "given (--inter-node-gbps)"
    return link


def run_measure(a, plan: Plan, ds: tuple[str, dict]) -> int:
    from dsclip.rehearsal import RehearsalError, RehearsalSpec, rehearse

    if a.measure_steps < 1:
        print("dsclip plan: --measure-steps must be at least 1", file=sys.stderr)
        return 2
    device = _device(a.measure_device)
    micro = plan.micro_batch or a.batch_size
    spec = RehearsalSpec(
        model=plan.model,
        world=plan.gpus,
        batch_size=micro,
        accum_freq=max(1, plan.accum_freq),
        ds_config=ds[1],
        precision=plan.precision,
        grad_checkpointing=plan.grad_checkpointing,
        gpus_per_node=a.gpus_per_node,
        steps=a.measure_steps,
        device=device,
    )
    print(
        f"\nrehearsal: rank 0 of a world of {plan.gpus} under torch's fake process group on {device}, "
        f"micro-batch {spec.batch_size} x accum {spec.accum_freq}, ZeRO-{plan.zero} {plan.precision}, "
        f"{a.measure_steps} timed steps after 1 warm-up ..."
    )
    sys.stdout.flush()
    try:
        r = rehearse(spec)
    except RehearsalError as e:
        print(f"dsclip plan --measure: {e}", file=sys.stderr)
        return 2
    print(format_report(r, plan, link_from_args(a), device))
    return 0


def _ms(s: float) -> str:
    return f"{s * 1e3:9.3f} ms"


def format_report(r, plan: Plan, link: LinkModel, device: str) -> str:
    spec = r.spec
    lines = ["  losses are meaningless here: collectives move no data (each rank's own shard stands in for its peers')"]
    if r.skipped:
        lines.append(f"  {r.skipped} step(s) skipped by DeepSpeed (overflow / non-finite): not timed")
    if not r.step_s:
        lines.append("  no step was applied: no step time to report")
        return "\n".join(lines)
    step = sorted(r.step_s)[len(r.step_s) // 2]
    pred = plan.memory_gb.get("total")
    lines.append(
        f"  peak memory  measured {r.peak_bytes / GiB:.3f} GiB ({r.peak_kind})"
        + (f"; plan {pred:.3f} GiB" if pred is not None else "")
        + ("" if device == "cuda" else " (the plan's figure is a GPU's; a CPU run's bytes differ by design)")
    )
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
            f"  the plan's communication (dsclip/plan_comm.py, bytes derived, not counted): {_ms(plan.comm_total_s)} "
            f"back to back, {_ms(plan.comm_s)} exposed beside its compute {_ms(plan.compute_s)}"
        )
    return "\n".join(lines)
