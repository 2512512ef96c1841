"""Docs that cannot lie: every ``dsclip ...`` command in README.md and docs/ against the real parsers.

- Each fenced shell block is split into commands (continuation lines joined, comments dropped). A
  command is ``dsclip WORDS ...`` (also ``python -m dsclip``, ``deepspeed ... --module dsclip``) or one of
  the launch scripts, whose arguments go to ``dsclip train``. Every ``--flag`` must be one the command's
  parser accepts (``docs/gen_cli_reference.py`` reads them from its ``--help``): a renamed or removed
  flag fails here, naming the file and line.
- Blocks right after a ``<!-- runnable -->`` line are run as written, on CPU, one page's blocks in order
  in one empty folder that holds a few images (``photos/``) and their ``captions.tsv``. They are written
  at a tiny size (the demo for two steps, data write, convert, plan, eval).
- docs/cli-reference.md is what the generator writes today.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
RUNNABLE = "<!-- runnable -->"
# scripts whose arguments (after a `--` where the script takes launcher options first) go to `dsclip train`
LAUNCHERS = ("launch/slurm/train.sbatch", "launch/slurm/train_per_node.sbatch", "launch/deepspeed_hostfile.sh")

_spec = importlib.util.spec_from_file_location("gen_cli_reference", ROOT / "docs" / "gen_cli_reference.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)
COMMAND_WORDS = [words for words, _ in gen.COMMANDS]


def doc_files() -> list[Path]:
    # the user guide and the README; docs/results and benchmarks.md are bench/'s (measured history,
    # commands as they were run) and cli-reference.md is the parsers' own output
    skip = {"cli-reference.md", "benchmarks.md"}
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in skip)


def blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(first line number, text, runnable) of each fenced shell block."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if m:  # a fence: shell blocks are checked, others (python, text, output) skipped whole
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            if m.group(1) in ("bash", "sh", "shell", "console"):
                runnable = i > 0 and lines[i - 1].strip() == RUNNABLE
                out.append((i + 2, "\n".join(lines[i + 1 : j]), runnable))
            i = j
        i += 1
    return out


def commands(text: str) -> list[str]:
    """The block's shell commands, continuation lines joined, comment lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def dsclip_call(line: str) -> tuple[tuple[str, ...], list[str]] | None:
    """(command words, arguments) of the dsclip command on this line, or None."""
    tokens = shlex.split(line, comments=True)
    for i, tok in enumerate(tokens):
        if tok == "dsclip" and i + 1 < len(tokens):
            rest = tokens[i + 1 :]
            if rest[0] == "--":  # `torchrun -m dsclip -- train ...` (docs/clusters.md, torchrun)
                rest = rest[1:]
            if rest[0] == "launch":  # `dsclip launch -- deepspeed ... --module dsclip train ...`: the inner call
                inner = rest[2:] if rest[1:2] == ["--"] else rest[1:]
                return dsclip_call(shlex.join(inner)) or (("launch",), [])
            for words in sorted(COMMAND_WORDS, key=len, reverse=True):
                if tuple(rest[: len(words)]) == words:
                    return words, rest[len(words) :]
            if rest[0] == "data":  # `dsclip data --images ...` is `data write`
                return ("data", "write"), rest[1:]
            raise AssertionError(f"unknown dsclip command in: {line}")
        if any(tok.endswith(s) for s in LAUNCHERS):
            rest = tokens[i + 1 :]
            if tok.endswith("deepspeed_hostfile.sh") and "--" in rest:
                rest = rest[rest.index("--") + 1 :]
            return ("train",), rest
    return None


def all_calls() -> list[tuple[str, tuple[str, ...], list[str]]]:
    out = []
    for path in doc_files():
        for lineno, text, _ in blocks(path):
            for line in commands(text):
                call = dsclip_call(line)
                if call:
                    out.append((f"{path.relative_to(ROOT)}:{lineno}", *call))
                if call and call[0] != ("launch",) and "dsclip launch" in line:  # the wrapper, and what it runs
                    out.append((f"{path.relative_to(ROOT)}:{lineno}", ("launch",), []))
    return out


def test_every_documented_flag_exists():
    calls = all_calls()
    # the README's jobs and every topic page's commands: far fewer means the extraction broke
    assert len(calls) >= 40, len(calls)
    assert {w for _, w, _ in calls} == set(COMMAND_WORDS), "a dsclip command has no documented example"
    bad = []
    for where, words, args in calls:
        known = gen.option_strings(words)
        for a in args:
            flag = a.split("=", 1)[0]
            if flag.startswith("--") and flag != "--" and flag not in known:
                bad.append(f"{where}: dsclip {' '.join(words)} has no flag {flag}")
    assert not bad, "\n".join(bad)


def test_the_checker_finds_a_stale_flag():
    # the extraction and the check themselves: a renamed flag inside a continued launcher line is caught
    text = "RECIPE=r sbatch --nodes=4 launch/slurm/train.sbatch \\\n  --batch-size 8 --accum 4  # comment"
    (call,) = [dsclip_call(c) for c in commands(text)]
    assert call == (("train",), ["--batch-size", "8", "--accum", "4"])
    assert "--accum" not in gen.option_strings(("train",)) and "--accum-freq" in gen.option_strings(("train",))
    assert dsclip_call("deepspeed --num_gpus 8 --module dsclip plan --gpus 8") == (("plan",), ["--gpus", "8"])
    assert dsclip_call("python -c 'import dsclip'") is None
    assert dsclip_call("torchrun --nproc_per_node 8 -m dsclip -- train --logs l") == (("train",), ["--logs", "l"])


def test_cli_reference_is_generated_from_the_parsers():
    assert (ROOT / "docs" / "cli-reference.md").read_text() == gen.render(), (
        "docs/cli-reference.md is out of date: run `python docs/gen_cli_reference.py` (or `make docs`)"
    )


def _seed(folder: Path) -> None:
    """A few images and their captions: what the runnable data commands read."""
    from PIL import Image

    (folder / "photos").mkdir()
    rows = []
    for i, (color, name) in enumerate([("red", "a red square"), ("blue", "a blue square")] * 3):
        Image.new("RGB", (40, 40), color).save(folder / "photos" / f"{i}.png")
        rows.append(f"{i}.png\t{name}")
    (folder / "captions.tsv").write_text("\n".join(rows) + "\n")


def runnable_pages() -> list[Path]:
    return [p for p in doc_files() if any(r for _, _, r in blocks(p))]


@pytest.mark.parametrize("path", runnable_pages(), ids=lambda p: p.name)
def test_runnable_blocks_run_on_cpu(path, tmp_path):
    _seed(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DSCLIP_LOG_WORLD="0")
    ran = 0
    for lineno, text, runnable in blocks(path):
        if not runnable:
            continue
        for line in commands(text):
            argv = shlex.split(line, comments=True)
            assert argv[0] == "dsclip", f"{path.name}:{lineno}: runnable blocks hold dsclip commands only: {line}"
            p = subprocess.run(
                [PY, "-m", "dsclip", *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
            )
            assert p.returncode == 0, f"{path.name}:{lineno}: {line}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
            words, args = dsclip_call(line)
            if words == ("convert",):  # the export is there, not only an exit code
                out = Path(tmp_path, args[args.index("-o") + 1])
                assert any(out.glob("*.safetensors")), (line, sorted(out.iterdir()))
            if words == ("data", "write"):
                assert list((tmp_path / args[args.index("--out") + 1]).glob("*.tar")), line
            if words == ("eval",):
                assert "top1" in p.stdout + p.stderr, p.stdout[-2000:]
            ran += 1
    assert ran, path
