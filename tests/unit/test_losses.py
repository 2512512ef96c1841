"""Single-process tests of dsclip.losses against a plain N x N reference written here.

The references below are deliberately naive (full logit matrix, torch.logsumexp / logsigmoid) and
share no code with dsclip.losses; tests/dist/test_loss_dist.py reuses them for the gloo tests.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsclip.losses import LOSS_NAMES, LossConfig, LossInputError, build_loss
from tests.tolerances import loss_tol, rounding, unit_roundoff

# ---------------------------------------------------------------- references (full batch, N x N)


def ref_infonce(x, y, scale, bias=None, label_smoothing=0.0):
    """CLIP loss over the whole batch: mean of row and column cross-entropies, smoothed like torch."""
    z = scale * x @ y.T
    if bias is not None:
        z = z + bias
    eps = label_smoothing
    d = z.diagonal()
    rows = torch.logsumexp(z, 1) - (1 - eps) * d - eps * z.mean(1)
    cols = torch.logsumexp(z, 0) - (1 - eps) * d - eps * z.mean(0)
    return (rows.mean() + cols.mean()) / 2


def ref_siglip(x, y, scale, bias=None):
    """SigLIP over the whole batch: -sum log sigmoid(label * z) / N, label +1 on the diagonal."""
    z = scale * x @ y.T
    if bias is not None:
        z = z + bias
    labels = 2 * torch.eye(len(x), dtype=z.dtype) - 1
    return -F.logsigmoid(labels * z).sum() / len(x)


def make_batch(n, d, seed=0, dtype=torch.float64, scale=7.0, bias=-3.0):
    g = torch.Generator().manual_seed(seed)
    x = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    y = F.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=-1).to(dtype)
    # correlate the pairs a little so the positives matter
    y = F.normalize(y.double() + 0.5 * x.double(), dim=-1).to(dtype)
    return x, y, torch.tensor(scale, dtype=torch.float64), torch.tensor(bias, dtype=torch.float64)


def loss_and_grads(fn, x, y, s, b):
    """Value and gradients (x, y, scale, bias) of fn(x, y, s, b) on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, y, s)]
    leaves.append(None if b is None else b.detach().clone().requires_grad_())
    loss = fn(*leaves)
    loss.backward()
    grads = [None if t is None else (t.grad if t.grad is not None else torch.zeros_like(t)) for t in leaves]
    return loss.detach(), grads


def reference(name, x, y, s, b, label_smoothing=0.0):
    if name == "siglip":
        return loss_and_grads(ref_siglip, x, y, s, b)
    return loss_and_grads(lambda *a: ref_infonce(*a, label_smoothing=label_smoothing), x, y, s, b)


# float64 comparisons of a loss (value or gradient) with the reference or OpenCLIP. Worst case over every
# batch these files build (tests/tolerances.loss_tol): at most 16 pairs (the gloo tests' 7+6 and 4+4+4),
# at most 8 dims, logit scale 7, bias up to 5: 304 chained float64 sums of terms up to 15.8, 1.1e-12.
# A real loss error is larger than 1e-6.
LOSS_TOL = loss_tol(16, 8, scale=7.0, bias=5.0)


def assert_close(a, b, tol=LOSS_TOL):
    torch.testing.assert_close(a, b, atol=tol, rtol=0)


# ---------------------------------------------------------------- world 1 vs the reference

CASES = [
    ("infonce", 0.0, None, 0),
    ("infonce", 0.1, 5.0, 0),
    ("infonce_local", 0.0, None, 0),
    ("infonce_local", 0.2, None, 0),
    *[("infonce_tiled", eps, bias, tile) for eps, bias in ((0.0, None), (0.1, -2.0)) for tile in (1, 3, 7, 64)],
    *[("siglip", 0.0, bias, tile) for bias in (-3.0, None) for tile in (1, 3, 7, 64)],
]


@pytest.mark.parametrize("name,eps,bias,tile", CASES)
def test_world1_matches_reference(name, eps, bias, tile):
    x, y, s, _ = make_batch(13, 6)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float64)
    loss = build_loss(name, tile_size=max(tile, 1), label_smoothing=eps)
    got, g = loss_and_grads(loss, x, y, s, b)
    want, w = reference(name, x, y, s, b, eps)
    assert_close(got, want)
    for a, c in zip(g, w):
        if c is not None:
            assert_close(a, c)


def test_label_smoothing_matches_torch_cross_entropy():
    x, y, s, _ = make_batch(11, 4, seed=3)
    z = s * x @ y.T
    labels = torch.arange(11)
    for eps in (0.0, 0.1, 0.3):
        want = (F.cross_entropy(z, labels, label_smoothing=eps) + F.cross_entropy(z.T, labels, label_smoothing=eps)) / 2
        assert_close(ref_infonce(x, y, s, label_smoothing=eps), want)  # the reference itself
        for name in ("infonce", "infonce_local", "infonce_tiled"):
            got = build_loss(name, tile_size=4, label_smoothing=eps)(x, y, s)
            assert_close(got, want)


def test_openclip_world1_exact():
    open_clip_loss = pytest.importorskip("open_clip.loss")
    x, y, s, b = make_batch(10, 8, seed=5)
    for local in (False, True):
        oc = open_clip_loss.ClipLoss(local_loss=local, gather_with_grad=True)
        want, w = loss_and_grads(oc, x, y, s, None)
        got, g = loss_and_grads(build_loss("infonce_local" if local else "infonce"), x, y, s, None)
        assert_close(got, want)
        for a, c in zip(g[:3], w[:3]):
            assert_close(a, c)
    for tile in (3, 100):
        want, w = loss_and_grads(open_clip_loss.SigLipLoss(), x, y, s, b)
        got, g = loss_and_grads(build_loss("siglip", tile_size=tile), x, y, s, b)
        assert_close(got, want)
        for a, c in zip(g, w):
            assert_close(a, c)
    # the tiled loss equals OpenCLIP's InfoNCE too
    want, w = loss_and_grads(open_clip_loss.ClipLoss(), x, y, s, None)
    got, g = loss_and_grads(build_loss("infonce_tiled", tile_size=4), x, y, s, None)
    assert_close(got, want)
    for a, c in zip(g[:3], w[:3]):
        assert_close(a, c)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_bf16_inputs_within_tolerance(name):
    """bf16 features: losses accumulate in fp32 (upcast), so the loss is within fp32 rounding of the
    fp64 reference evaluated on the same bf16-rounded values; gradients come back in bf16, so they
    are within bf16 rounding (relative 2^-8) of the reference gradient."""
    # loss value: d-term logits, n-term log-sum-exp, n-term mean, ~8 roundings in exp/log: d + 2n + 8 = 104
    # chained fp32 sums of terms up to loss_size = 7 + 3 + log 40 + 1 (tolerances.rounding): 6.8e-5.
    loss_tol_fp32 = rounding(16 + 2 * 40 + 8, 7.0 + 3.0 + math.log(40) + 1.0)
    # feature gradients: computed in fp32 (same chain, n*n terms for nothing here) then rounded to bf16 once:
    # relative u_bf16 = 2^-9 of the largest entry, plus the fp32 part (negligible); 1e-2 = 5 u_bf16 also
    # covers the bf16 rounding of the inputs propagated through softmax (|d p / d z| <= 1/4 per logit).
    grad_rel = 5 * 2 * unit_roundoff(torch.bfloat16)
    x, y, s, b = make_batch(40, 16, seed=7, dtype=torch.bfloat16)
    s32, b32 = s.float(), b.float()
    bias = b32 if name == "siglip" else None
    got, g = loss_and_grads(build_loss(name, tile_size=9), x, y, s32, bias)
    want, w = reference(name, x.double(), y.double(), s.double(), None if bias is None else b)
    assert got.dtype == torch.float32
    assert g[0].dtype == torch.bfloat16 and g[1].dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=0, atol=loss_tol_fp32)
    for a, c in zip(g[:2], w[:2]):
        torch.testing.assert_close(a.double(), c, rtol=grad_rel, atol=grad_rel * float(c.abs().max()))
    # the logit-scale gradient stays fp32: n*n + 2n + d + 8 = 1704 chained terms (tolerances.loss_terms)
    torch.testing.assert_close(g[2].double(), w[2], rtol=0, atol=rounding(1704, 7.0 + 3.0 + math.log(40) + 1.0))


def test_bf16_tiled_equals_fp32_tiled_closely():
    x, y, s, _ = make_batch(33, 8, seed=9, dtype=torch.bfloat16)
    lb = build_loss("infonce_tiled", tile_size=5)(x, y, s.float())
    lf = build_loss("infonce_tiled", tile_size=5)(x.float(), y.float(), s.float())
    # both accumulate in fp32 over the same bf16 values, in different tile/upcast orders: the loss
    # value's chain d + 2n + 8 = 82 terms of size <= 7 + log 33 + 1 (tolerances.rounding): 3.6e-5
    torch.testing.assert_close(lb, lf, rtol=0, atol=rounding(8 + 2 * 33 + 8, 7.0 + math.log(33) + 1.0))


# ---------------------------------------------------------------- memory: no big matrix, ever


class MaxNumel(TorchDispatchMode):
    """Records the largest tensor any aten op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel, self.op = t.numel(), func
        return out


@pytest.mark.parametrize("name", ["infonce_tiled", "siglip"])
def test_tiled_never_allocates_a_big_matrix(name):
    n, d, tile = 96, 8, 16  # N*N = 9216 and N*D = 768 vs tile^2 = 256
    x, y, s, b = make_batch(n, d, seed=11)
    x.requires_grad_()
    y.requires_grad_()
    s.requires_grad_()
    b.requires_grad_()
    loss = build_loss(name, tile_size=tile, label_smoothing=0.1 if name == "infonce_tiled" else 0.0)
    with MaxNumel() as rec:
        loss(x, y, s, b).backward()
    assert rec.max_numel <= max(tile * tile, n * d), (rec.max_numel, rec.op)
    # ... and the same run with the full matrix would have produced an N x N tensor (the probe works)
    with MaxNumel() as rec_full:
        ref_infonce(x, y, s).backward()
    assert rec_full.max_numel >= n * n


# ---------------------------------------------------------------- API and bad input


def test_build_loss_names_and_config():
    from dsclip.losses import InfoNCELoss, SigLipRingLoss, TiledInfoNCELoss

    assert isinstance(build_loss("infonce"), InfoNCELoss) and not build_loss("infonce").local
    assert build_loss("infonce_local").local
    assert isinstance(build_loss("infonce_tiled", tile_size=5), TiledInfoNCELoss)
    assert build_loss(LossConfig(name="siglip", tile_size=7)).tile_size == 7
    assert isinstance(build_loss("siglip"), SigLipRingLoss)
    with pytest.raises(ValueError, match="unknown loss"):
        build_loss("clip")
    with pytest.raises(ValueError, match="tile_size"):
        build_loss("infonce_tiled", tile_size=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        build_loss("siglip", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        build_loss("infonce", label_smoothing=1.0)


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_bad_input_world1(name):
    x, y, s, b = make_batch(6, 4)
    loss = build_loss(name, tile_size=4)
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(LossInputError, match="non-finite.*image features"):
        loss(bad, y, s, b)
    with pytest.raises(LossInputError, match="non-finite.*logit_scale"):
        loss(x, y, torch.tensor(float("inf"), dtype=torch.float64), b)
    with pytest.raises(LossInputError, match=r"image features \(6, 4\) vs text features \(6, 3\)"):
        loss(x, y[:, :3], s, b)
    with pytest.raises(LossInputError, match="dtype"):
        loss(x, y.float(), s, b)
    with pytest.raises(LossInputError, match="2-D"):
        loss(x[0], y[0], s, b)
    # logit_scale with shape (1,) (the DeepSpeed-safe parameter shape) works
    assert torch.isfinite(loss(x, y, s.reshape(1), b))
    # check_finite=False skips the scan (a NaN then propagates, no error)
    assert torch.isnan(build_loss(name, tile_size=4, check_finite=False)(bad, y, s, b))


def test_losses_never_import_deepspeed():
    code = "import sys, dsclip.losses; sys.exit(int(any(m.startswith('deepspeed') for m in sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_unknown_loss_name_is_an_error_not_siglip():
    """Issue #31: build_loss used to fall through to SigLIP for any name it did not know."""
    import dataclasses

    from dsclip.losses import LossConfig, SigLipRingLoss, build_loss

    with pytest.raises(ValueError, match="unknown loss 'sigmoid'; choose one of infonce"):
        build_loss("sigmoid")
    cfg = LossConfig(name="siglip")
    assert isinstance(build_loss(cfg), SigLipRingLoss)
    bypassed = dataclasses.replace(cfg)
    object.__setattr__(bypassed, "name", "siglip2")  # a config built around LossConfig's own check
    with pytest.raises(ValueError, match="unknown loss 'siglip2'"):
        build_loss(bypassed)
