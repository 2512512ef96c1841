"""Memory-bounded contrastive losses: tiles + a ring of ranks + a recomputing backward.

Layout. Rank r owns rows ``x_r`` (image) and ``y_r`` (text), ``b_r`` each; N = sum_r b_r. The global
logit matrix is ``Z[i, j] = s * x_i . y_j + bias``. Rank r computes the row band ``Z[r, :]`` one
block ``Z[r, q] = s * x_r y_q^T + bias`` at a time while the text embeddings ``y_q`` travel around
the ring (r sends to r+1, receives from r-1); image embeddings never leave their rank. Each block
is processed in ``tile x tile`` pieces, so no N x N, b x N or b x b matrix is ever allocated: the
live set is O(tile^2 + b * D).

InfoNCE needs row and column log-sum-exps. Every block is computed exactly once in the whole world:
row statistics of ``x_r`` accumulate locally, column statistics of ``y_q`` travel with ``y_q`` and
reach their owner after a full turn (online max/sum-exp merge). SigLIP needs no column statistics.

Backward recomputes each tile from the saved embeddings and the saved log-sum-exps (InfoNCE),
accumulates ``dx_r`` locally and sends the gradient accumulator of ``y_q`` around the ring with
``y_q``, one more hop bringing it home. The next block's transfer is posted before the current
block's tiles are computed (overlap). All accumulation is in fp32 (fp64 for fp64 inputs).

Return convention (see CONTRACTS.md): mean over ranks of the returned loss == full-batch loss,
grad(local features) == world * dL/dx_local, grad(scale/bias) summed over ranks == world * dL/dscale
(each rank holds the gradient of the tiles it computed, so only the average over ranks is dL/ds).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .common import BatchLayout, ContrastiveLoss, acc_dtype, check_label_smoothing
from .distributed import Ring, all_reduce_sum_with_grad

_TAG_Y, _TAG_INFO, _TAG_COLS, _TAG_GRAD = 11, 12, 13, 14


def _safe_max(m: Tensor) -> Tensor:
    # -inf only for columns no row has touched yet (empty ranks); keep exp() away from inf - inf.
    return torch.where(torch.isinf(m), torch.zeros_like(m), m)


class _InfoNCEKernel:
    """Per-row and per-column online log-sum-exp; value = sum(lse_rows) + sum(lse_cols) - c * sum(z_ii)."""

    n_cols_state = 2  # running (max, sum-exp) per column travel with the text block

    def __init__(self, diag_coef: float):
        self.diag_coef = diag_coef

    @staticmethod
    def init_state(n: int, dtype, device) -> Tensor:
        st = torch.zeros(2, n, dtype=dtype, device=device)
        st[0] = float("-inf")
        return st

    @staticmethod
    def tile_forward(z: Tensor, rows: Tensor, cols: Tensor) -> None:
        # rows: (2, ti) view, cols: (2, tj) view; updated in place. z (ti, tj) is consumed.
        m_new = torch.maximum(rows[0], z.amax(1))
        rows[1].mul_(torch.exp(rows[0] - m_new)).add_(torch.exp(z - m_new[:, None]).sum(1))
        rows[0].copy_(m_new)
        c_new = torch.maximum(cols[0], z.amax(0))
        cols[1].mul_(torch.exp(cols[0] - _safe_max(c_new))).add_(z.sub_(c_new[None, :]).exp_().sum(0))
        cols[0].copy_(c_new)

    @staticmethod
    def merge(a: Tensor, b: Tensor) -> Tensor:
        m = torch.maximum(a[0], b[0])
        ms = _safe_max(m)
        return torch.stack([m, a[1] * torch.exp(a[0] - ms) + b[1] * torch.exp(b[0] - ms)])

    @staticmethod
    def lse(state: Tensor) -> Tensor:
        return state[0] + torch.log(state[1])

    @staticmethod
    def tile_backward(z: Tensor, lse_rows: Tensor, g_r: Tensor, lse_cols: Tensor, g_q: Tensor) -> Tensor:
        # d/dz of g_r * lse_row_i + g_q * lse_col_j  ->  g_r * softmax_row + g_q * softmax_col
        p = torch.exp(z - lse_rows[:, None]).mul_(g_r)
        return p.add_(z.sub_(lse_cols[None, :]).exp_().mul_(g_q))


class _SigLipKernel:
    """Row-wise sum of softplus(z); value = sum_ij softplus(z_ij) - sum_i z_ii (positives on the diagonal)."""

    n_cols_state = 0
    diag_coef = 1.0

    @staticmethod
    def init_state(n: int, dtype, device) -> Tensor:
        return torch.zeros(1, n, dtype=dtype, device=device)

    @staticmethod
    def tile_forward(z: Tensor, rows: Tensor, cols) -> None:
        # softplus(z) = -log sigmoid(-z). torch returns z itself above `threshold`; at 40 the dropped
        # log1p(exp(-z)) < 5e-18 * z is below fp64 rounding (and 3x faster than logsigmoid on CPU).
        rows[0].add_(torch.nn.functional.softplus(z, threshold=40.0).sum(1))

    @staticmethod
    def tile_backward(z: Tensor, lse_rows, g_r: Tensor, lse_cols, g_q) -> Tensor:
        return z.sigmoid_().mul_(g_r)


def _tiles(n: int, tile: int):
    return [(a, min(a + tile, n)) for a in range(0, n, tile)]


def _logits_tile(xi: Tensor, yj: Tensor, s: Tensor, b: Tensor | None) -> Tensor:
    z = xi @ yj.T  # (ti, tj)
    z.mul_(s)
    if b is not None:
        z.add_(b)
    return z


def _ring_forward(kernel, x, y, s, b, lay: BatchLayout, ring: Ring, tile: int):
    acc, dev, (r, w) = s.dtype, x.device, (lay.rank, lay.world)
    rows = kernel.init_state(lay.local, acc, dev)
    cur_y, own_cols, col_works, inbound = y, None, [], None
    for k in range(w):
        q = (r - k) % w
        y_works = []
        if k < w - 1:  # post the next text block's transfer before computing this one (overlap)
            nxt_y = y.new_empty((lay.sizes[(q - 1) % w], y.shape[1]))
            y_works = ring.exchange(cur_y, nxt_y, _TAG_Y)
        cols = kernel.init_state(lay.sizes[q], acc, dev) if kernel.n_cols_state else None
        for j0, j1 in _tiles(lay.sizes[q], tile):
            yj = cur_y[j0:j1].to(acc)
            for i0, i1 in _tiles(lay.local, tile):
                z = _logits_tile(x[i0:i1].to(acc), yj, s, b)
                kernel.tile_forward(z, rows[:, i0:i1], None if cols is None else cols[:, j0:j1])
        if cols is not None:
            if w == 1:
                own_cols = cols
            else:
                if k > 0:  # partial statistics of block q from ranks q .. r-1
                    Ring.wait(col_works)
                    cols = kernel.merge(inbound, cols)
                inbound = cols.new_empty((cols.shape[0], lay.sizes[(q - 1) % w]))
                col_works = ring.exchange(cols, inbound, _TAG_COLS)  # last step: home to the owner
        Ring.wait(y_works)
        if k < w - 1:
            cur_y = nxt_y
    if kernel.n_cols_state and w > 1:
        Ring.wait(col_works)
        own_cols = inbound  # this rank's columns, complete over all rows
    # diagonal (positive pairs) z_ii, this rank's rows
    diag = torch.zeros((), dtype=acc, device=dev)
    for i0, i1 in _tiles(lay.local, tile):
        diag += (x[i0:i1].to(acc) * y[i0:i1].to(acc)).sum()
    diag = diag * s + (lay.local * b if b is not None else 0.0)
    lse_rows = kernel.lse(rows) if kernel.n_cols_state else None
    lse_cols = kernel.lse(own_cols) if kernel.n_cols_state else None
    if kernel.n_cols_state:
        value = lse_rows.sum() + lse_cols.sum()
    else:
        value = rows.sum()
    return value - kernel.diag_coef * diag, lse_rows, lse_cols


def _ring_backward(kernel, x, y, s, b, lse_rows, lse_cols, g, lay: BatchLayout, ring: Ring, tile: int):
    acc, dev, (r, w), d = s.dtype, x.device, (lay.rank, lay.world), x.shape[1]
    s_f = float(s)
    # dx is accumulated without the factor s (dx_raw = sum_j dz_ij y_j), so ds = sum_i x_i . dx_raw_i.
    # The diagonal term -c * g * (s * x_i . y_i + b) contributes -c * g * y_i to dx_raw.
    dx = y.to(acc) * (-kernel.diag_coef * g)
    db = torch.zeros((), dtype=acc, device=dev) - kernel.diag_coef * lay.local * g
    cur_y = y
    cur_info = torch.cat([lse_cols, g.reshape(1)]) if kernel.n_cols_state else None  # (b_q + 1,)
    grad_works, inbound = [], None
    for k in range(w):
        q = (r - k) % w
        y_works = []
        if k < w - 1:  # post the next text block (and its column lse + owner's grad) first: overlap
            nq = lay.sizes[(q - 1) % w]
            nxt_y = y.new_empty((nq, d))
            y_works = ring.exchange(cur_y, nxt_y, _TAG_Y)
            if cur_info is not None:
                nxt_info = cur_info.new_empty(nq + 1)
                y_works += ring.exchange(cur_info, nxt_info, _TAG_INFO)
        if k == 0:  # gradient accumulator of my own text block starts here
            dyq = torch.zeros((lay.local, d), dtype=acc, device=dev)
        else:  # accumulator of block q from ranks q .. r-1 (also completes my previous send)
            Ring.wait(grad_works)
            dyq = inbound
        g_q = cur_info[-1] if cur_info is not None else None
        for j0, j1 in _tiles(lay.sizes[q], tile):
            yj = cur_y[j0:j1].to(acc)
            lc = cur_info[j0:j1] if cur_info is not None else None
            for i0, i1 in _tiles(lay.local, tile):
                xi = x[i0:i1].to(acc)
                dz = kernel.tile_backward(
                    _logits_tile(xi, yj, s, b), None if lse_rows is None else lse_rows[i0:i1], g, lc, g_q
                )
                if b is not None:
                    db += dz.sum()
                dx[i0:i1].addmm_(dz, yj)
                dyq[j0:j1].addmm_(dz.T, xi, alpha=s_f)
        if w > 1:  # pass the accumulator on; after the last step it reaches its owner
            inbound = dyq.new_empty((lay.sizes[(q - 1) % w], d))
            grad_works = ring.exchange(dyq, inbound, _TAG_GRAD)
        Ring.wait(y_works)
        if k < w - 1:
            cur_y = nxt_y
            cur_info = nxt_info if cur_info is not None else None
    if w > 1:
        Ring.wait(grad_works)
        dyq = inbound
    dy = dyq
    ds = torch.zeros((), dtype=acc, device=dev)
    for i0, i1 in _tiles(lay.local, tile):
        xi = x[i0:i1].to(acc)
        ds += (xi * dx[i0:i1]).sum()
        dy[i0:i1].add_(xi, alpha=-kernel.diag_coef * float(g) * s_f)  # diagonal term's share
    dx.mul_(s)
    return dx, dy, ds, db


class _RingTiledFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, scale, bias, kernel, lay, ring, tile):
        acc = acc_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):  # fp32 accumulation even under autocast
            s = scale.detach().to(acc)
            b = None if bias is None else bias.detach().to(acc)
            value, lse_rows, lse_cols = _ring_forward(kernel, x.detach(), y.detach(), s, b, lay, ring, tile)
        ctx.save_for_backward(x, y, scale, bias, lse_rows, lse_cols)
        ctx.kernel, ctx.lay, ctx.ring, ctx.tile = kernel, lay, ring, tile
        return value

    @staticmethod
    def backward(ctx, grad):
        x, y, scale, bias, lse_rows, lse_cols = ctx.saved_tensors
        acc = acc_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            s = scale.detach().to(acc)
            b = None if bias is None else bias.detach().to(acc)
            g = grad.detach().to(acc).reshape(())
            dx, dy, ds, db = _ring_backward(ctx.kernel, x, y, s, b, lse_rows, lse_cols, g, ctx.lay, ctx.ring, ctx.tile)
        return (
            dx.to(x.dtype),
            dy.to(y.dtype),
            ds.to(scale.dtype).reshape(scale.shape),
            None if bias is None else db.to(bias.dtype).reshape(bias.shape),
            None,
            None,
            None,
            None,
        )


def _check_tile(tile_size: int) -> int:
    if int(tile_size) < 1:
        raise ValueError(f"tile_size must be >= 1, got {tile_size}")
    return int(tile_size)


class TiledInfoNCELoss(ContrastiveLoss):
    """Memory-bounded InfoNCE (global-batch CLIP loss), tiled and ring-exchanged across ranks.

    Same value and gradients as the full N x N CLIP loss (``InfoNCELoss``) with O(tile^2 + b*D)
    memory per rank. ``tile_size`` need not divide the batch. ``label_smoothing`` as in
    ``torch.nn.functional.cross_entropy`` (uniform over the N global classes).
    """

    def __init__(self, tile_size: int = 1024, label_smoothing: float = 0.0, *, check_finite: bool = True, group=None):
        super().__init__(check_finite=check_finite, group=group)
        self.tile_size = _check_tile(tile_size)
        self.label_smoothing = check_label_smoothing(label_smoothing)
        self._kernel = _InfoNCEKernel(diag_coef=2.0 * (1.0 - self.label_smoothing))

    def extra_repr(self) -> str:
        return f"tile_size={self.tile_size}, label_smoothing={self.label_smoothing}"

    def compute(self, image_features, text_features, logit_scale, logit_bias, lay) -> Tensor:
        s = logit_scale.reshape(())
        b = None if logit_bias is None else logit_bias.reshape(())
        value = _RingTiledFn.apply(
            image_features, text_features, s, b, self._kernel, lay, Ring(self.group), self.tile_size
        )
        eps = self.label_smoothing
        if eps > 0:
            # -eps * mean_j z_ij per row (and per column): linear in the features, so global sums do.
            acc = value.dtype
            x_loc = image_features.sum(0, dtype=acc)  # (D,)
            y_loc = text_features.sum(0, dtype=acc)
            x_all = all_reduce_sum_with_grad(x_loc, self.group)
            y_all = all_reduce_sum_with_grad(y_loc, self.group)
            smooth = s.to(acc) * (x_loc @ y_all + y_loc @ x_all) / lay.total
            if b is not None:
                smooth = smooth + 2 * lay.local * b.to(acc)
            value = value - eps * smooth
        return value * (lay.world / (2 * lay.total))
