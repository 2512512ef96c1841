"""LiveTensorBytes, the CPU rehearsal's max_memory_allocated: the bytes of tensor storage alive at once.

Checked against byte counts derived by hand: a Linear's weights, its gradients after a backward, the graph's
saved tensors freed by the backward, storage freed by `del`, a view sharing its base's storage, resize_, a tensor
made before the mode (never counted, nor its views), reset_peak, and the mode entered twice (the rehearsal's
build, then its warm-up step) with storage freed in between."""

from __future__ import annotations

import gc

import torch

from dsclip.rehearsal.live_bytes import LiveTensorBytes


def test_counts_the_storages_alive_at_once_and_their_peak():
    before = torch.ones(1000)  # made before the mode: a GPU rank's host-side batch, never counted
    live = LiveTensorBytes()
    with live:
        lin = torch.nn.Linear(100, 50)
    weights = (100 * 50 + 50) * 4
    assert live.current == live.peak == weights
    scratch = torch.empty(10)  # made outside the mode: not counted
    with live:
        x = torch.randn(8, 100)
        out = lin(x + before[:100])  # the slice views `before`: not counted; the sum is (8 x 100 fp32)
        assert live.current == weights + 2 * 8 * 100 * 4 + 8 * 50 * 4
        out.sum().backward()
        del out
        # the weights, their grads and x: the sum, the output and the graph's saved tensors are freed
        assert live.current == 2 * weights + 8 * 100 * 4
        assert live.peak >= 2 * weights + 2 * 8 * 100 * 4 + 8 * 50 * 4
        lin.weight.grad = lin.bias.grad = None
        del x
        assert live.current == weights
        live.reset_peak()
        assert live.peak == weights
        b = torch.empty(10, dtype=torch.bfloat16)
        b.resize_(1000)  # in place: the same storage, counted at its new size
        v = b.view(10, 100)  # a view: no new storage
        assert live.current == weights + 2000
        scratch.add_(1)  # in place on a storage made outside: not counted
        assert live.current == weights + 2000
        del b, v
        gc.collect()
        assert live.current == weights
    assert live.peak == weights + 2000
    del lin
    assert live.current == 0  # the weak references see a storage die after the mode is left too
