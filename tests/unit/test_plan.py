"""dsclip plan: its numbers against DeepSpeed's estimators, autograd's saved tensors and FlopCounterMode."""

from __future__ import annotations

import shlex

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from dsclip.cli import plan as C
from dsclip.model import create_model
from dsclip.plan import architecture as A
from dsclip.plan import flops as F
from dsclip.plan import memory as M
from dsclip.plan import planner as P

# Small architectures that exercise every term: head_width != 64, a non-integer MLP ratio (bigG's
# 4.9231), a causal text tower, an image larger than one patch grid.
SMALL = {
    "embed_dim": 48,
    "vision_cfg": {
        "image_size": 64,
        "patch_size": 8,
        "width": 96,
        "layers": 3,
        "head_width": 24,
        "mlp_ratio": 4.9231,
    },
    "text_cfg": {
        "context_length": 20,
        "vocab_size": 300,
        "width": 64,
        "heads": 4,
        "layers": 2,
        "pool_type": "eos",
        "eos_id": 2,
    },
}
ACT_TOL = 0.03  # the computed per-sample activation bytes are within 3% of what autograd keeps


def test_model_states_equal_deepspeed_zero2_estimate():
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for name in ("ViT-H-14", "ViT-bigG-14"):
        arch = A.load_arch(name)
        for gpus in (8, 64, 256):
            _, ds_gpu = estimate_zero2_model_states_mem_needs(
                arch.params,
                num_gpus_per_node=8 if gpus >= 8 else gpus,
                num_nodes=max(gpus // 8, 1),
                cpu_offload=False,
            )
            ours = sum(M.model_state_bytes(arch.params, gpus, 2, "bf16").values())
            assert abs(ours - ds_gpu) <= 2, (name, gpus, ours, ds_gpu)


def test_model_states_zero3_vs_deepspeed_estimate():
    """DeepSpeed's ZeRO-3 estimate is 18·P/N + 4·largest layer. dsclip counts 20·P/N: the 16-bit
    gradient partition (stage3.py grad_partitions_flat_buffer, in the 16-bit accumulation dtype) and
    the fp32 gradient made from it at step time both exist, as in DeepSpeed's own ZeRO-2 count
    (2 grads_16bit + 4 grads_32bit). The tests/dist/test_scale_plan.py engine check measures the
    persistent buffers."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    for name in ("ViT-H-14", "ViT-bigG-14"):
        arch = A.load_arch(name)
        for gpus in (8, 256):
            _, ds_gpu, ds_layer = estimate_zero3_model_states_mem_needs(
                arch.params,
                arch.largest_layer_params,
                num_gpus_per_node=8,
                num_nodes=gpus // 8,
                cpu_offload=False,
            )
            ours = M.model_state_bytes(arch.params, gpus, 3, "bf16", arch.largest_layer_params)
            assert ours["gathered_layers"] == ds_layer
            assert abs(sum(ours.values()) - (ds_gpu + 2 * arch.params / gpus)) <= 2, (name, gpus)


def test_largest_layer_is_deepspeeds_definition():
    from deepspeed.runtime.zero.stage3 import model_to_params

    m = create_model(SMALL)
    total, largest = model_to_params(m)
    arch = A.load_arch(SMALL)
    assert (arch.params, arch.largest_layer_params) == (total, largest)


def _saved_bytes(model, batch: int, dtype: torch.dtype, ckpt: bool) -> int:
    """Bytes of distinct storages autograd keeps after one forward (parameters excluded); with
    checkpointing, the tensors each checkpointed block keeps for its recomputation (its input)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def note(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params and s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
        return t

    def ckpt_fn(fn, *args):
        for a in args:
            note(a)
        return checkpoint(fn, *args, use_reentrant=False)

    model.set_grad_checkpointing(ckpt, checkpoint_fn=ckpt_fn if ckpt else None)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    size = cfg["vision_cfg"]["image_size"]
    img = torch.randn(batch, 3, size, size, generator=g).to(dtype)
    txt = torch.randint(3, 250, (batch, cfg["text_cfg"]["context_length"]), generator=g)
    txt[:, -3] = 2
    with torch.autograd.graph.saved_tensors_hooks(note, lambda t: t):
        out = model(image=img, text=txt)
    del out
    return sum(seen.values())


@pytest.mark.parametrize(
    "name,dtype,patch_dropout,ckpt",
    [
        ("demo", torch.float32, 0.0, False),
        ("small", torch.float32, 0.0, False),
        ("small", torch.bfloat16, 0.0, False),
        ("small", torch.bfloat16, 0.5, False),
        ("small", torch.float32, 0.0, True),
        ("small", torch.bfloat16, 0.5, True),
    ],
)
def test_activation_estimate_matches_autograd_saved_tensors(name, dtype, patch_dropout, ckpt):
    cfg = SMALL if name == "small" else name
    torch.manual_seed(0)
    model = create_model(cfg, patch_dropout=patch_dropout, vocab_size=300).to(dtype).train()
    # Per sample: the difference between two batch sizes removes anything batch-independent.
    measured = (_saved_bytes(model, 6, dtype, ckpt) - _saved_bytes(model, 2, dtype, ckpt)) / 4
    arch = A.load_arch(model.config, patch_dropout)
    est = M.activation_bytes(arch, "fp32" if dtype == torch.float32 else "bf16", ckpt)["saved"]
    assert est == pytest.approx(measured, rel=ACT_TOL), (est, measured)


@pytest.mark.parametrize("name,patch_dropout", [("demo", 0.0), ("small", 0.0), ("small", 0.5)])
def test_forward_flops_match_flop_counter(name, patch_dropout):
    cfg = SMALL if name == "small" else name
    model = create_model(cfg, patch_dropout=patch_dropout, vocab_size=300).train()
    c = model.config
    size, length = c["vision_cfg"]["image_size"], c["text_cfg"]["context_length"]
    batch = 3
    txt = torch.randint(3, 250, (batch, length))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as two bmm's, which FlopCounterMode counts (it has no formula for
    # the CPU flash kernel that SDPA picks by default); the FLOPs are the same either way.
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(image=torch.randn(batch, 3, size, size), text=txt)
    est = F.forward_flops(A.load_arch(c, patch_dropout))["total"] * batch
    assert est == pytest.approx(counter.get_total_flops(), rel=0.01)


def test_bigg_plan_on_256_gpus_fits_and_prints_a_valid_command(capsys):
    from dsclip.config import parse_run_config

    rc = C.main_plan(
        [
            "--model",
            "ViT-bigG-14",
            "--gpus",
            "256",
            "--gpu-memory",
            "80",
            "--global-batch",
            "32768",
            "--zero",
            "2",
            "--precision",
            "bf16",
            "--grad-checkpointing",
            "--force-patch-dropout",
            "0.5",
            "--loss",
            "infonce_local",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    for key in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "embedding_cache",
        "loss (infonce_local)",
        "FLOPs per sample",
        "s/step",
        "recommended:",
    ):
        assert key in out, key
    cmd = out.strip().splitlines()[-1]
    argv = shlex.split(cmd)
    train_args = argv[argv.index("train") + 1 :]
    cfg = parse_run_config(train_args + ["--name", "x"])
    assert cfg.train.batch_size * cfg.train.accum_freq * 256 == 32768
    assert cfg.model.grad_checkpointing and cfg.model.force_patch_dropout == 0.5
    assert cfg.loss_name == "infonce_local" and cfg.train.precision == "bf16"


def test_plan_is_consistent():
    p = P.make_plan(
        "ViT-bigG-14",
        gpus=256,
        gpu_memory_gb=80,
        batch_size=32768,
        zero=3,
        grad_checkpointing=True,
        loss="infonce_tiled",
    )
    assert p.fits and p.micro_batch * p.accum_freq == p.local_batch == 128
    assert p.memory_gb["total"] <= 80
    # the next divisor up would not fit
    assert p.micro_batch == p.local_batch or 2 * p.micro_batch > p.max_micro_batch
    # checkpointing saves memory per sample; patch dropout halves the vision tower's FLOPs roughly
    nock = P.make_plan("ViT-bigG-14", gpus=256, gpu_memory_gb=80, batch_size=32768, zero=3, loss="infonce_tiled")
    assert nock.activation_per_sample_mb["peak"] > 5 * p.activation_per_sample_mb["peak"]
    pd = P.make_plan("ViT-bigG-14", gpus=256, gpu_memory_gb=80, batch_size=32768, patch_dropout=0.5)
    assert 0.4 < pd.forward_gflops_per_sample["vision"] / p.forward_gflops_per_sample["vision"] < 0.55
    # compute per step follows the stated MFU: model FLOPs / (mfu * peak); the step adds the exposed
    # communication of 256 GPUs (32 nodes: inter-node links), which ZeRO-3's boundary reduce-scatter keeps > 0
    t = p.train_gflops_per_sample * 1e9 * p.local_batch / (p.mfu * 790e12)
    assert p.compute_s == pytest.approx(t, rel=1e-2)
    assert p.comm_s > 0 and p.step_time_s == pytest.approx(p.compute_s + p.comm_s + p.offload_s, rel=1e-5)
    assert p.comm_share == pytest.approx(p.comm_s / p.step_time_s, abs=1e-4) and "inter-node" in p.comm_link


def test_one_micro_batch_plan_does_not_depend_on_the_rows_asked_for():
    """Pass 2 holds one chunk's graph at a time (the kept one is back-propagated first), so the largest
    micro-batch is budget / peak per sample whether K is 1 or more: a rank's rows fit as one micro-batch up
    to that limit, whatever rows were asked for (an older rule counted a second, kept graph for K > 1 and
    said 'does not fit' for rows between the two limits). Sharded: the coalesced reduction's K = 1 plan has a
    saving of its own (its whole .grad is not alive beside the activations: test_coalesced_k1_peak_...)."""
    kw = dict(gpus=1, gpu_memory_gb=139.8, zero=3, grad_checkpointing=True, loss="infonce", grad_reduction="sharded")

    def at(rows):
        return P.make_plan("ViT-bigG-14", batch_size=rows, micro_batch=rows, **kw)

    k_limit = P.make_plan("ViT-bigG-14", batch_size=4096, **kw).max_micro_batch  # asked for more rows than fit
    lo, hi = 1, 4096  # the largest one-micro-batch plan that fits: lo fits, hi does not
    while hi - lo > 1:
        lo, hi = ((lo + hi) // 2, hi) if at((lo + hi) // 2).fits else (lo, (lo + hi) // 2)
    # the same limit to within what the cache and loss of the extra rows take (0.5 %)
    assert k_limit <= lo <= 1.005 * k_limit
    for rows in (k_limit // 2, k_limit, lo):
        p = at(rows)
        assert p.fits and p.micro_batch == rows and p.accum_freq == 1 and p.max_micro_batch >= rows, rows
    assert 0.99 * 139.8 <= at(lo).memory_gb["total"] <= 139.8  # the whole budget, activations of all rows


def test_does_not_fit_exits_1_with_a_suggestion(capsys):
    fixed = ["--deepspeed-config", "zero2_bf16", "--loss", "infonce", "--no-grad-checkpointing"]
    rc = C.main_plan(["--model", "ViT-bigG-14", "--gpus", "4", "--gpu-memory", "18", "--global-batch", "4096", *fixed])
    out = capsys.readouterr().out
    assert rc == 1 and "does NOT fit" in out and "cheapest change that fits" in out and "try" in out


def test_loss_memory_orders_modes():
    n, b, d = 32768, 128, 1280
    m = {mode: M.loss_bytes(mode, b, n, d) for mode in M.LOSS_MODES}
    assert m["infonce"] > m["infonce_local"] > m["infonce_tiled"]
    assert m["infonce"] >= 4 * n * n * 4


def test_bad_input_is_a_config_error():
    from dsclip.config import ConfigError

    with pytest.raises(ConfigError, match="multiple of --gpus"):
        P.make_plan("ViT-B-32", gpus=3, gpu_memory_gb=80, batch_size=1000)
    with pytest.raises(ConfigError, match="--loss"):
        P.make_plan("ViT-B-32", gpus=1, gpu_memory_gb=80, batch_size=8, loss="nope")


def test_largest_contrastive_batch_vit_l14_on_8x80gb_is_past_a_million(capsys):
    """Inf-CL reports 448k for ViT-L/14 on 8 x 80 GB (OpenCLIP 152k). With the gradient cache and the tiled
    loss only O(rows x D) buffers grow on the GPU; on the host the step's inputs grow (all K micro-batches
    are held for pass 2), which binds first at 1 TiB per 8-GPU node. The answer is the exact edge."""
    kw = dict(gpus=8, gpu_memory_gb=80, zero=3, precision="bf16", grad_checkpointing=True, loss="infonce_tiled")
    n = P.largest_batch("ViT-L-14", micro_batch=32, **kw)
    assert n >= 1_000_000 and n % (8 * 32) == 0
    at = P.make_plan("ViT-L-14", batch_size=n, **kw)
    assert at.fits and at.max_micro_batch >= 32 and at.memory_gb["total"] <= 80
    assert at.host_inputs_gb * 8 <= 1024
    # one more micro-batch of rows per GPU: the inputs no longer fit the node's RAM
    over = P.make_plan("ViT-L-14", batch_size=n + 8 * 32, **kw)
    assert not over.fits and over.host_inputs_gb * 8 > 1024
    assert any("does NOT fit the host" in note for note in over.notes)
    # with the host unbounded the GPU binds, far higher: the cache + ring buffers fill what is left
    gpu_only = P.largest_batch("ViT-L-14", micro_batch=32, host_memory_gb=1e9, **kw)
    assert gpu_only > 4 * n
    assert P.make_plan("ViT-L-14", batch_size=gpu_only + 8 * 32, host_memory_gb=1e9, **kw).max_micro_batch < 32
    # the global logit matrix (plain infonce) cannot get anywhere near it
    assert P.largest_batch("ViT-L-14", micro_batch=32, **{**kw, "loss": "infonce"}) < 200_000
    argv = ["--model", "ViT-L-14", "--gpus", "8", "--gpu-memory", "80", "--zero", "3", "--grad-checkpointing"]
    assert C.main_plan([*argv, "--loss", "infonce_tiled", "--max-batch"]) == 0
    assert f"largest contrastive batch: {n} " in capsys.readouterr().out


def test_step_inputs_and_one_graph_at_a_time_are_counted():
    """The gradient cache holds all K micro-batches of inputs (host); on the device pass 2 back-propagates
    the kept last chunk's graph first, so one micro-batch's graph is alive at a time, whatever K (the kept
    graph's saved activations sit beside the loss, below the backward peak)."""
    arch = A.load_arch("ViT-L-14")
    assert M.input_bytes(arch, 10) == 10 * (4 * 3 * 224 * 224 + 8 * 77)
    act = M.activation_bytes(arch, "bf16", True)
    assert act["saved"] <= act["peak"]
    assert M.held_activation_bytes(act, 32) == 32 * act["peak"]


def test_cpu_plan_predicts_phases_from_a_measured_baseline():
    """--device cpu: baseline + model states + inputs + the larger of the loss and pass-2 phases."""
    kw = dict(gpus=2, gpu_memory_gb=64, batch_size=65536, zero=2, precision="fp32", loss="infonce_tiled")
    p = P.make_plan("demo", device="cpu", baseline_gb=0.7, micro_batch=256, **kw)
    arch = A.load_arch("demo")
    m = p.memory_gb
    assert p.fits and p.micro_batch == 256 and p.accum_freq == 128
    assert m["baseline (measured)"] == 0.7
    assert m["inputs (K micro-batches)"] == pytest.approx(M.input_bytes(arch, 32768) / P.GiB, abs=1e-4)
    act = M.activation_bytes(arch, "fp32")
    loss_phase = 4 * 32768 * 128 * 4 + M.loss_bytes("infonce_tiled", 32768, 65536, 128, 4096) + 256 * act["saved"]
    pass2 = 2 * 32768 * 128 * 4 + M.held_activation_bytes(act, 256)
    states = sum(M.cpu_model_state_bytes(arch.params, 2, 2, "fp32").values())
    expect = 0.7 + (states + M.input_bytes(arch, 32768) + max(loss_phase, pass2)) / P.GiB
    assert m["total"] == pytest.approx(expect, abs=1e-3)
    from dsclip.config import ConfigError

    with pytest.raises(ConfigError, match="--baseline-gb"):
        P.make_plan("demo", device="cpu", micro_batch=256, **kw)
    with pytest.raises(ConfigError, match="ZeRO-1/2"):
        P.make_plan("demo", device="cpu", baseline_gb=0.7, micro_batch=256, **{**kw, "zero": 3})
    with pytest.raises(ConfigError, match="must divide"):
        P.make_plan("demo", device="cpu", baseline_gb=0.7, micro_batch=1000, **kw)


def test_no_batch_says_what_is_missing(capsys):
    # issue 32: without a batch the error used to say "..., not both"
    with pytest.raises(SystemExit) as e:
        C.main_plan(["--model", "ViT-H-14", "--gpus", "8", "--gpu-memory", "80"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no batch given: add --batch-size N" in err and "--global-batch N" in err and "--max-batch" in err
    assert "not both" not in err
    with pytest.raises(SystemExit):
        C.main_plan(["--model", "ViT-H-14", "--gpus", "8", "--global-batch", "64", "--max-batch"])
    assert "both given: keep one" in capsys.readouterr().err


def _plan_json(capsys, argv: list[str]) -> dict:
    import json

    rc = C.main_plan([*argv, "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == (0 if plan["fits"] else 1)
    return plan


def test_plan_takes_train_flag_names_with_train_meanings(capsys):
    """issue 33/31: --batch-size is the per-GPU micro-batch and --accum-freq the micro-batches per step, as in
    dsclip train; the contrastive batch is their product with the GPUs."""
    p = _plan_json(capsys, ["--model", "ViT-B-32", "--gpus", "8", "--batch-size", "64", "--accum-freq", "4"])
    assert p["batch_size"] == 2048 and p["local_batch"] == 256
    assert p["fits"] and p["micro_batch"] == 64 and p["accum_freq"] == 4
    # --accum-freq defaults to 1 as in dsclip train
    assert _plan_json(capsys, ["--model", "ViT-B-32", "--gpus", "8", "--batch-size", "64"])["batch_size"] == 512
    # the plan-only global batch: the plan picks the micro-batch, or derives it from --accum-freq
    g = _plan_json(capsys, ["--model", "ViT-B-32", "--gpus", "8", "--global-batch", "2048", "--accum-freq", "4"])
    assert g["micro_batch"] == 64 and g["accum_freq"] == 4
    # --deepspeed-config as in dsclip train: the stage (and, with auto, the precision) come from the JSON
    d = _plan_json(
        capsys,
        [
            "--model",
            "ViT-B-32",
            "--gpus",
            "8",
            "--batch-size",
            "8",
            "--deepspeed-config",
            "zero3_bf16",
            "--precision",
            "auto",
            "--force-patch-dropout",
            "0.5",
            "--no-grad-checkpointing",
        ],
    )
    assert d["zero"] == 3 and d["precision"] == "bf16" and d["patch_dropout"] == 0.5
    assert "--deepspeed-config zero3_bf16 " in d["command"]
    assert (
        _plan_json(capsys, ["--model", "ViT-B-32", "--gpus", "8", "--batch-size", "8", "--precision", "amp"])[
            "precision"
        ]
        == "fp16"
    )
    # every plan flag not marked plan-only is one of dsclip train's
    from dsclip.config import build_arg_parser

    train_flags = {o for act in build_arg_parser()._actions for o in act.option_strings}
    shared = [
        o
        for act in C.build_parser()._actions
        if act.help not in (None, "==SUPPRESS==")
        and not act.help.startswith("plan-only")
        and act.option_strings[0] != "-h"
        for o in act.option_strings
    ]
    assert {
        "--model",
        "--batch-size",
        "--accum-freq",
        "--precision",
        "--deepspeed-config",
        "--grad-checkpointing",
        "--force-patch-dropout",
        "--lock-image",
    } <= set(shared)
    assert [o for o in shared if o not in train_flags] == []


def test_old_plan_spellings_are_one_line_errors(capsys):
    base = ["--model", "ViT-B-32", "--gpus", "8"]
    for extra, expect in (
        (["--batch-size", "32768", "--micro-batch", "64"], "--batch-size is now the per-GPU micro-batch"),
        (["--micro-batch", "64"], "--micro-batch is now --batch-size"),
        (["--batch-size", "64", "--patch-dropout", "0.5"], "--patch-dropout is now --force-patch-dropout"),
    ):
        with pytest.raises(SystemExit) as e:
            C.main_plan([*base, *extra])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("dsclip plan: error: ") and expect in err, err
    # the old global meaning alone (32768 rows per GPU cannot fit): the plan says where the global batch went
    assert C.main_plan([*base, "--batch-size", "32768"]) == 1
    out, err = capsys.readouterr()
    assert err.strip() == f"dsclip plan: {C.BATCH_SIZE_MOVED}"
    assert "for the global batch use --global-batch" in out


@pytest.mark.parametrize("launcher", ["hostfile", "sbatch"])
def test_printed_command_runs_with_dsclip_trains_parser(capsys, launcher):
    """The recommended line is a ready command for the launcher asked for: dsclip train's parser takes its
    flags with the planned settings, and the data and tokenizer are placeholders to fill in."""
    from dsclip.config import build_arg_parser, parse_run_config

    argv = [
        "--model",
        "ViT-H-14",
        "--gpus",
        "32",
        "--batch-size",
        "512",
        "--accum-freq",
        "4",
        "--zero",
        "3",
        "--grad-checkpointing",
        "--loss",
        "infonce_tiled",
        "--deepspeed-config",
        "./ds_configs/zero3_bf16.json",
    ]
    assert C.main_plan([*argv, "--launcher", launcher]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    cmd = out[-1].strip()
    # what the placeholders leave to the user, said next to the command: the epoch size of unsized shards
    assert any(ln.startswith("note: ") and "--train-num-samples N" in ln and "sizes.json" in ln for ln in out)
    words = shlex.split(cmd)
    if launcher == "sbatch":
        assert cmd.startswith("RECIPE=dsclip/recipes/ViT-H-14.yaml sbatch --nodes=4 --ntasks-per-node=8 ")
        assert "--gpus-per-node=8" in words
        train = words[words.index("launch/slurm/train.sbatch") + 1 :]
    else:
        assert cmd.startswith("deepspeed --hostfile HOSTFILE --num_nodes 4 --num_gpus 8 --module dsclip train ")
        train = words[words.index("train") + 1 :]
    ns = build_arg_parser().parse_args(train)
    assert ns.model == "ViT-H-14" and int(ns.batch_size) * int(ns.accum_freq) * 32 == 65536  # raw strings here
    assert ns.train_data == "SHARDS/{00000..NNNNN}.tar" and ns.tokenizer == "open_clip:ViT-H-14"
    assert ns.deepspeed_config == "ds_configs/zero3_bf16.json"  # clean: no ./
    assert "./" not in cmd and " /" not in cmd
    cfg = parse_run_config([*train, "--name", "x"])
    assert cfg.train.batch_size == 512 and cfg.train.accum_freq == 4 and cfg.model.grad_checkpointing
    assert cfg.loss_name == "infonce_tiled" and cfg.train.precision == "bf16"


def test_clean_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert C.clean_path("./ds/x.json") == "ds/x.json"
    assert C.clean_path(str(tmp_path / "ds" / ".." / "x.json")) == "x.json"


FAKE_SRUN = """#!/usr/bin/env python3
import json, os, sys
json.dump(sys.argv[1:], open(os.environ["FAKE_OUT"], "w"))
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && echo node1
exit 0
"""


def _sbatch_train_argv(cmd: str, tmp_path) -> list[str]:
    """What launch/slurm/train.sbatch hands `dsclip train` for the printed `VAR=... sbatch OPTS SCRIPT FLAGS`:
    the script itself runs, with a stand-in srun (records its argv) and scontrol first on PATH."""
    import json
    import os
    import subprocess

    words = shlex.split(cmd)
    env_words = [w for w in words[: words.index("sbatch")] if "=" in w]
    flags = words[words.index(C.SBATCH_SCRIPT) + 1 :]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RECIPE", "DS_CONFIG", "NAME")},
        **dict(w.split("=", 1) for w in env_words),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_OUT": str(tmp_path / "srun.json"),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "dsclip",
        "SLURM_SUBMIT_DIR": str(P.ROOT),
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_NNODES": "1",
        "DSCLIP_REPO": str(P.ROOT),
        "LOGS": str(tmp_path / "logs"),
    }
    r = subprocess.run(
        ["bash", str(P.ROOT / C.SBATCH_SCRIPT), *flags], env=env, cwd=P.ROOT, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
    srun = json.loads((tmp_path / "srun.json").read_text())
    return srun[[i for i, w in enumerate(srun) if w.endswith("srun_dsclip.sh")][0] + 1 :]


@pytest.mark.parametrize("launcher", ["sbatch", "hostfile"])
@pytest.mark.parametrize("model", ["ViT-B-16", "tiny", "ViT-B-32"])
def test_printed_command_with_demo_data_passes_dsclip_trains_checks(tmp_path, capsys, monkeypatch, launcher, model):
    """The printed command, its placeholders replaced by demo shards (and the demo tokenizer where it asks for a
    sentencepiece model), is taken by dsclip train's parser and its checks before the process group. The
    batch script's own argv is used for sbatch (RECIPE included); a model without a recipe gets RECIPE=none,
    not the demo recipe the script would fall back to; a non-OpenCLIP model gets the sentencepiece placeholder."""
    from dsclip.config import parse_run_config
    from dsclip.data.demo import ensure_demo_tokenizer
    from dsclip.train import preflight
    from tests.e2e.test_train_cli import write_val_shards

    # the loss and checkpointing fixed: the recipe's settings must be switched off where the plan's differ
    fixed = ["--loss", "infonce", "--no-grad-checkpointing"]
    assert C.main_plan(["--model", model, "--gpus", "16", "--batch-size", "64", "--launcher", launcher, *fixed]) == 0
    cmd = capsys.readouterr().out.strip().splitlines()[-1].strip()
    recipe = C.recipe_for(model)
    assert (recipe is None) == (model == "ViT-B-16")  # the models shipped with a recipe
    if launcher == "sbatch":
        assert cmd.startswith(f"RECIPE={recipe or 'none'} sbatch --nodes=2 ")
        argv = _sbatch_train_argv(cmd, tmp_path)
    else:
        words = shlex.split(cmd)
        argv = words[words.index("dsclip") + 1 :]
        assert ("--config" in argv) == (recipe is not None)  # the same settings as the sbatch line
    assert argv[0] == "train"
    expect_tok = C.SPM if model == "tiny" else None
    tok = argv[argv.index("--tokenizer") + 1]
    assert tok == expect_tok or (expect_tok is None and tok in (f"open_clip:{model}", C.SPM))
    assert argv[argv.index("--train-data") + 1] == C.SHARDS

    shards = write_val_shards(tmp_path / "shards")
    demo_tok = str(ensure_demo_tokenizer(tmp_path / "tok"))
    argv = [{C.SHARDS: shards, C.SPM: demo_tok}.get(w, w) for w in argv[1:]]
    if "--name" not in argv:
        argv += ["--name", "x", "--logs", str(tmp_path / "logs")]
    monkeypatch.chdir(P.ROOT)  # recipes and DeepSpeed JSONs are named relative to the repo, as printed
    cfg = parse_run_config(argv)
    assert cfg.model.model == model and cfg.train.batch_size == 64 and cfg.train.precision == "bf16"
    assert cfg.data.train_data == shards
    # the planned settings, whatever the recipe says (ViT-B-32.yaml turns on --local-loss: the plan's infonce)
    assert cfg.loss_name == "infonce" and not cfg.model.grad_checkpointing
    if recipe is None:
        assert cfg.optim.lr == 5.0e-4 and cfg.optim.warmup == 10000  # dsclip train's (OpenCLIP's) defaults
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # bf16 is checked against the CPU here
    preflight.check(cfg)


def test_zero3_with_torchs_linear_counts_the_weights_held_to_their_backward():
    """The shipped ZeRO-3 JSONs run torch's F.linear (memory_efficient_linear: false), whose saved weight view
    keeps each released gathered weight until its backward: without checkpointing, on more than one GPU, the
    whole model's 16-bit weights (bench/zero3_held_weights.py measures it on two CPU ranks)."""
    name, shipped = P.shipped_ds_config(3, "bf16")
    assert shipped["zero_optimization"]["memory_efficient_linear"] is False, name
    deepspeeds = {"zero_optimization": {"stage": 3}}  # DeepSpeed's default: its autograd linear
    n = 1_000_000
    assert M.held_weight_bytes(n, 8, 3, "bf16", False, shipped) == 2 * n
    assert M.held_weight_bytes(n, 8, 3, "fp32", False, shipped) == 4 * n
    for args in ((8, 3, "bf16", True, shipped), (1, 3, "bf16", False, shipped), (8, 2, "bf16", False, shipped)):
        assert M.held_weight_bytes(n, *args) == 0, args  # checkpointing, one GPU, ZeRO-2
    assert M.held_weight_bytes(n, 8, 3, "bf16", False, deepspeeds) == 0
    # in the plan: a line of its own, in the total; with checkpointing autograd holds none, but ZeRO-3's
    # coordinator keeps the same copies for their reuse (kept_weight_bytes: under 1e9 parameters, all of them)
    kw = dict(gpus=8, gpu_memory_gb=80, batch_size=256, zero=3, loss="infonce_tiled")
    plain = P.make_plan("ViT-L-14", **kw)
    held = plain.memory_gb["held_weights (torch's linear)"]
    assert held == pytest.approx(2 * A.load_arch("ViT-L-14").params / P.GiB, rel=1e-3)
    assert "kept_weights (ZeRO-3 reuse)" not in plain.memory_gb  # the same copies: counted once
    ckpt = P.make_plan("ViT-L-14", grad_checkpointing=True, **kw)
    assert "held_weights (torch's linear)" not in ckpt.memory_gb
    assert ckpt.memory_gb["kept_weights (ZeRO-3 reuse)"] == pytest.approx(held, abs=1e-3)
    shipped3 = P.shipped_ds_config(3, "bf16")[1]
    assert M.kept_weight_bytes(2 * 10**9, 8, 3, "bf16", shipped3) == 2 * 1e9  # max live / reuse distance: 1e9
    assert M.kept_weight_bytes(n, 1, 3, "bf16", shipped3) == M.kept_weight_bytes(n, 8, 2, "bf16", shipped3) == 0
    states = sum(v for k, v in plain.memory_gb.items() if k in ("params", "grads", "optimizer", "gathered_layers"))
    assert plain.memory_gb["total"] >= states + held


def test_gpu_plan_counts_the_gradient_caches_whole_grads():
    """dsclip's step holds the whole 16-bit .grad on every rank until its one coalesced reduction (ZeRO-2 and
    ZeRO-3 alike: tests/dist/test_coalesced_grads.py), so the GPU plan counts 2 B x trainable params plus the
    16-bit partition made at the boundary, not DeepSpeed's 6 B x P / N; at world 1 DeepSpeed's 6 B x P is
    the larger and stays; offloaded partitions leave the whole .grad on the GPU; locked parameters none."""
    from dsclip.model.lock import LockConfig

    kw = dict(batch_size=4096, loss="infonce_tiled", grad_checkpointing=True, grad_reduction="coalesced")
    t = A.load_arch("ViT-bigG-14").trainable_params
    for zero in (2, 3):
        p = P.make_plan("ViT-bigG-14", gpus=32, gpu_memory_gb=80, zero=zero, **kw)
        assert "grads" not in p.memory_gb  # DeepSpeed's partitioned count is replaced, not added to
        assert p.memory_gb[M.GRADS_LINE] == pytest.approx((2 * t + 2 * t / 32) / P.GiB, abs=1e-3)
        ds = M.model_state_bytes(t, 32, zero, "bf16")["grads"]
        assert p.memory_gb[M.GRADS_LINE] - ds / P.GiB > 4.4  # the gap the issue measured (2 P (1 - 1/N) = 4.4 GiB)
    one = P.make_plan(
        "ViT-bigG-14", gpus=1, gpu_memory_gb=141, zero=2, micro_batch=1, batch_size=1, grad_reduction="coalesced"
    )
    assert one.memory_gb[M.GRADS_LINE] == pytest.approx(6 * t / P.GiB, abs=1e-3)  # unchanged at world 1
    z1 = P.make_plan("ViT-bigG-14", gpus=32, gpu_memory_gb=80, zero=1, **kw)
    assert z1.memory_gb["grads"] == pytest.approx(6 * t / P.GiB, abs=1e-3)  # ZeRO-1: already whole
    _, cfg = P.shipped_ds_config(2, "bf16")
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    off = P.make_plan("ViT-bigG-14", gpus=8, gpu_memory_gb=80, zero=2, ds_config=("x", cfg), **kw)
    assert off.memory_gb[M.GRADS_LINE] == pytest.approx(2 * t / P.GiB, abs=1e-3)  # partitions on the host
    assert off.host_offload_gb == pytest.approx((6 + 12) * t / 8 / P.GiB, abs=1e-3)
    lit = P.make_plan("ViT-bigG-14", gpus=32, gpu_memory_gb=80, zero=2, lock=LockConfig(lock_image=True), **kw)
    assert lit.memory_gb[M.GRADS_LINE] == pytest.approx(2 * lit.trainable_params * (1 + 1 / 32) / P.GiB, abs=1e-3)
    whole_saved = (
        2 * (lit.params - lit.trainable_params) * (1 + 1 / 32) + (12 * (lit.params - lit.trainable_params)) / 32
    )
    assert lit.locked_saving_gb == pytest.approx(whole_saved / P.GiB, abs=2e-3)


def test_gpu_plan_counts_the_sharded_reductions_fp32_partition():
    """--grad-reduction sharded: each chunk reduced into an fp32 partition (4 B x trainable / N, measured by
    tests/unit/test_plan_comm.py), K reductions inside the backwards; auto keeps the faster that fits and notes
    the other; a 16-bit coalesced plan with K > 1 is refused as dsclip train refuses it."""
    kw = dict(batch_size=4096, loss="infonce_tiled", grad_checkpointing=True)
    t = A.load_arch("ViT-bigG-14").trainable_params
    for zero in (2, 3):
        p = P.make_plan("ViT-bigG-14", gpus=32, gpu_memory_gb=80, zero=zero, grad_reduction="sharded", **kw)
        assert p.grad_reduction == "sharded" and M.GRADS_LINE not in p.memory_gb
        assert p.memory_gb[M.SHARDED_GRADS_LINE] == pytest.approx(4 * t / 32 / P.GiB, abs=1e-3)
        k = p.accum_freq
        assert p.comm_bytes[("reduce" if zero == 2 else "reduce_scatter") + " in backward"] == k * 2 * t
        auto = P.make_plan("ViT-bigG-14", gpus=32, gpu_memory_gb=80, zero=zero, **kw)
        assert set(auto.reductions) == {"sharded", "coalesced"}
        assert any(n.startswith("--grad-reduction ") for n in auto.notes)
    refused = P.make_plan("ViT-bigG-14", gpus=8, gpu_memory_gb=40, zero=2, batch_size=32768, grad_reduction="coalesced")
    assert refused.accum_freq > 1 and not refused.fits
    assert any("refused by dsclip train" in n and "--grad-reduction sharded" in n for n in refused.notes)


def test_bucket_bytes_are_the_buffers_deepspeed_allocates():
    """DeepSpeed 0.19's reduction buffers, per branch (the rehearsal's peak checks the sum at world 8 and 64:
    tests/unit/test_plan_comm.py): ZeRO-1/2 one reduce bucket per dtype, two with overlap_comm (default off
    below ZeRO-3), none for the all-gather; ZeRO-3 one, plus its gathers' flat buffers up to the prefetch; ZeRO-1
    bf16 with K > 1 (BF16_Optimizer) the engine's flat fp32 copy of at most 5e8 gradient elements; fp16 there fp32
    buckets."""
    from dsclip.plan.memory import bucket_bytes

    z2 = {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 100}}
    z2["zero_optimization"]["allgather_bucket_size"] = 7
    assert bucket_bytes(z2, "bf16") == 2 * 2 * 100 and bucket_bytes(z2, "fp32") == 4 * 2 * 100
    assert bucket_bytes({"zero_optimization": {"stage": 2, "reduce_bucket_size": 100}}, "bf16") == 2 * 100
    z3 = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 100, "stage3_prefetch_bucket_size": 9}}
    assert bucket_bytes(z3, "bf16", params=5) == 2 * (100 + 5)  # + the gathers in flight: the prefetch bucket's
    assert bucket_bytes(z3, "bf16", params=50) == 2 * (100 + 9)
    z1 = {"zero_optimization": {"stage": 1}}
    assert bucket_bytes(z1, "bf16", accum_freq=1) == 2 * 5e8  # DeepSpeed's default bucket
    assert bucket_bytes(z1, "bf16", accum_freq=2, trainable_params=1000) == 4 * 1000
    assert bucket_bytes(z1, "bf16", accum_freq=2, trainable_params=10**10) == 4 * 5e8
    assert bucket_bytes(z1, "fp16", accum_freq=2) == 4 * 5e8
    assert bucket_bytes({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}, "bf16") == 0
    assert bucket_bytes({}, "bf16") == 0


def test_coalesced_k1_peak_is_the_larger_of_its_whole_grad_and_its_activations():
    """Coalesced at K = 1 (ZeRO-2/3), the whole .grad builds up in the one backward as the activations and held
    weights are released: the plan counts the larger, not the sum (measured on ViT-B-32 at world 8 under the
    fake group: tests/unit/test_plan_comm.py). At K > 1 the chunks re-forward beside the summed gradient: both.
    ZeRO-3 with torch's linear: the gathered layers in flight are among the held weights, counted once."""
    kw = dict(gpus=8, gpu_memory_gb=80, zero=3, loss="infonce_tiled", grad_reduction="coalesced", precision="fp32")
    one = P.make_plan("ViT-B-32", batch_size=8 * 4, micro_batch=4, **kw)
    two = P.make_plan("ViT-B-32", batch_size=8 * 8, micro_batch=4, **kw)
    m1, m2 = one.memory_gb, two.memory_gb
    grads = next(v for k, v in m1.items() if k.startswith("grads"))
    others = m1["held_weights (torch's linear)"] + m1["activations"]
    assert m1["grads/activations not at once (K = 1)"] == pytest.approx(-min(grads, others), abs=2e-3)
    assert "grads/activations not at once (K = 1)" not in m2
    for m in (m1, m2):
        assert m["gathered layers, within held weights"] == -m["gathered_layers"]
    assert one.tensor_bytes < two.tensor_bytes - 0.9 * min(grads, others) * 2**30
    sharded = P.make_plan("ViT-B-32", batch_size=8 * 4, micro_batch=4, **{**kw, "grad_reduction": "sharded"})
    assert "grads/activations not at once (K = 1)" not in sharded.memory_gb


def test_the_async_saves_host_copy_is_counted_and_turned_off_where_it_does_not_fit():
    """--async-save copies each rank's checkpoint state to host memory (DeepSpeed's files: 12 B/param of fp32
    weights and Adam moments over the ranks, + the bf16 module on one rank). The planner counts it against
    --host-memory; where only the copy does not fit, the plan's command trains with --no-async-save."""
    kw = dict(gpus=8, gpu_memory_gb=80, batch_size=8 * 32, zero=2, precision="bf16", micro_batch=32)
    roomy = P.make_plan("ViT-L-14", **kw)
    assert roomy.host_checkpoint_gb == pytest.approx(12 * roomy.params / 8 / 2**30, abs=1e-3)
    assert roomy.host_checkpoint_module_gb == pytest.approx(2 * roomy.params / 2**30, abs=1e-3)
    assert roomy.async_save and "--no-async-save" not in roomy.command
    step_only = (roomy.host_inputs_gb + roomy.host_offload_gb) * 8
    tight = P.make_plan("ViT-L-14", host_memory_gb=step_only + 0.5, **kw)  # the step fits, its copy does not
    assert tight.fits and not tight.async_save and "--no-async-save" in tight.command
    assert any("asynchronous save's host copy" in note for note in tight.notes)
