"""dsclip/engine/input_grads.py: with frozen parameters, every module that trains sees inputs that require
grad (ZeRO-3 reduces a module's gradients from hooks on its inputs; tests/dist/test_lock.py runs it under
ZeRO-3 at K = 1 and 2 against a big-batch reference). Here: the hook's own contract, without DeepSpeed."""

from __future__ import annotations

import torch
from torch import nn

from dsclip.engine.input_grads import input_grads_covered, needs_input_grads, require_input_grads


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2))
    m[0].requires_grad_(False)  # a locked token embedding: its output requires no grad
    return m


def test_the_first_trainable_module_after_a_frozen_one_gets_an_input_that_requires_grad():
    m = _model()
    seen = []
    m[1].register_forward_pre_hook(lambda mod, args: seen.append(args[0].requires_grad))  # after ours
    assert needs_input_grads(m) and not input_grads_covered(m)
    hooked = require_input_grads(m)
    assert hooked == 4 and input_grads_covered(m)  # the Sequential, the LayerNorm and both Linears
    assert require_input_grads(m) == 0  # once per module
    tokens = torch.tensor([[1, 2, 3]])
    m(tokens).sum().backward()
    assert seen == [True]
    with torch.no_grad():  # the gradient cache's pass 1 and evaluation: nothing changes
        m(tokens)
    assert seen == [True, False]


def test_the_weight_gradients_are_unchanged():
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    plain, hooked = _model(), _model()
    require_input_grads(hooked)
    for m in (plain, hooked):
        m(tokens).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), hooked.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad), name
    assert plain[0].weight.grad is None


def test_an_all_trainable_or_all_frozen_model_needs_nothing():
    m = _model()
    m[0].requires_grad_(True)
    assert not needs_input_grads(m) and input_grads_covered(m)
    m.requires_grad_(False)
    assert not needs_input_grads(m) and input_grads_covered(m)
