"""`dsclip` prints a user error as one line; --debug (OpenCLIP's flag) shows the traceback instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsclip.cli import main
from dsclip.model import UnknownModelError


def test_user_error_is_one_line_and_debug_raises_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    argv = ["train", "--config", "tiny", "--logs", str(tmp_path), "--model", "ViT-Q-99"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsclip train: error: unknown model 'ViT-Q-99'")
    with pytest.raises(UnknownModelError):
        main([*argv, "--debug"])


def test_a_leading_double_dash_is_dropped(capsys):
    # `torchrun -m dsclip -- train ...`: a Python whose argparse keeps the `--` hands it to dsclip
    assert main(["--", "--help"]) == 0
    assert "commands:" in capsys.readouterr().out


def test_a_model_json_the_towers_cannot_build_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    import json

    monkeypatch.delenv("DSCLIP_DEBUG", raising=False)
    tiny = json.loads((Path(__file__).parents[2] / "dsclip" / "model" / "configs" / "tiny.json").read_text())
    cases = {
        "timm.json": ({**tiny, "vision_cfg": {**tiny["vision_cfg"], "timm_model_name": "convnext_tiny"}},
                      "dsclip's towers do not build vision tower timm:convnext_tiny"),
        "heads.json": ({**tiny, "vision_cfg": {**tiny["vision_cfg"], "head_width": 48}},
                       "vision width 64 is not a multiple of head_width 48"),
    }  # fmt: skip
    for name, (cfg, expect) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(cfg))
        assert main(["train", "--config", "tiny", "--logs", str(tmp_path), "--model", str(path)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"dsclip train: error: --model {path}: ") and expect in line, line
