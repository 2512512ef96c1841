"""Fine-tuning from OpenCLIP models through the CLI, offline: a local Hugging Face cache written here
stands in for the hub (``HF_HUB_OFFLINE=1``).

- docs/finetuning.md's "Fine-tune an OpenCLIP model" commands, run as written (paths substituted): LiT from an
  ``hf-hub:`` model on webdataset shards at a new resolution (32 -> 48 px), export, OpenCLIP loads the
  export and gives dsclip's embeddings, ImageNet-style zero-shot with built-in class names;
- a sentencepiece-trained run (the demo's BPE tokenizer, and a ``dsclip tokenizer train`` unigram one)
  exported with ``--format open_clip``: OpenCLIP's own ``get_tokenizer("local-dir:EXPORT")`` gives
  dsclip's ids and the embeddings match;
- bad input: one-line errors before training, exit code non-zero, no checkpoint in the run folder.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.e2e.test_train_cli import ROOT, env, run_cli_cases
from tests.tolerances import embedding_tol

open_clip = pytest.importorskip("open_clip")
pytest.importorskip("transformers")

PY = sys.executable
HUB_REPO = "dsclip-test/tiny-clip"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ABSENT = ("config.json", "added_tokens.json", "chat_template.json", "chat_template.jinja", "processor_config.json")
CAPTIONS = ["a small red star on the left", "a big blue circle", "two green triangles at the top right"]
# real ImageNet-1k WordNet ids (tench, goldfish, great white shark) and their OpenCLIP names
WNIDS = {"n01440764": "tench", "n01443537": "goldfish", "n01484850": "great white shark"}


def assert_same_embeddings(got: torch.Tensor, want: torch.Tensor, cfg: dict) -> None:
    """Within rounding over the forward pass (tests/tolerances.embedding_tol) and within the issue's 1e-5."""
    torch.testing.assert_close(got, want, atol=embedding_tol(cfg, float(want.abs().max())), rtol=0)
    assert (got - want).abs().max() <= 1e-5


def hf_repo_dir(cache: Path, repo: str) -> Path:
    """The snapshot folder of ``repo`` in a Hugging Face hub cache (what huggingface_hub reads offline)."""
    d = cache / ("models--" + repo.replace("/", "--"))
    (d / "refs").mkdir(parents=True, exist_ok=True)
    (d / "refs" / "main").write_text(COMMIT)
    snap = d / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    # files the hub is known not to have (what huggingface_hub records after a 404): transformers probes them
    absent = d / ".no_exist" / COMMIT
    absent.mkdir(parents=True, exist_ok=True)
    for name in ABSENT:
        (absent / name).touch()
    return snap


def demo_tokenizer_path() -> str:
    from dsclip.data.demo import ensure_demo_tokenizer

    return ensure_demo_tokenizer(Path(os.environ.get("DSCLIP_CACHE", Path.home() / ".cache" / "dsclip")))


def write_hub_model(cache: Path, seed: int = 0):
    """A tiny 32 px CLIP with the demo tokenizer, published the way OpenCLIP hub models are:
    open_clip_config.json (text_cfg.hf_tokenizer_name = the repo) + open_clip_model.safetensors +
    Hugging Face tokenizer files."""
    from dsclip.data.hf_tokenizer import write_hf_tokenizer
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.model import create_model, export_openclip

    tok = SentencePieceTokenizer(demo_tokenizer_path(), 32)
    torch.manual_seed(seed)
    model = create_model(
        "tiny", vocab_size=tok.vocab_size, eos_id=tok.eos_id, pad_id=tok.pad_id, context_length=32
    ).eval()
    snap = hf_repo_dir(cache, HUB_REPO)
    export_openclip(model.state_dict(), model.config, snap)
    write_hf_tokenizer(tok.model_path, snap, 32)
    cfg = json.loads((snap / "open_clip_config.json").read_text())
    cfg["model_cfg"]["text_cfg"]["hf_tokenizer_name"] = HUB_REPO
    (snap / "open_clip_config.json").write_text(json.dumps(cfg))
    return model, tok


def write_demo_shards(out: Path, n: int = 64, image_size: int = 48) -> str:
    from PIL import Image

    from dsclip.data.demo import DemoDataset
    from dsclip.data.tools import write_shards

    ds = DemoDataset(n, image_size=image_size, seed=3)
    (out / "img").mkdir(parents=True)
    samples = []
    for i in range(n):
        p = out / "img" / f"{i}.png"
        Image.fromarray(ds.render(i)).save(p)
        samples.append((str(p), ds.caption(i)))
    write_shards(samples, out / "shards", shard_size=32, progress=False)
    return str(out / "shards" / "shard-{00000..00001}.tar")


def write_imagenet_val(root: Path, image_size: int = 48) -> Path:
    from PIL import Image

    from dsclip.data.demo import DemoDataset

    ds = DemoDataset(6, image_size=image_size, seed=5)
    for i, wnid in enumerate(sorted(WNIDS) * 2):
        (root / wnid).mkdir(parents=True, exist_ok=True)
        Image.fromarray(ds.render(i)).save(root / wnid / f"ILSVRC2012_val_{i:08d}.JPEG", format="JPEG")
    return root


def hub_env(cache: Path) -> dict:
    e = env()
    e.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return e


def sh(cmd: str, e: dict, cwd: Path, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess:
    """One README command line, run as a user would type it (``dsclip`` = this checkout's CLI)."""
    argv = shlex.split(cmd)
    if argv[0] == "dsclip":
        argv = [PY, "-m", "dsclip", *argv[1:]]
    elif argv[0] == "python":
        argv[0] = PY
    p = subprocess.run(argv, cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def readme_section_commands() -> list[str]:
    """The shell commands of docs/finetuning.md's "Fine-tune an OpenCLIP model" section, continuation lines
    joined."""
    text = (ROOT / "docs" / "finetuning.md").read_text()
    section = text.split("## Fine-tune an OpenCLIP model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip() if not line.strip().startswith("python -c") else line.strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()) if not line.startswith("python -c") else line)
    return commands


def test_readme_finetune_section_runs_offline(tmp_path):
    """LiT from an hf-hub model, 32 -> 48 px, webdataset shards; export; OpenCLIP loads it; zero-shot."""
    cache = tmp_path / "hf"
    hub_model, hub_tok = write_hub_model(cache)
    shards = write_demo_shards(tmp_path)
    imagenet = write_imagenet_val(tmp_path / "imagenet" / "val")
    subst = {
        "/data/shards/{00000..00099}.tar": shards,
        "--train-num-samples 1000000": "--train-num-samples 64",
        "hf-hub:laion/CLIP-ViT-B-32-laion2B-s34B-b79K": f"hf-hub:{HUB_REPO}",
        "--force-image-size 288": "--force-image-size 48",
        "/data/imagenet/val": str(imagenet),
        "--cache-dir ~/.cache/open_clip": f"--cache-dir {cache}",
        "--batch-size 256": "--batch-size 8",
        "--workers 8": "--workers 0",
        "--epochs 5": "--epochs 1",
        "--deepspeed-config ds_configs/zero2_bf16.json": "--deepspeed-config ds_configs/zero2_fp32.json",
        "--logs ./logs": f"--logs {tmp_path / 'logs'}",
        "logs/lit-b32": str(tmp_path / "logs" / "lit-b32"),
        "lit-b32-openclip": str(tmp_path / "lit-b32-openclip"),
    }
    commands = readme_section_commands()
    assert len(commands) >= 4, commands
    e = hub_env(cache)
    outputs = []
    for cmd in commands:
        for a, b in subst.items():
            cmd = cmd.replace(a, b)
        if "--pretrained laion2b" in cmd or "open_clip:ViT-B-32/" in cmd:
            continue  # the pretrained-tag variants need the real ViT-B-32 download (resolution: see below)
        outputs.append((cmd, sh(cmd, e, tmp_path)))
    train_out = next(p.stdout for c, p in outputs if " train " in f" {c} ")
    assert f"tokenizer open_clip:hf-hub:{HUB_REPO}" in train_out  # chosen automatically
    assert re.search(r"trainable [\d,]+ of [\d,]+ params \([\d,]+ locked", train_out), train_out
    export = tmp_path / "lit-b32-openclip"

    # the export: 48 px, the image tower the hub's (locked; positions resampled by timm), the text tower trained
    from timm.layers import resample_abs_pos_embed

    from dsclip.model import load_model

    ds = load_model(export)
    assert ds.image_size == 48 and ds.visual.pos_embed.shape[1] == 1 + 36
    ref = hub_model.state_dict()
    got = ds.state_dict()
    for n, v in ref.items():
        if n == "visual.pos_embed":
            want = resample_abs_pos_embed(v, new_size=[6, 6], num_prefix_tokens=1)
            torch.testing.assert_close(got[n], want, atol=1e-6, rtol=0)
        elif n.startswith("visual."):
            assert torch.equal(got[n], v), n
    assert not torch.equal(got["text.text_projection"], ref["text.text_projection"])

    # OpenCLIP loads it at 48 px with its own tokenizer: same ids as the demo sentencepiece model, same embeddings
    oc, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{export}")
    oc_tok = open_clip.get_tokenizer(f"local-dir:{export}")
    assert torch.equal(oc_tok(CAPTIONS), hub_tok(CAPTIONS))
    images = torch.randn(3, 3, 48, 48, generator=torch.Generator().manual_seed(0))
    oc.eval()
    with torch.no_grad():
        assert_same_embeddings(ds.encode_image(images, normalize=False), oc.encode_image(images), ds.config)
        toks = hub_tok(CAPTIONS)
        assert_same_embeddings(ds.encode_text(toks, normalize=False), oc.encode_text(toks), ds.config)
    eval_out = next(p.stdout for c, p in outputs if c.startswith("dsclip eval"))
    assert "zeroshot-top1" in eval_out


def _train_convert_compare(tmp_path, extra: list[str], tokenizer_path: str | None):
    from dsclip.data.tokenizer import SentencePieceTokenizer
    from dsclip.model import load_model

    logs, export = tmp_path / "logs", tmp_path / "export"
    args = ["train", "--config", "tiny", "--max-steps", "2", "--logs", str(logs), "--name", "r", *extra]
    sh(shlex.join(["dsclip", *args]), env(), ROOT)
    _convert(logs / "r", "--format", "open_clip", "-o", export)
    cfg = json.loads((export / "open_clip_config.json").read_text())
    assert cfg["model_cfg"]["text_cfg"]["hf_tokenizer_name"]
    tok = SentencePieceTokenizer(tokenizer_path or str(export / "tokenizer.model"), 32)
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{export}")
    oc_tok = open_clip.get_tokenizer(f"local-dir:{export}")
    texts = CAPTIONS + ["  Extra   spaces and UPPER case  ", "a " + "long " * 60 + "caption", "café ☃ 漢字"]
    ids = tok(texts)
    assert torch.equal(oc_tok(texts), ids)
    assert ids.max() < tok.vocab_size <= 1000  # the sentencepiece vocabulary, not OpenCLIP's BPE (49407)
    ds = load_model(export)
    oc.eval()
    with torch.no_grad():
        assert_same_embeddings(ds.encode_text(ids, normalize=False), oc.encode_text(oc_tok(texts)), ds.config)


def test_demo_run_export_tokenizes_and_embeds_like_dsclip_in_openclip(tmp_path):
    _train_convert_compare(tmp_path, [], demo_tokenizer_path())


def test_trained_tokenizer_run_export_tokenizes_and_embeds_like_dsclip_in_openclip(tmp_path):
    from dsclip.data.demo import DemoDataset

    ds = DemoDataset(600, image_size=32, seed=1)
    (tmp_path / "captions.txt").write_text("\n".join(ds.caption(i) for i in range(600)) + "\n")
    prefix = tmp_path / "spm" / "clip"
    sh(f"dsclip tokenizer train --input {tmp_path / 'captions.txt'} --out {prefix} --vocab-size 120", env(), ROOT)
    _train_convert_compare(tmp_path, ["--tokenizer", f"{prefix}.model"], f"{prefix}.model")


# --- bad input ------------------------------------------------------------------------------------------
def _bad(tmp_path, args: list[str], e: dict | None = None) -> str:
    run = tmp_path / "logs" / "bad"
    cmd = ["dsclip", "train", "--config", "tiny", "--logs", str(tmp_path / "logs"), "--name", "bad", *args]
    p = sh(shlex.join(cmd), e or env(), ROOT, check=False)
    assert p.returncode != 0, p.stdout
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not (run / "checkpoints").exists() and not list(run.rglob("*model_states.pt"))
    return errors[0]


def test_bad_input_is_one_line_before_training(tmp_path):
    cache = tmp_path / "hf"
    write_hub_model(cache)
    e = hub_env(cache)
    # one case as a real `dsclip train` process (the exit path a user sees)
    msg = _bad(tmp_path, ["--model", "ViT-B-32", "--pretrained", "laion2b_no_such_tag"], e)
    assert "neither a file nor an OpenCLIP tag of ViT-B-32" in msg and "laion2b_s34b_b79k" in msg and "openai" in msg
    # a tag resolved through OpenCLIP's registry to the (offline) cache, whose weights are another architecture:
    # the tiny hub model placed where open_clip.download_pretrained looks for ViT-B-32/laion2b_s34b_b79k
    snap = hf_repo_dir(cache, "laion/CLIP-ViT-B-32-laion2B-s34B-b79K")
    (snap / "open_clip_model.safetensors").symlink_to(hf_repo_dir(cache, HUB_REPO) / "open_clip_model.safetensors")
    spec = "open_clip:ViT-B-32/laion2b_s34b_b79k"  # the architecture named by the spec, not by --model
    cases = {
        "hub_missing": (["--pretrained", "hf-hub:dsclip-test/no-such-model"], "hf-hub:dsclip-test/no-such-model"),
        "unlocked_groups": (
            ["--lock-image", "--lock-image-unlocked-groups", "5"],
            "--lock-image-unlocked-groups 5 is out of range: the image tower has 4 groups",
        ),
        "all_locked": (["--lock-image", "--lock-text", "--lock-text-freeze-layer-norm"], "nothing is left to train"),
        "tag_other_arch": (
            ["--model", "ViT-B-32", "--pretrained", "laion2b_s34b_b79k", "--cache-dir", str(cache)],
            "first mismatch visual.",
        ),
        "spec_other_arch": (["--pretrained", spec, "--cache-dir", str(cache)], "first mismatch visual."),
    }
    # the others in one process (the same CLI entry point, without five more interpreters importing torch)
    logs = ["--config", "tiny", "--logs", str(tmp_path / "logs"), "--name", "bad"]
    results = run_cli_cases({name: ["train", *logs, *argv] for name, (argv, _) in cases.items()}, e)
    for name, (_, expect) in cases.items():
        rc, err = results[name]
        errors = [ln for ln in err.splitlines() if "error:" in ln]
        assert rc != 0 and len(errors) == 1 and expect in errors[0], (name, err[-3000:])
    assert not (tmp_path / "logs" / "bad" / "checkpoints").exists()
    msg = [ln for ln in results["tag_other_arch"][1].splitlines() if "error:" in ln][0]
    assert re.search(
        r"do not fit --model ViT-B-32: first mismatch visual\.\S+: file \(64,?\) vs model \(768,?\)", msg
    ), msg
    assert str(snap) in msg  # resolved by OpenCLIP's registry + hub download, offline


def _convert(*args):
    """`dsclip convert ARGS` in this process: the same entry point without another interpreter importing
    torch and DeepSpeed (the command line itself is run by test_readme_finetune_section_runs_offline)."""
    from dsclip.checkpoint.convert import main_convert

    assert main_convert([str(a) for a in args]) == 0


@pytest.mark.dist
@pytest.mark.parametrize("ds_config", ["zero2_fp32", "zero3_fp32"])
def test_locked_run_checkpoints_resumes_and_converts_every_weight(tmp_path, ds_config):
    """2 ranks, LiT with a partly unlocked text tower: the ZeRO checkpoint (frozen parameters included)
    converts to every weight, the locked ones bit-identical across steps and resume; resume reproduces
    the uninterrupted losses."""
    from safetensors.torch import load_file

    from tests.e2e.test_train_cli import losses, run_cli

    common = [
        "train",
        "--config",
        "tiny",
        "--logs",
        str(tmp_path),
        "--deepspeed-config",
        f"ds_configs/{ds_config}.json",
    ]
    common += ["--max-steps", "4", "--save-every-n-steps", "2", "--batch-size", "8", "--accum-freq", "2"]
    common += ["--lock-image", "--lock-text", "--lock-text-unlocked-layers", "1", "--warmup", "1"]
    full = run_cli(common + ["--name", "full"], world=2)
    assert re.search(r"trainable [\d,]+ of [\d,]+ params", full.stdout)
    curve = losses(tmp_path / "full")
    run_cli(
        common + ["--name", "resumed", "--resume", str(tmp_path / "full" / "checkpoints" / "step_000000002")], world=2
    )
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for step, value in resumed.items():
        assert value == pytest.approx(curve[step], abs=1e-5), (step, value, curve[step])
    weights = {}
    for tag in ("step_000000002", "step_000000004"):
        out = tmp_path / f"export-{tag}"
        _convert(tmp_path / "full", "--tag", tag, "-o", out)
        weights[tag] = load_file(str(out / "model.safetensors"))
    _convert(tmp_path / "resumed", "-o", tmp_path / "export-resumed")
    resumed_w = load_file(str(tmp_path / "export-resumed" / "model.safetensors"))
    a, b = weights["step_000000002"], weights["step_000000004"]
    from dsclip.model import create_model

    assert set(a) == set(create_model("tiny", device="meta").state_dict())  # every weight, locked or not
    from dsclip.model.lock import LockConfig, apply_locking

    meta = create_model("tiny", device="meta")  # which names the flags lock (groups: tests/unit/test_lock.py)
    apply_locking(meta, LockConfig(lock_image=True, lock_text=True, lock_text_unlocked_layers=1))
    unlocked = {n for n, p in meta.named_parameters() if p.requires_grad}
    assert "text.text_projection" in unlocked and "text.ln_final.weight" in unlocked  # LNs: no freeze flag
    for n in a:
        trainable = n in unlocked
        assert torch.equal(a[n], b[n]) != trainable, n
        torch.testing.assert_close(resumed_w[n], b[n], atol=1e-5, rtol=0)
        if not trainable:
            assert torch.equal(resumed_w[n], b[n]), n


@pytest.mark.dist
def test_locked_run_resumes_on_another_world_size_with_locked_weights_intact(tmp_path):
    """Saved on 2 ranks, resumed on 1 (DeepSpeed universal checkpoint): frozen parameters come back
    bit-identical and stay so; the trainable ones keep training."""
    from safetensors.torch import load_file

    from tests.e2e.test_train_cli import run_cli

    common = ["train", "--config", "tiny", "--logs", str(tmp_path), "--name", "u", "--batch-size", "8"]
    common += ["--deepspeed-config", "ds_configs/zero2_fp32.json", "--save-every-n-steps", "2", "--lock-image"]
    run_cli(common + ["--max-steps", "2"], world=2)
    second = run_cli(common + ["--max-steps", "6", "--resume", "latest"], world=1)
    assert "resumed from" in second.stdout and "universal" in second.stdout
    w = {}
    for tag in ("step_000000002", "step_000000006"):
        _convert(tmp_path / "u", "--tag", tag, "-o", tmp_path / tag)
        w[tag] = load_file(str(tmp_path / tag / "model.safetensors"))
    a, b = w["step_000000002"], w["step_000000006"]
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("visual."))
    assert all(not torch.equal(a[k], b[k]) for k in a if k.startswith("text.") and "blocks" in k)


@pytest.mark.dist
def test_zero3_two_ranks_loads_resamples_and_locks_pretrained(tmp_path):
    """ZeRO-3 (parameters partitioned at construction, loaded module by module on rank 0): an hf-hub model
    at 48 px with the image tower locked; the export has the hub's image tower, positions resampled."""
    from timm.layers import resample_abs_pos_embed

    from dsclip.model import load_model
    from dsclip.testing.gloo_world import free_port
    from tests.e2e.test_train_cli import DEEPSPEED

    cache = tmp_path / "hf"
    hub_model, _ = write_hub_model(cache)
    e = hub_env(cache)
    args = ["--pretrained", f"hf-hub:{HUB_REPO}", "--force-image-size", "48", "--lock-image", "--max-steps", "3"]
    args += ["--deepspeed-config", "ds_configs/zero3_fp32.json", "--logs", str(tmp_path), "--name", "z3"]
    args += ["--batch-size", "8", "--warmup", "1", "--demo-num-samples", "256", "--workers", "0"]
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "dsclip", "train", *args]
    p = subprocess.run(cmd, cwd=ROOT, env=e, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    sh(
        shlex.join(["dsclip", "convert", str(tmp_path / "z3"), "--format", "open_clip", "-o", str(tmp_path / "oc")]),
        e,
        ROOT,
    )
    ref, got = hub_model.state_dict(), load_model(tmp_path / "oc").state_dict()
    want_pos = resample_abs_pos_embed(ref["visual.pos_embed"], new_size=[6, 6], num_prefix_tokens=1)
    torch.testing.assert_close(got["visual.pos_embed"], want_pos, atol=1e-6, rtol=0)
    assert all(torch.equal(got[k], v) for k, v in ref.items() if k.startswith("visual.") and k != "visual.pos_embed")
    assert not torch.equal(got["text.text_projection"], ref["text.text_projection"])
