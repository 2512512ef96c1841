"""Engine-aware gradient cache: one optimizer step over K micro-batches, exactly the big-batch gradient.

Why this exists: a contrastive loss couples every sample with every other, so the gradient of a
32k batch is not the sum of the gradients of eight 4k batches. GradCache (Gao et al., 2021)
splits the work in two passes:

  pass 1  encode the K micro-batches without building graphs; remember each chunk's RNG state;
  loss    run the loss once over all K·B cached embeddings (any mode, across ranks) and take the
          gradient of the loss w.r.t. those embeddings and w.r.t. logit_scale / logit_bias;
  pass 2  for each chunk: restore its RNG (same dropout / patch-dropout masks as in pass 1),
          re-forward it with a graph and back-propagate the cached gradient through the scalar
          surrogate  sum(embedding * cached_grad);  then one optimizer step.

What DeepSpeed needs from us (see docs/deepspeed-notes.md):
  * ZeRO-2/3 reduce gradients inside every backward; K backwards per step must be wrapped in
    ``engine.coalesce_grad_reduction()`` with the boundary flag set before each backward, or
    ZeRO-2 keeps only the last chunk's gradient.
  * The surrogate is a scalar so that ``engine.backward`` applies the fp16 loss scale itself; the
    cached gradients come from an unscaled fp32 loss.
  * DeepSpeed is configured with gradient_accumulation_steps = 1 (ds_config.py), so nothing is
    divided by K: the cached gradients already are the big-batch gradients.
  * logit_scale / logit_bias are read from the engine's forward output (under ZeRO-3 the
    parameter itself is an empty placeholder outside forward) and their gradient enters the
    surrogate of exactly one chunk — OpenCLIP's --accum-freq adds it K times.

Distillation (``teacher``): a frozen teacher embeds each chunk in pass 1 too, without a graph, and its
embeddings (fp32) and scale go to the loss with the student's; pass 2 never runs the teacher again.

The last chunk's pass-1 graph can be kept (``keep_last_graph``), saving one forward per step at the
price of one chunk's activations held during the loss (pass 2 back-propagates it first, so it never sits
beside a re-forwarded chunk's graph); with K = 1 this is a plain training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsclip.dist import rank_world
from dsclip.engine.accumulation import engine_grad_reduction, require_exact_accumulation
from dsclip.engine.patches import norm_skipped

Batch = tuple[torch.Tensor, torch.Tensor]  # images (B,3,H,W), tokens (B,L)


@dataclass
class StepResult:
    loss: float  # the full-batch loss (mean over ranks of each rank's part)
    logit_scale: float
    logit_bias: float | None
    grad_norm: float | None
    applied: bool  # False when the step was skipped (fp16 overflow, non-finite features)
    skip_reason: str | None = None
    flags: tuple[float, ...] = ()  # ``extra_flags`` summed over all ranks (the stop-signal flags)
    terms: dict[str, float] = field(default_factory=dict)  # the loss's named parts (distillation), full batch


def snapshot_rng(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _world() -> int:
    return rank_world()[1]


def _all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    if _world() > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


class GradCacheStep:
    """Runs one optimizer step of a DeepSpeed engine over ``accum_freq`` micro-batches.

    Only DeepSpeed's public engine API: forward, ``backward``, ``coalesce_grad_reduction`` with the
    accumulation boundary, ``step``. How K backwards are reduced exactly is the engine's
    (dsclip/engine/accumulation.py): "coalesced" (ZeRO-1/2/3), "boundary" (ZeRO-0, the BF16_Optimizer
    wrapper: DeepSpeed reduces only at the boundary), or refused at construction where neither is exact.
    Whatever dsclip changes inside DeepSpeed to make those calls cheaper was installed with the engine
    (dsclip/engine/patches/), not here.
    """

    def __init__(
        self,
        engine,
        loss_fn: Callable[..., torch.Tensor],
        *,
        accum_freq: int = 1,
        grad_reduction: str = "auto",  # resolved and checked as `dsclip train --grad-reduction` is
        keep_last_graph: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        extra_flags: Callable[[], Sequence[float]] = tuple,
        teacher: Callable[[torch.Tensor, torch.Tensor], dict] | None = None,
    ):
        self.engine = engine
        self.loss_fn = loss_fn
        # Numbers every step sums over the ranks for the caller, riding on the all-reduce the step makes
        # anyway (the non-finite check): the stop-signal flags, without a second collective + host sync.
        self.extra_flags = extra_flags
        # teacher(images, tokens) -> {"image_features", "text_features", "logit_scale"}, no grad (train/teacher.py)
        self.teacher = teacher
        self.keep_last_graph = keep_last_graph
        self.compute_dtype = compute_dtype
        self.device = engine.device if isinstance(engine.device, torch.device) else torch.device(engine.device)
        # a one-line error here (start-up) where K backwards per step could not be exact (issue #34); the
        # engine's reduction: "sharded" (each chunk reduced into the fp32 partition as its backward runs),
        # "coalesced" (one reduction of the summed .grad), "boundary" (DeepSpeed reduces at the boundary only)
        self.grad_reduction = engine_grad_reduction(engine, accum_freq, grad_reduction)  # auto: the CLI's choice
        self.reduction = require_exact_accumulation(engine, accum_freq, self.grad_reduction)

    def _inputs(self, batch: Batch) -> Batch:
        images, tokens = batch
        images = images.to(self.device, dtype=self.compute_dtype, non_blocking=True)
        tokens = tokens.to(self.device, non_blocking=True)
        return images, tokens

    def _forward(self, batch: Batch) -> dict:
        images, tokens = self._inputs(batch)
        return self.engine(image=images, text=tokens)

    def _first_pass(self, micro_batches: Sequence[Batch]) -> tuple[list[dict], list, list, dict | None, dict, dict]:
        """Pass 1: embeddings without graphs (the last chunk keeps its graph if asked).

        Returns each chunk's RNG state before its forward, the (B, D) fp32 image and text
        embeddings per chunk, the kept last chunk's output (or None), the last output and the
        teacher's cache ({} without a teacher: else its (B, Dt) fp32 embeddings per chunk and scale)."""
        k = len(micro_batches)
        rng_states, img_cache, txt_cache = [], [], []
        teacher_cache: dict = {"image": [], "text": [], "scale": None} if self.teacher is not None else {}
        live = None
        for i, batch in enumerate(micro_batches):
            rng_states.append(snapshot_rng(self.device))
            keep = self.keep_last_graph and i == k - 1
            with contextlib.nullcontext() if keep else torch.no_grad():
                out = self._forward(batch)
            if keep:
                live = out
            img_cache.append(out["image_features"].detach().float())  # (B, D)
            txt_cache.append(out["text_features"].detach().float())  # (B, D)
            if self.teacher is not None:
                # After the student's forward: chunk i's RNG state was taken before it, so pass 2 replays
                # the student's masks whatever the teacher does (in eval mode it draws nothing anyway).
                with torch.no_grad():
                    t_out = self.teacher(*self._inputs(batch))
                teacher_cache["image"].append(t_out["image_features"].float())  # (B, Dt)
                teacher_cache["text"].append(t_out["text_features"].float())  # (B, Dt)
                teacher_cache["scale"] = t_out["logit_scale"].float().reshape(())
        return rng_states, img_cache, txt_cache, live, out, teacher_cache

    def _second_pass(self, micro_batches: Sequence[Batch], rng_states: list[dict], live: dict | None, grads) -> None:
        """Pass 2: back-propagate each chunk's cached gradient through that chunk's graph.

        The kept last chunk goes first (its pass-1 graph is already there), then every other chunk is
        re-forwarded with its pass-1 RNG, in pass-1 order. Kept graph first: at most one chunk's graph is
        alive at any time (pass 2 holds one micro-batch of activations, not two), and every backward follows
        its own forward, so under ZeRO-3 each forward + backward is the same unit of fetches, whose trace
        repeats and prefetches (dsclip/engine/patches/zero3_traces.py)."""
        g_img, g_txt, g_scale, g_bias = grads
        k = len(micro_batches)
        order = [k - 1, *range(k - 1)] if live is not None else list(range(k))
        e = self.engine
        ctx = e.coalesce_grad_reduction() if self.reduction == "coalesced" else contextlib.nullcontext()
        with ctx:
            for n, i in enumerate(order):
                final = n == k - 1
                e.set_gradient_accumulation_boundary(final)
                if live is not None and i == k - 1:
                    out, live = live, None
                else:
                    restore_rng(rng_states[i], self.device)
                    out = self._forward(micro_batches[i])
                img, txt = out["image_features"].float(), out["text_features"].float()
                # The temperature (and bias) gradient enters exactly once per step, with the final chunk; the
                # others back-propagate it times zero (an exact +0 to its gradient), so that every chunk's
                # backward runs through the same outputs (ZeRO-3's per-output backward hooks then fetch the
                # same modules in every chunk, and its fetch trace repeats).
                weight = 1.0 if final else 0.0
                surrogate = (img * g_img[i]).sum() + (txt * g_txt[i]).sum()
                surrogate = surrogate + out["logit_scale"].float().reshape(()) * (g_scale * weight)
                if g_bias is not None:
                    surrogate = surrogate + out["logit_bias"].float().reshape(()) * (g_bias * weight)
                e.backward(surrogate)
                del out, img, txt, surrogate
        e.set_gradient_accumulation_boundary(True)

    def __call__(
        self, micro_batches: Sequence[Batch], *, optimizer_step: bool = True, grad_norm: bool = True
    ) -> StepResult:
        """One optimizer step over the K = len(micro_batches) chunks of this rank.

        ``optimizer_step=False`` stops after the gradients are reduced (tests inspect them with
        ``deepspeed.utils.safe_get_full_grad`` and then call ``engine.step()`` themselves).
        ``grad_norm=False``: nobody reads this step's gradient norm (not a logged step), so where clipping
        does not need it either the step skips computing it and reports None (patches/grad_norm.py).
        """
        k = len(micro_batches)
        if k < 1:
            raise ValueError("a step needs at least one micro-batch")
        if k > 1:
            require_exact_accumulation(self.engine, k, self.grad_reduction)
        rng_states, img_cache, txt_cache, live, out, teacher_cache = self._first_pass(micro_batches)
        rng_after = snapshot_rng(self.device)
        sizes = [t.shape[0] for t in img_cache]
        scale = out["logit_scale"].detach().float().reshape(())
        bias = out.get("logit_bias")
        bias = None if bias is None else bias.detach().float().reshape(())
        teacher_inputs = self._teacher_inputs(teacher_cache)
        bad, summed = self._agree_finite(img_cache, txt_cache, teacher_inputs)
        if bad:  # nothing was back-propagated: the step is skipped on every rank together
            return StepResult(float("nan"), scale.item(), _item(bias), None, False, "non-finite embeddings", summed)
        img_all, txt_all = torch.cat(img_cache), torch.cat(txt_cache)  # (K·B, D)
        # The per-chunk copies would otherwise live through the loss and pass 2: 6 instead of 4 N x D
        # buffers at the peak (dsclip plan's embedding cache counts 4: embeddings + their gradients).
        del img_cache, txt_cache
        loss, grads, parts = self._loss_and_grads(img_all, txt_all, scale, bias, teacher_inputs, sizes)
        del img_all, txt_all, teacher_inputs
        report = torch.stack([loss.detach().float().reshape(()), *(v.float().reshape(()) for v in parts.values())])
        self._second_pass(micro_batches, rng_states, live, grads)
        restore_rng(rng_after, self.device)
        live = None
        report = _all_reduce(report) / _world()  # stays on the device: no host sync here
        terms = dict(zip(parts, report[1:].tolist()))
        if not optimizer_step:
            return StepResult(report[0].item(), scale.item(), _item(bias), None, True, None, summed, terms)
        applied, norm = self._optimizer_step(grad_norm)
        return StepResult(
            loss=report[0].item(),
            logit_scale=scale.item(),
            logit_bias=_item(bias),
            grad_norm=norm,
            applied=applied,
            skip_reason=None if applied else "fp16 overflow (loss scale reduced)",
            flags=summed,
            terms=terms,
        )

    def _teacher_inputs(self, teacher_cache: dict) -> dict:
        """The distillation loss's teacher rows of the same samples, same order ({} without a teacher)."""
        if not teacher_cache:
            return {}
        return dict(
            teacher_image_features=torch.cat(teacher_cache["image"]),  # (K·B, Dt)
            teacher_text_features=torch.cat(teacher_cache["text"]),
            teacher_logit_scale=teacher_cache["scale"],
        )

    def _agree_finite(self, img_cache, txt_cache, teacher_inputs: dict) -> tuple[bool, tuple[float, ...]]:
        """(whether any rank saw non-finite embeddings, the extra flags summed over the ranks): one all-reduce.

        Non-finite embeddings (fp16 forward overflow): every rank must agree to skip, or the others would
        block in the loss's collectives."""
        finite = torch.isfinite(torch.cat(img_cache)).all() & torch.isfinite(torch.cat(txt_cache)).all()
        for t in teacher_inputs.values():
            finite &= torch.isfinite(t).all()
        flags = torch.cat([(~finite).float().reshape(1), torch.tensor([*self.extra_flags()], device=self.device)])
        bad, *summed = _all_reduce(flags).tolist()  # (1 + F,): the one host sync before the loss
        return bad > 0, tuple(summed)

    def _loss_and_grads(self, img_all, txt_all, scale, bias, teacher_inputs: dict, sizes: list[int]):
        """The loss, once, over all cached embeddings (fp32), and its gradient w.r.t. them and the scale/bias.

        Returns (loss, per-chunk gradients for pass 2, the loss's named parts). A loss may keep its parts in
        ``last_terms`` (DistillInfoNCELoss's contrastive_loss and distill_loss, as OpenCLIP logs them)."""
        img_all, txt_all = img_all.requires_grad_(True), txt_all.requires_grad_(True)
        scale_leaf = scale.clone().requires_grad_(True)
        bias_leaf = None if bias is None else bias.clone().requires_grad_(True)
        leaves = [img_all, txt_all, scale_leaf] + ([bias_leaf] if bias_leaf is not None else [])
        with torch.autocast(self.device.type, enabled=False):
            loss = self.loss_fn(img_all, txt_all, scale_leaf, bias_leaf, **teacher_inputs)
            grads = torch.autograd.grad(loss, leaves)
        g_bias = grads[3] if bias_leaf is not None else None
        parts = getattr(self.loss_fn, "last_terms", None)
        parts = parts if isinstance(parts, dict) else {}
        return loss, (grads[0].split(sizes), grads[1].split(sizes), grads[2], g_bias), parts

    def _optimizer_step(self, grad_norm: bool) -> tuple[bool, float | None]:
        """``engine.step()`` (without the norm where nobody reads it); (whether it was applied, the norm)."""
        e = self.engine
        with norm_skipped(e) if not grad_norm else contextlib.nullcontext():
            e.step()
        applied = bool(e.was_step_applied()) if hasattr(e, "was_step_applied") else True
        norm = e.get_global_grad_norm() if hasattr(e, "get_global_grad_norm") else None
        return applied, norm.item() if isinstance(norm, torch.Tensor) else norm


def _item(t: torch.Tensor | None) -> float | None:
    return None if t is None else t.item()
