"""A stand-in for ``python -m dsclip train`` that exercises only the launch layer (opt-in).

Same command line and outputs as the trainer where the launch tests look: ``train --config X --logs
DIR --name NAME [--max-steps N] [--resume latest] [--step-sleep S]``; writes DIR/NAME/metrics.jsonl
(rank 0: step, loss, world_size), DIR/NAME/checkpoints/step_N/rank_R.pt + ``latest``; exits with
``dsclip.engine.world.stop.EXIT_REQUEUE`` after a preemption signal. Used with
``DSCLIP_LAUNCH_TRAINER=standin pytest -m launch`` to debug launches without the model stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsclip.engine.world import process_group, stop


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("command", choices=["train"])
    p.add_argument("--config")
    p.add_argument("--logs", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--resume")
    p.add_argument("--deepspeed-config")
    args, _ = p.parse_known_args([a for a in argv if not a.startswith("--local_rank")])

    info = process_group.init_distributed()
    stop.install_preemption_handler()
    run = Path(args.logs) / args.name
    ckpt = run / "checkpoints"
    if info.rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    torch.manual_seed(0)
    w_true = torch.randn(8)
    w = torch.zeros(8)
    step = 0
    if args.resume == "latest" and (ckpt / "latest").exists():
        tag = (ckpt / "latest").read_text().strip()
        state = torch.load(ckpt / tag / f"rank_{info.rank}.pt")
        w, step = state["w"], state["step"]
        if info.rank == 0:
            print(f"resumed from {tag} at step {step}", flush=True)

    def save():
        d = ckpt / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"w": w, "step": step}, d / f"rank_{info.rank}.pt")
        dist.barrier()
        if info.rank == 0:
            (ckpt / "latest").write_text(d.name)

    g = torch.Generator().manual_seed(1000 + info.rank)
    preempted = False
    while step < args.max_steps:
        x = torch.randn(32, 8, generator=g)
        err = x @ w - x @ w_true
        loss = (err**2).mean()
        grad = 2 * x.T @ err / len(x)
        dist.all_reduce(grad)
        lt = loss.detach().clone()
        dist.all_reduce(lt)
        w = w - 0.1 * grad / info.world_size
        step += 1
        if info.rank == 0:
            with open(run / "metrics.jsonl", "a") as f:
                f.write(
                    json.dumps({"step": step, "loss": lt.item() / info.world_size, "world_size": dist.get_world_size()})
                    + "\n"
                )
        time.sleep(args.step_sleep)
        preempted = stop.preemption_requested()  # collective: every rank gets the same reason
        if preempted:
            break
    save()
    if preempted and info.rank == 0:
        print(f"preempted at step {step}", flush=True)
    return stop.exit_code(preempted)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
