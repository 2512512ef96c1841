"""``--torchcompile``: compile the towers' transformer blocks, with the settings the gradient cache needs.

What is compiled and why per block: see ``CLIP.compile_blocks``. This module owns the process-wide
torch.compile settings and the checks that turn a bad setup into one clear error before training:

* ``torch._inductor.config.fallback_random = True``. The gradient cache re-forwards each micro-batch
  after restoring the RNG state of its first pass and relies on drawing the same dropout / patch-
  dropout / drop-path masks. Inductor's own RNG derives per-graph seeds, and pass 1 (no-grad graph)
  and pass 2 (training graph) are different graphs; with ``fallback_random`` compiled code draws from
  torch's generator exactly like eager code, so the replay stays bit-exact and compiled training
  draws the same masks as eager training.
* A larger recompile limit. One block code object is shared by both towers and sees, per tower,
  training with and without grad (gradient-cache passes) and evaluation, i.e. up to 6 guard sets
  before dynamic shapes settle; torch's default of 8 would fall back to eager silently.
"""

from __future__ import annotations

import os
import shutil

from torch import nn

RECOMPILE_LIMIT = 32


class CompileSetupError(ValueError):
    """--torchcompile cannot work as configured (names the problem and the fix)."""


def check_compile_setup(backend: str, device_type: str) -> None:
    # lazy here and below: loading dynamo/inductor takes seconds and only --torchcompile needs them
    import torch._dynamo

    available = torch._dynamo.list_backends(exclude_tags=())
    if backend not in available:
        raise CompileSetupError(
            f"--torchcompile-backend {backend!r} is not a torch.compile backend; "
            f"use one of: {', '.join(b for b in ('inductor', 'aot_eager', 'eager') if b in available)}"
        )
    if backend == "inductor" and device_type == "cpu":
        cxx = os.environ.get("CXX", "g++")
        if shutil.which(cxx) is None and shutil.which("clang++") is None:
            raise CompileSetupError(
                f"--torchcompile with the inductor backend on CPU needs a C++ compiler ({cxx} not found): "
                "install g++ (or set CXX), or use --torchcompile-backend aot_eager"
            )


def compile_towers(model: nn.Module, backend: str = "inductor", mode: str = "default", device_type: str = "cpu") -> int:
    """Compile every transformer block of ``model`` in place; returns the number of blocks."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    check_compile_setup(backend, device_type)
    inductor_config.fallback_random = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    kwargs = {"backend": backend}
    if backend == "inductor" and mode != "default":
        kwargs["mode"] = mode
    return model.compile_blocks(**kwargs)
