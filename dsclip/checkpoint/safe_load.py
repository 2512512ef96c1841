"""Checkpoint files are data, not code: every ``.pt`` file of a DeepSpeed checkpoint is read with
``torch.load(weights_only=True)`` and an explicit allowlist of the classes such files hold.

A pickle can name any importable callable (``os.system``, ``builtins.open``) and have ``torch.load`` call
it while loading; ``weights_only=False``, what DeepSpeed's loaders use, runs it. A checkpoint that came from
elsewhere (a shared folder, object storage, a hub) must not be a way in, so dsclip's loads go through
:func:`load_data`: tensors, containers, numbers and strings (torch's own weights-only set) plus the few
DeepSpeed classes its checkpoints hold (:data:`ALLOWED`, found by reading the files the test suite writes
under ZeRO-1/2/3, bf16 and fp32, EMA and universal). A file that needs any other global is refused in one
line naming the global and the file (:class:`UnsafeCheckpointError`); nothing in it runs.

DeepSpeed reads most files through the engine's checkpoint engine (dsclip's: dsclip.checkpoint.async_save,
whose ``load`` is :func:`load_data`), but its universal-checkpoint, ``ds_to_universal`` and ``zero_to_fp32``
code calls ``torch.load(weights_only=False)`` itself: :func:`data_only` makes ``torch.load`` this module's
loader for the duration of a resume or a conversion (single-threaded code; restored on exit).
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
from pathlib import Path

import torch

from dsclip.config_base import ConfigError

# module path -> names: the non-torch classes DeepSpeed writes into its checkpoint files (ZeRO-1/2/3 optimizer
# shards and universal optimizer_state.pt: the loss scaler (DynamicLossScaler: fp16), the ZeRO stage enum and
# ZeRO-1/2's fragment addresses); dsclip's own files (dsclip_state.json, EMA shards) hold plain data only
_ALLOWED_NAMES = {
    "deepspeed.runtime.fp16.loss_scaler": ("LossScaler", "DynamicLossScaler"),
    "deepspeed.runtime.zero.config": ("ZeroStageEnum",),
    "deepspeed.utils.tensor_fragment": ("fragment_address",),
}

_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file whose pickle needs a global outside :data:`ALLOWED` (one line; nothing was run)."""


def allowed() -> list:
    """The classes (and functions) :func:`load_data` lets a checkpoint's pickle name, besides torch's own."""
    out = []
    for module, names in _ALLOWED_NAMES.items():
        try:
            mod = importlib.import_module(module)
        except ImportError:  # an older/newer DeepSpeed without that module: nothing to allow from it
            continue
        out.extend(getattr(mod, n) for n in names if hasattr(mod, n))
    return out


_real_load = torch.load


def load_data(f, map_location=None, *args, weights_only=None, **kwargs):
    """``torch.load(f, map_location, weights_only=True)`` with :func:`allowed`; a file that needs another global is
    one :class:`UnsafeCheckpointError` naming it and the file (``weights_only`` from callers is ignored:
    always True)."""
    kwargs.pop("pickle_module", None)  # weights_only chooses its own unpickler
    try:
        with torch.serialization.safe_globals(allowed()):
            return _real_load(f, map_location, *args, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        found = _GLOBAL_RE.search(str(e))
        if found is None:  # damaged bytes, not a refused global: the caller's error for an unreadable file
            raise
        raise refusal(f, found.group(1)) from None


def refusal(f, name: str) -> UnsafeCheckpointError:
    """The one line for a file whose pickle names the global ``name`` (module.qualname) outside the allowlist."""
    path = f if isinstance(f, (str, Path)) else getattr(f, "name", "a checkpoint file")
    return UnsafeCheckpointError(
        f"checkpoint file {path} needs the global {name}, which is not among the classes dsclip loads from "
        "checkpoints: refused without running anything (checkpoints are loaded as data; docs/checkpoints.md). "
        "Use a checkpoint written by dsclip/DeepSpeed, or convert this one where you trust its source"
    )


@contextlib.contextmanager
def data_only():
    """Every ``torch.load`` inside the block is :func:`load_data` (DeepSpeed's own direct calls included)."""
    previous = torch.load
    torch.load = load_data
    try:
        yield
    finally:
        torch.load = previous
