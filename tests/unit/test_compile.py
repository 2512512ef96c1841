"""--torchcompile: setup errors are early and named; compiling keeps parameter names and numbers."""

from __future__ import annotations

import pytest
import torch

from dsclip.engine import compile as dscompile
from dsclip.model import create_model


def test_unknown_backend_names_the_fix():
    with pytest.raises(dscompile.CompileSetupError, match=r"'inductr' is not a torch.compile backend.*inductor"):
        dscompile.check_compile_setup("inductr", "cpu")


def test_inductor_on_cpu_without_a_compiler_says_what_to_do(monkeypatch):
    monkeypatch.setattr(dscompile.shutil, "which", lambda name: None)
    with pytest.raises(dscompile.CompileSetupError, match="needs a C\\+\\+ compiler.*aot_eager"):
        dscompile.check_compile_setup("inductor", "cpu")
    dscompile.check_compile_setup("aot_eager", "cpu")  # needs no compiler


def test_compile_blocks_keeps_state_dict_keys_and_outputs():
    torch.manual_seed(0)
    model = create_model("tiny", vocab_size=256, eos_id=2, pad_id=0).eval()
    keys = list(model.state_dict())
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(3, 200, (2, 32))
    tokens[:, 10] = 2
    with torch.no_grad():
        eager = model(image=images, text=tokens)
    n = dscompile.compile_towers(model, backend="aot_eager")
    assert n == len(model.visual.blocks) + len(model.text.blocks)
    assert list(model.state_dict()) == keys  # in-place: checkpoints and OpenCLIP export unchanged
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        compiled = model(image=images, text=tokens)
    assert counters["stats"]["unique_graphs"] > before
    torch.testing.assert_close(compiled["image_features"], eager["image_features"])
    torch.testing.assert_close(compiled["text_features"], eager["text_features"])
