"""ZeRO-3 with frozen parameters (LiT's ``--lock-image`` / ``--lock-text``): every module that trains sees an
input that requires grad.

Why: ZeRO-3 gathers a module's weights for its backward, and reduces and re-partitions its gradients,
from hooks DeepSpeed hangs on the module's inputs and outputs. When none of a module's inputs requires
grad (the first text block after a locked token embedding; a trainable LayerNorm inside a locked block),
torch fires the module's full backward hook as soon as the output's gradient exists, before the module's
own weight gradients are computed. DeepSpeed then reduces and releases those weights too early, and the
first step fails with "0 != N Cannot reduce scatter gradients whose size is not same as the params".
(With the gradient cache at K = 2 the same model happened to pass, because DeepSpeed's fetch trace was
never valid there.)

The fix is the one Hugging Face uses for frozen embeddings under checkpointing
(``enable_input_require_grads``): such an input is handed on as a fresh leaf that requires grad. The
weight gradients are the same numbers; the only extra work is the input gradient of the first trainable
module after a frozen one, which is then discarded.
"""

from __future__ import annotations

import torch
from torch import nn

HOOKED = "_dsclip_input_grads"  # module.__dict__ flag: one hook per module


def needs_input_grads(model: nn.Module) -> bool:
    """Some parameters train and some are frozen."""
    flags = {p.requires_grad for p in model.parameters()}
    return flags == {True, False}


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def input_grads_covered(model: nn.Module) -> bool:
    """No parameter is frozen, or every module with trainable parameters has the hook."""
    if not needs_input_grads(model):
        return True
    return all(m.__dict__.get(HOOKED) for m in model.modules() if _trains(m))


def require_input_grads(model: nn.Module) -> int:
    """Hook every module that has trainable parameters so that, with grad enabled, its floating-point
    tensor inputs require grad. Runs before DeepSpeed's own forward hooks (prepended). Returns the
    number of modules hooked."""
    hooked = 0
    for module in model.modules():
        if module.__dict__.get(HOOKED) or not _trains(module):
            continue
        module.register_forward_pre_hook(_inputs_require_grad, prepend=True, with_kwargs=True)
        module.__dict__[HOOKED] = True
        hooked += 1
    return hooked


def _differentiable(value):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach().requires_grad_(True)
    return value


def _inputs_require_grad(module, args, kwargs):
    if not torch.is_grad_enabled():
        return None  # the gradient cache's pass 1 and evaluation: no graph, nothing to change
    if not any(isinstance(a, torch.Tensor) and a.is_floating_point() and not a.requires_grad for a in args):
        return None
    return tuple(_differentiable(a) for a in args), kwargs
