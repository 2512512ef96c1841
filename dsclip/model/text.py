"""Text tower: OpenCLIP's causal text transformer built from timm's ``Block`` (SDPA, ``is_causal=True``).

Token + learned positional embeddings -> causal blocks -> ``ln_final`` -> pool one token per sequence ->
``@ text_projection`` (width, embed; no bias). Pooling follows OpenCLIP's ``text_global_pool``:

- ``argmax``: the position of the highest token id (OpenAI BPE: the EOT token has the largest id),
- ``eos``:    the first position holding ``eos_id`` (position 0 when a row has none, as OpenCLIP),
- ``last`` / ``first``: the last / first position.
"""

from __future__ import annotations

import torch
from torch import nn

from .blocks import (
    CheckpointFn,
    InitPlan,
    apply_init_plan,
    block_init_plan,
    default_checkpoint_fn,
    make_blocks,
    norm_layer,
    run_blocks,
)

POOL_TYPES = ("argmax", "eos", "last", "first")


def text_pool(x: torch.Tensor, text: torch.Tensor, pool_type: str, eos_id: int | None = None) -> torch.Tensor:
    """x (B, L, W), text (B, L) -> (B, W)."""
    if pool_type == "first":
        return x[:, 0]
    if pool_type == "last":
        return x[:, -1]
    if pool_type == "argmax":
        idx = text.argmax(dim=-1)
    elif pool_type == "eos":
        idx = (text == eos_id).int().argmax(dim=-1)  # first occurrence
    else:
        raise ValueError(f"unknown text pool_type {pool_type!r}; expected one of {POOL_TYPES}")
    return x[torch.arange(x.shape[0], device=x.device), idx]


class TextTower(nn.Module):
    def __init__(
        self,
        *,
        embed_dim: int,
        context_length: int = 77,
        vocab_size: int = 49408,
        width: int = 512,
        heads: int = 8,
        layers: int = 12,
        mlp_ratio: float = 4.0,
        ls_init_value: float | None = None,
        pool_type: str = "argmax",
        eos_id: int = 2,
        pad_id: int = 0,
        norm_kwargs: dict | None = None,
        quick_gelu: bool = False,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path_rate: float = 0.0,
        causal: bool = True,
        proj_bias: bool = False,
        act_kwargs: dict | None = None,
    ):
        super().__init__()
        if pool_type not in POOL_TYPES:
            raise ValueError(f"unknown text pool_type {pool_type!r}; expected one of {POOL_TYPES}")
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.width = width
        self.layers = layers
        self.output_dim = embed_dim
        self.pool_type = pool_type
        self.eos_id = eos_id
        self.pad_id = pad_id  # tokenizer metadata (causal attention never looks past EOS anyway)
        # SigLIP: bidirectional attention over the padded sequence (OpenCLIP's no_causal_mask, no pad mask)
        self.causal = causal

        self.token_embedding = nn.Embedding(vocab_size, width)
        self.positional_embedding = nn.Parameter(torch.empty(context_length, width))
        self.blocks = make_blocks(
            width,
            layers,
            heads,
            mlp_ratio,
            ls_init_value,
            quick_gelu,
            norm_kwargs,
            dropout=dropout,
            attn_dropout=attn_dropout,
            drop_path_rate=drop_path_rate,
            act_kwargs=act_kwargs,
        )
        self.ln_final = norm_layer(norm_kwargs)(width)
        # OpenCLIP: a (width, embed) parameter used as x @ proj, or with proj_bias (SigLIP) an nn.Linear
        self.text_projection = nn.Linear(width, embed_dim) if proj_bias else nn.Parameter(torch.empty(width, embed_dim))
        self.grad_checkpointing = False
        self.checkpoint_fn: CheckpointFn | None = None
        # Under ZeRO-3 zero.Init child layers are already partitioned here and get skipped;
        # CLIP.init_weights(gather=...) completes the init (see its docstring).
        self.init_skipped = apply_init_plan(self.init_plan())

    def init_plan(self) -> InitPlan:
        # OpenCLIP TextTransformer.init_parameters
        proj_std = (self.width**-0.5) * ((2 * self.layers) ** -0.5)
        attn_std = self.width**-0.5
        fc_std = (2 * self.width) ** -0.5

        def own():
            nn.init.normal_(self.positional_embedding, std=0.01)
            if isinstance(self.text_projection, nn.Parameter):
                nn.init.normal_(self.text_projection, std=self.width**-0.5)

        def linear_proj():
            nn.init.normal_(self.text_projection.weight, std=self.width**-0.5)
            nn.init.zeros_(self.text_projection.bias)

        plan: InitPlan = [(self, own)]
        if isinstance(self.text_projection, nn.Linear):
            plan.append((self.text_projection, linear_proj))
        plan.append((self.token_embedding, lambda: nn.init.normal_(self.token_embedding.weight, std=0.02)))
        for blk in self.blocks:
            plan += block_init_plan(blk, attn_std=attn_std, proj_std=proj_std, fc_std=fc_std)
        plan.append((self.ln_final, self.ln_final.reset_parameters))
        return plan

    def set_grad_checkpointing(self, enable: bool = True, checkpoint_fn: CheckpointFn | None = None) -> None:
        self.grad_checkpointing = enable
        self.checkpoint_fn = (checkpoint_fn or default_checkpoint_fn) if enable else None

    def no_weight_decay(self) -> set[str]:
        return {"token_embedding.weight", "positional_embedding"}

    def forward_features(self, text: torch.Tensor) -> torch.Tensor:  # (B, L) long -> (B, L, W)
        seq_len = text.shape[1]
        if seq_len > self.context_length:
            raise ValueError(f"text length {seq_len} exceeds context_length {self.context_length}")
        x = self.token_embedding(text) + self.positional_embedding[:seq_len]  # (B, L, W)
        x = run_blocks(self.blocks, x, self.checkpoint_fn if self.grad_checkpointing else None, is_causal=self.causal)
        return self.ln_final(x)

    def forward(self, text: torch.Tensor) -> torch.Tensor:  # (B, L) long -> (B, D)
        x = self.forward_features(text)
        x = text_pool(x, text, self.pool_type, self.eos_id)  # (B, W)
        if isinstance(self.text_projection, nn.Linear):
            return self.text_projection(x)
        return x @ self.text_projection
