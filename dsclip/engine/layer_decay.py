"""Layer-wise learning-rate decay per tower, as OpenCLIP's main branch assigns it.

``--image-layer-decay D`` (alias ``--visual-layer-decay``) and ``--text-layer-decay D``: a parameter in
layer group ``idx`` of a tower with ``n`` groups (ordered input -> output) trains at ``lr * D**(n-1-idx)``.
The top group (the projection head) keeps the full learning rate; everything outside a decayed tower
(``logit_scale``, ``logit_bias``, an undecayed tower) keeps scale 1.0.

What is read, from mlfoundations/open_clip main (src/open_clip_train/optim.py ``lr_scales_for_groups`` /
``layer_decay_param_groups``; src/open_clip/transformer.py ``VisionTransformer.layer_groups`` and
``_text_layer_groups``; src/open_clip/timm_model.py ``TimmModel.layer_groups``):

- OpenCLIP's own ViT: ``embeddings`` (patch conv, class token, positions, ln_pre), ``layer.i`` for each
  block (the last block together with ln_post), ``proj``.
- a timm image tower (dsclip's SigLIP towers): the groups of timm's ``group_parameters(trunk,
  trunk.group_matcher())`` — stem, one per block (the final ``norm`` joins the last: timm's matcher gives it
  ordinal 99999, MATCH_PREV_GROUP), and everything the matcher leaves
  unmatched (the 'map' attention pool) as the last trunk group — then ``proj`` when there is a projection.
- the text tower: ``embeddings`` (token + positional embedding), ``layer.i`` (the last block with
  ln_final), ``proj`` (text_projection).

Depth is counted over the whole tower, frozen groups included (OpenCLIP builds the groups from the
module structure, then skips parameters without ``requires_grad``), so locking and decay combine as in
OpenCLIP: a locked group has no learning rate, the others keep theirs. A value of 1.0 (or none) is off.
"""

from __future__ import annotations

from torch import nn

Groups = list[tuple[str, list]]  # [(name, [module or parameter, ...]), ...] input -> output


def image_layer_groups(model: nn.Module) -> Groups:
    v = model.visual
    if getattr(v, "timm_layout", None) is not None:
        return _timm_groups(v)
    blocks = list(v.blocks)
    stem = [x for x in (v.patch_embed, v.cls_token, v.pos_embed, v.norm_pre) if x is not None]
    groups: Groups = [("embeddings", stem)]
    groups += [(f"layer.{i}", [b] + ([v.norm] if i == len(blocks) - 1 else [])) for i, b in enumerate(blocks)]
    return groups + ([("proj", [v.proj])] if v.proj is not None else [])


def _timm_groups(v: nn.Module) -> Groups:
    from timm.models._manipulate import group_parameters

    named = dict(v.named_parameters())
    trunk = [(n, p) for n, p in named.items() if n != "proj"]  # dsclip keeps OpenCLIP's adapter head as `proj`

    class _Trunk(nn.Module):  # group_parameters reads named_parameters(); the trunk without the adapter head
        def named_parameters(self, *a, **k):
            return iter(trunk)

    by_id = group_parameters(_Trunk(), v.group_matcher())  # {layer id: [name, ...]}, low id = input side
    groups: Groups = [(f"layer.{i}", [named[n] for n in by_id[i]]) for i in sorted(by_id)]
    return groups + ([("proj", [v.proj])] if v.proj is not None else [])


def text_layer_groups(model: nn.Module) -> Groups:
    t = model.text
    blocks = list(t.blocks)
    groups: Groups = [("embeddings", [t.token_embedding, t.positional_embedding])]
    groups += [(f"layer.{i}", [b] + ([t.ln_final] if i == len(blocks) - 1 else [])) for i, b in enumerate(blocks)]
    return groups + [("proj", [t.text_projection])]


def _params(members: list) -> list[nn.Parameter]:
    out: list[nn.Parameter] = []
    for m in members:
        out.extend([m] if isinstance(m, nn.Parameter) else m.parameters())
    return out


def active(decay: float | None) -> bool:
    return decay is not None and decay != 1.0


def lr_scales(model: nn.Module, image_decay: float | None, text_decay: float | None) -> dict[int, float]:
    """``id(parameter) -> lr scale`` for the parameters of each decayed tower (others: absent, i.e. 1.0)."""
    scales: dict[int, float] = {}
    for decay, groups_of in ((image_decay, image_layer_groups), (text_decay, text_layer_groups)):
        if not active(decay):
            continue
        groups = groups_of(model)
        n = len(groups)
        for idx, (_, members) in enumerate(groups):
            for p in _params(members):
                scales[id(p)] = decay ** (n - 1 - idx)
    return scales


def describe(model: nn.Module, lr: float, image_decay: float | None, text_decay: float | None) -> str:
    """Start-up line: per decayed tower, the learning rate of its first and of its last transformer block."""
    scales = lr_scales(model, image_decay, text_decay)
    parts = []
    for what, decay, tower in (("image", image_decay, "visual"), ("text", text_decay, "text")):
        if not active(decay):
            continue
        blocks = list(getattr(model, tower).blocks)
        first, last = (scales[id(next(b.parameters()))] for b in (blocks[0], blocks[-1]))
        parts.append(f"{what} x{decay:g}: first block lr {lr * first:.3g}, last block lr {lr * last:.3g}")
    return "layer-wise lr decay: " + "; ".join(parts) if parts else ""
