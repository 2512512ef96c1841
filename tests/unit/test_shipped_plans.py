"""One answer everywhere: every job dsclip ships (README's SLURM job, each model recipe on the cluster its header
names) runs the configuration `dsclip plan` chooses for it: the same ZeRO stage and offload, it fits, and its
predicted rate is the chosen one's (within 1 %: equal-rate variants such as another InfoNCE implementation
are the same answer). A shipped command that disagrees fails here, not in a user's GPU hours."""

from __future__ import annotations

import re
import shlex

import pytest

from dsclip.config import parse_run_config
from dsclip.engine.ds_config import load_ds_json
from dsclip.plan import planner as P
from dsclip.plan import report as R
from dsclip.plan import search as S
from dsclip.plan.efficiency import gpu_spec

ROOT = P.ROOT
RECIPES = sorted(p.stem for p in (ROOT / "dsclip/recipes").glob("*.yaml") if p.stem not in ("demo", "tiny"))


def _agrees(cfg, gpus: int, gpu: str) -> None:
    spec = gpu_spec(gpu)
    t, m = cfg.train, cfg.model
    batch = t.batch_size * t.accum_freq * gpus
    base = dict(gpus=gpus, gpu_memory_gb=spec.memory_gib, peak_tflops=spec.peak_tflops, batch_size=batch,
                patch_dropout=m.force_patch_dropout or 0.0, precision=t.precision)  # fmt: skip
    chosen = S.search(m.model, **base).chosen
    ds = load_ds_json(t.deepspeed_config)
    shipped = P.make_plan(m.model, zero=ds["zero_optimization"]["stage"], ds_config=(t.deepspeed_config, ds),
                          grad_checkpointing=m.grad_checkpointing, loss=cfg.loss_name, micro_batch=t.batch_size,
                          **base)  # fmt: skip
    what = f"{m.model} on {gpus} x {gpu}: shipped {R.describe(shipped)}; planner {R.describe(chosen)}"
    assert shipped.fits, what
    assert (shipped.zero, shipped.offload) == (chosen.zero, chosen.offload), what
    assert shipped.samples_per_s_per_gpu >= 0.99 * chosen.samples_per_s_per_gpu, what


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_the_planners_choice(recipe):
    text = (ROOT / f"dsclip/recipes/{recipe}.yaml").read_text()
    found = re.search(r"^# planned-for: --gpus (\d+) --gpu (\S+)$", text, re.M)
    assert found, f"{recipe}.yaml names no cluster it is planned for ('# planned-for: --gpus N --gpu NAME')"
    cfg = parse_run_config(["--config", recipe, "--name", "x"])
    _agrees(cfg, int(found[1]), found[2])


def test_readme_slurm_job_runs_the_planners_choice():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Train ViT-H-14 on 4 nodes") :]
    block = block[block.index("```bash") : block.index("```", block.index("```bash") + 7)]
    plan_line = next(ln for ln in block.splitlines() if ln.startswith("dsclip plan "))
    gpu = shlex.split(plan_line, comments=True)[shlex.split(plan_line, comments=True).index("--gpu") + 1]
    job = " ".join(ln.rstrip("\\") for ln in block.splitlines() if not ln.startswith(("dsclip plan", "export", "```")))
    words = shlex.split(job)
    env = dict(w.split("=", 1) for w in words[: words.index("sbatch")])
    opts = dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)
    train = words[words.index("launch/slurm/train.sbatch") + 1 :]
    cfg = parse_run_config(["--config", env["RECIPE"], "--deepspeed-config", env["DS_CONFIG"], *train, "--name", "x"])
    gpus = int(opts["nodes"]) * int(opts["ntasks-per-node"])
    _agrees(cfg, gpus, gpu)
