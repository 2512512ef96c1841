"""`dsclip` prints a user error as one line; --debug (OpenCLIP's flag) shows the traceback instead."""

from __future__ import annotations

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
