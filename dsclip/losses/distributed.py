"""Autograd-aware collectives for the contrastive losses (plain ``torch.distributed``, no DeepSpeed).

Everything works on the default process group (or ``group=``) and degrades to a no-op when
``torch.distributed`` is not initialised, so world 1 needs no process group at all.

Gradient semantics: every rank calls ``backward`` on its own loss at the same time (the DeepSpeed
data-parallel step). A tensor gathered *with grad* therefore sends back to its owner the SUM over
ranks of the gradient each rank computed for it, which is what makes
``grad(x_local) == world * dL/dx_local`` when the mean over ranks of the per-rank losses is ``L``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dsclip.dist import rank_world

__all__ = [
    "all_gather_columns_with_grad",
    "all_gather_sizes",
    "all_gather_with_grad",
    "all_reduce_sum_with_grad",
    "all_reduce_mean",
    "Ring",
]


# torch 2.14 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has only those.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def all_gather_sizes(n: int, device: torch.device | str = "cpu", group=None) -> list[int]:
    """Every rank's ``n`` (e.g. its local batch size), in rank order."""
    _, world = rank_world(group)
    if world == 1:
        return [int(n)]
    t = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather_single(out, t, group=group)
    return [int(v) for v in out.tolist()]


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's rows (sizes may differ); backward reduce-scatters (sums) to owners."""

    @staticmethod
    def forward(ctx, x: Tensor, sizes: tuple[int, ...], group) -> Tensor:
        rank, world = rank_world(group)
        ctx.sizes, ctx.group, ctx.rank = sizes, group, rank
        max_b = max(sizes)
        rest = tuple(x.shape[1:])
        if x.shape[0] == max_b:
            send = x.contiguous()
        else:  # gloo (and NCCL) need equal sizes: pad to the largest rank, strip after
            send = x.new_zeros((max_b, *rest))
            send[: x.shape[0]] = x
        out = x.new_empty((world * max_b, *rest))
        _all_gather_single(out, send, group=group)
        if all(s == max_b for s in sizes):
            return out
        return torch.cat([out[r * max_b : r * max_b + s] for r, s in enumerate(sizes)])

    @staticmethod
    def backward(ctx, grad: Tensor):
        sizes, group, rank = ctx.sizes, ctx.group, ctx.rank
        world, max_b = len(sizes), max(sizes)
        grad = grad.contiguous()
        if all(s == max_b for s in sizes):
            padded = grad
        else:
            padded = grad.new_zeros((world * max_b, *grad.shape[1:]))
            off = 0
            for r, s in enumerate(sizes):
                padded[r * max_b : r * max_b + s] = grad[off : off + s]
                off += s
        mine = grad.new_empty((max_b, *grad.shape[1:]))
        _reduce_scatter_single(mine, padded, op=dist.ReduceOp.SUM, group=group)
        return mine[: sizes[rank]], None, None


def all_gather_with_grad(x: Tensor, sizes: Sequence[int] | None = None, group=None) -> Tensor:
    """``cat`` over ranks of ``x`` along dim 0 (per-rank row counts may differ), differentiable.

    ``sizes`` (every rank's ``x.shape[0]``) is gathered first when not given. Backward returns to each
    rank the sum over ranks of the gradient of its rows.
    """
    _, world = rank_world(group)
    if world == 1:
        return x
    if sizes is None:
        sizes = all_gather_sizes(x.shape[0], x.device, group)
    return _AllGatherWithGrad.apply(x, tuple(int(s) for s in sizes), group)


def all_gather_columns_with_grad(
    tensors: Sequence[Tensor], sizes: Sequence[int] | None = None, group=None
) -> list[Tensor]:
    """``all_gather_with_grad`` of several (b, D_i) tensors of one dtype with equal row counts, as ONE
    collective: they travel side by side as the columns of one (b, sum D_i) tensor (and their gradients
    as one reduce-scatter). The gathered values are those of gathering each tensor alone (a gather moves
    values), and each gradient element sums the same terms (bit for bit the separate gathers' on gloo:
    tests/dist/test_loss_dist.py). It saves a collective, and the wait for the slowest rank inside it,
    per tensor past the first: image and text features, 2 -> 1 forward and backward."""
    _, world = rank_world(group)
    if world == 1:
        return list(tensors)
    widths = [t.shape[1] for t in tensors]
    gathered = all_gather_with_grad(torch.cat(list(tensors), dim=1), sizes, group)  # (N, sum D_i)
    # contiguous: the matmuls downstream see the same operand layout as after separate gathers
    return [part.contiguous() for part in gathered.split(widths, dim=1)]


class _AllReduceSumWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        # y = sum_r x_r on every rank; rank r's x_r feeds every rank's y, so its gradient is the sum
        # over ranks of dL_s/dy.
        g = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def all_reduce_sum_with_grad(x: Tensor, group=None) -> Tensor:
    """Sum of ``x`` over ranks, differentiable (backward is again a sum over ranks)."""
    _, world = rank_world(group)
    if world == 1:
        return x
    return _AllReduceSumWithGrad.apply(x, group)


@torch.no_grad()
def all_reduce_mean(x: Tensor, group=None) -> Tensor:
    """Mean over ranks of a (detached) tensor, for logging: e.g. the full-batch loss from per-rank losses."""
    _, world = rank_world(group)
    out = x.detach().clone()
    if world > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        out /= world
    return out


class Ring:
    """Point-to-point ring: every rank sends to ``rank + 1`` and receives from ``rank - 1``.

    ``exchange`` posts one send and one receive as a single ``batch_isend_irecv`` and returns without
    waiting, so the caller can compute while the transfer runs (gloo progresses it on its own I/O
    threads, NCCL on its own stream). Every rank runs the same sequence of ``exchange`` calls, so
    message k sent to the right always matches message k received from the left, which keeps
    NCCL (in-order matching) and gloo (matching by tag) both happy. Empty tensors are skipped on both
    sides (sizes are known globally, so both ends agree).
    """

    def __init__(self, group=None):
        self.group = group
        self.rank, self.world = rank_world(group)
        self.right = _global_rank(group, (self.rank + 1) % self.world)
        self.left = _global_rank(group, (self.rank - 1) % self.world)

    def exchange(self, send: Tensor | None, recv: Tensor | None, tag: int = 0) -> list:
        """Post ``send`` -> right neighbour and ``recv`` <- left neighbour; returns the work handles."""
        if self.world == 1:
            return []
        ops = []
        # The caller keeps both buffers alive until ``wait``: no hidden contiguous() copy here.
        if send is not None and send.numel() > 0:
            assert send.is_contiguous(), "ring send buffer must be contiguous"
            ops.append(dist.P2POp(dist.isend, send, self.right, self.group, tag))
        if recv is not None and recv.numel() > 0:
            ops.append(dist.P2POp(dist.irecv, recv, self.left, self.group, tag))
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()
