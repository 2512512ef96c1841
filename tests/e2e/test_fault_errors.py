"""Issue 32, item 5: errors a user meets through ``dsclip train`` are one line naming the file, row or key and
the fix (tiny model, few steps; the bad cases share one process)."""

from __future__ import annotations

import json
import shutil

from tests.e2e.test_train_cli import run_cli, run_cli_cases


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("dsclip train: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_resume_with_another_model_and_latin1_csv_are_one_line(tmp_path):
    logs = ["--config", "tiny", "--logs", str(tmp_path), "--max-steps", "2"]
    run_cli(["train", *logs, "--name", "a"])  # a checkpoint at step 2 of --model tiny
    run_config = tmp_path / "a" / "run_config.yaml"
    before = run_config.read_text()
    # the same checkpoint as an older dsclip wrote it: no model_config.json (and no manifest)
    shutil.copytree(tmp_path / "a", tmp_path / "old")
    old_tag = tmp_path / "old" / "checkpoints" / "step_000000002"
    for name in ("model_config.json", "MANIFEST.json"):
        (old_tag / name).unlink()
    (old_tag / "COMPLETE").write_text(json.dumps({"step": 2}))
    csv = tmp_path / "latin1.csv"
    csv.write_bytes("filepath,title\nx.png,caf\u00e9\n".encode("latin-1"))
    results = run_cli_cases(
        {
            "other_model": ["train", *logs, "--name", "a", "--resume", "latest", "--model", "demo"],
            "old_tag_other_model": ["train", *logs, "--name", "old", "--resume", "latest", "--model", "demo"],
            "old_tag_other_context": [
                "train",
                *logs,
                "--name",
                "old",
                "--resume",
                "latest",
                "--force-context-length",
                "16",
            ],
            "latin1_csv": [
                "train",
                *logs,
                "--name",
                "csv",
                "--train-data",
                str(csv),
                "--csv-separator",
                ",",
                "--tokenizer",
                str(tmp_path / "a" / "tokenizer.model"),
            ],
        }  # fmt: skip
    )
    rc, err = results["other_model"]
    line = _error_line(err)
    assert rc == 2 and "was trained as --model tiny, this run builds --model demo" in line, line
    assert "embed_dim 32 vs 128" in line and "resume with --model tiny" in line, line
    assert run_config.read_text() == before  # still the checkpoints' model, not the refused one
    rc, err = results["old_tag_other_model"]  # the run's recorded --model, before anything is written
    line = _error_line(err)
    assert (
        rc == 2 and f"checkpoint {old_tag} was trained as --model tiny" in line and "resume with --model tiny" in line
    )
    rc, err = results["old_tag_other_context"]  # found only by torch's load: its first mismatch, one line
    line = _error_line(err)
    assert rc == 2 and f"checkpoint {old_tag} was trained as another architecture" in line, line
    assert "size mismatch for text.positional_embedding" in line, line
    rc, err = results["latin1_csv"]
    line = _error_line(err)
    assert rc == 2 and f"{csv}: line 2, column 10: byte 0xe9 is not UTF-8" in line and "iconv" in line, line
