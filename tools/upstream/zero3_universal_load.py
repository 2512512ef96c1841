"""Reproduction for DeepSpeed: a ZeRO-3 universal-checkpoint load overwrites the optimizer's param groups and
shares one ``step`` tensor between partitions.

DeepSpeed only; one CPU process, no GPU, no dsclip. A ZeRO-3 engine with two param groups (weight decay 0.1
on the matrices, 0.0 on biases and norms, as CLIP training sets them) trains two steps and saves; the
checkpoint is converted with ``deepspeed.checkpoint.ds_to_universal`` and loaded into a fresh engine with
``"checkpoint": {"load_universal": true}``. After
``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``:

1. every param group has group 0's hyper-parameters (the no-decay group gets weight decay 0.1);
2. every flat fp32 partition's Adam state holds the *same* ``step`` tensor, which torch's Adam increments
   in place once per partition, so bias correction runs ahead by the number of partitions.

(The loader also sets every group's ``params`` to ``[]``; this script does not show that one, since ZeRO-3's
wrapped optimizer holds empty groups between steps here too. dsclip's end-to-end test does:
tests/e2e/test_checkpoint_resume.py.) Reproduced with DeepSpeed 0.19.8, torch 2.x, CPU, one process.

Expected: the groups as saved and one ``step`` per partition. dsclip's workaround:
dsclip/engine/patches/universal_zero3.py (puts back each group's params and hyper-parameters, clones each
``step``).

    TORCH_EXTENSIONS_DIR=... python tools/upstream/zero3_universal_load.py
"""

from __future__ import annotations

import os
import tempfile
from argparse import Namespace
from pathlib import Path

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29518")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def engine(load_universal: bool = False):
    torch.manual_seed(0)
    config = CONFIG | ({"checkpoint": {"load_universal": True}} if load_universal else {})
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    # zero.Init leaves empty placeholders: the parameters' shapes are their ds_shape
    matrix = [len(p.ds_shape) == 2 for p in model.parameters()]
    decay = [p for p, m in zip(model.parameters(), matrix) if m]
    no_decay = [p for p, m in zip(model.parameters(), matrix) if not m]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    e, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return e


def train(e, steps: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        e.backward(e(x).square().mean())
        e.step()


def describe(e) -> dict:
    inner = e.optimizer.optimizer  # the wrapped torch optimizer, over the flat fp32 partitions
    steps = [s["step"] for s in inner.state.values() if torch.is_tensor(s.get("step"))]
    return {
        "weight_decay": [g["weight_decay"] for g in inner.param_groups],
        "params": [len(g["params"]) for g in inner.param_groups],
        "distinct step tensors": len({id(t) for t in steps}),
        "partitions": len(steps),
    }


def main() -> None:
    from deepspeed.checkpoint import ds_to_universal

    deepspeed.init_distributed(dist_backend="gloo")
    with tempfile.TemporaryDirectory() as tmp:
        saved = engine()
        train(saved, 2)
        before = describe(saved)
        saved.save_checkpoint(tmp, tag="t")
        args = Namespace(
            input_folder=str(Path(tmp) / "t"),
            output_folder=str(Path(tmp) / "t" / "universal"),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        ds_to_universal.main(args)
        loaded = engine(load_universal=True)
        loaded.load_checkpoint(str(Path(tmp) / "t"), tag="universal", load_optimizer_states=True)
        after = describe(loaded)
    print(f"DeepSpeed {deepspeed.__version__}, ZeRO-3, one rank, AdamW with two param groups")
    print(f"  saved:                       {before}")
    print(f"  after the universal load:    {after}")
    wrong = [k for k in ("weight_decay", "params") if after[k] != before[k]]
    if after["partitions"] > 1 and after["distinct step tensors"] < after["partitions"]:
        wrong.append("shared step")
    print("REPRODUCED: " + ", ".join(wrong) if wrong else "not reproduced on this DeepSpeed")


if __name__ == "__main__":
    main()
