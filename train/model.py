"""A small decoder-only MoE language model built from `pallas_moe.nn.MoE`.

    bytes [B, S] -> embed -> (+ learned positions) -> N x block -> RMSNorm -> head -> logits [B, S, 256]
    block(x) = x + Attention(RMSNorm(x));  x = x + MoE(RMSNorm(x))       (pre-norm residual)

Attention is causal multi-head self-attention with rotary position embeddings (RoPE) or
learned absolute positions. The head is tied to the embedding or separate. Each MoE layer
returns `(y, aux)`; the model sums the layers' weighted aux losses into `aux["loss"]` and
keeps per-layer routing statistics stacked along a leading layer axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from train.configs import Config

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def rope(x: jax.Array, base: float) -> jax.Array:
    """Rotary position embedding over the last axis of `x [B, S, H, Dh]` (halves rotated)."""
    seq_len, head_dim = x.shape[1], x.shape[-1]
    half = head_dim // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [Dh/2]
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * freqs[None, :]  # [S, Dh/2]
    cos = jnp.cos(angles)[None, :, None, :]  # [1, S, 1, Dh/2]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)  # [B, S, H, Dh/2]
    out = jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)  # [B, S, H, Dh]
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention; RoPE on queries and keys when `use_rope`."""

    def __init__(self, d_model: int, num_heads: int, *, use_rope: bool, rope_base: float, dtype, rngs: nnx.Rngs):
        self.num_heads = num_heads
        self.use_rope = use_rope
        self.rope_base = rope_base
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(d_model, d_model, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq_len, d_model = x.shape
        head_dim = d_model // self.num_heads
        qkv = self.qkv(x).reshape(batch, seq_len, 3, self.num_heads, head_dim)  # [B, S, 3, H, Dh]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [B, S, H, Dh] each
        if self.use_rope:
            q, k = rope(q, self.rope_base), rope(k, self.rope_base)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, S, H, Dh]
        return self.out(o.reshape(batch, seq_len, d_model))  # [B, S, d]


class Block(nnx.Module):
    """Pre-norm residual block: attention, then the MoE feed-forward."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, expert_parallel=None, numerics=None,
                 kernel_config=None):
        from pallas_moe.nn import MoE

        dtype = DTYPES[cfg.dtype]
        self.attn_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.attn = Attention(
            cfg.d_model, cfg.num_heads, use_rope=cfg.positions == "rope",
            rope_base=cfg.rope_base, dtype=dtype, rngs=rngs,
        )
        self.moe_norm = nnx.RMSNorm(cfg.d_model, dtype=dtype, rngs=rngs)
        self.moe = MoE(
            cfg.d_model, cfg.d_expert, cfg.num_experts, cfg.top_k,
            routing=cfg.routing, tile=cfg.tile, rounding=cfg.rounding,
            load_balance_weight=cfg.load_balance_weight, z_loss_weight=cfg.z_loss_weight,
            backend=cfg.backend, dtype=dtype, rngs=rngs, expert_parallel=expert_parallel,
            numerics=numerics, kernel_config=kernel_config,
        )

    def __call__(self, x: jax.Array, *, trace: list | None = None) -> tuple[jax.Array, dict]:
        """x [B, S, d] -> (x + attn + MoE [B, S, d], aux). `trace`: a list this block appends
        {"moe_input": the MoE's input, "hidden": the block's output} to (for `train.parity`)."""
        x = x + self.attn(self.attn_norm(x))  # [B, S, d]
        moe_input = self.moe_norm(x)  # [B, S, d]
        y, aux = self.moe(moe_input)  # [B, S, d], routing stats of B*S tokens
        out = x + y
        if trace is not None:
            trace.append({"moe_input": moe_input, "hidden": out})
        return out, aux


class MoETransformer(nnx.Module):
    """Byte-level decoder-only language model with an MoE feed-forward in every block.

    `expert_parallel`: a `pm.nn.ExpertParallel` for every MoE layer (None: one device).
    `numerics`: a `pallas_moe.Numerics` for every MoE layer (default: the library's); it
    changes rounding orders only, not the parameters, so one checkpoint serves them all.
    `kernel_config`: a `pallas_moe.kernels.KernelConfig` for every MoE layer's kernels
    (None: their `for_shape` defaults).
    """

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs, expert_parallel=None, numerics=None,
                 kernel_config=None):
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        # Small embedding init: with a tied head, initial logits are x . embed, so unit-variance
        # embeddings would start the loss well above ln(256).
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=self.dtype,
            embedding_init=nnx.initializers.normal(stddev=0.02), rngs=rngs,
        )
        if cfg.positions == "learned":
            init = jax.nn.initializers.normal(0.02)
            self.pos_embed = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([
            Block(cfg, rngs=rngs, expert_parallel=expert_parallel, numerics=numerics,
                  kernel_config=kernel_config)
            for _ in range(cfg.num_layers)
        ])
        self.final_norm = nnx.RMSNorm(cfg.d_model, dtype=self.dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, dtype=self.dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, trace: list | None = None) -> tuple[jax.Array, dict]:
        """tokens i32[B, S] -> (logits f32[B, S, 256], aux).

        `trace`: a list that gets one dict per layer (see `Block.__call__`).
        """
        seq_len = tokens.shape[1]
        x = self.embed(tokens)  # [B, S, d]
        if self.cfg.positions == "learned":
            x = x + self.pos_embed[...][:seq_len].astype(self.dtype)[None]  # [B, S, d]
        layer_aux = []
        for block in self.blocks:
            x, aux = block(x, trace=trace)  # [B, S, d]
            layer_aux.append(aux)
        x = self.final_norm(x)  # [B, S, d]
        if self.cfg.tie_embeddings:
            logits = self.embed.attend(x)  # [B, S, V]
        else:
            logits = self.head(x)  # [B, S, V]
        return logits.astype(jnp.float32), merge_aux(layer_aux)


def merge_aux(layer_aux: list[dict]) -> dict:
    """Sums the layers' weighted aux losses; stacks every other scalar stat as `[L]`."""
    total = sum(aux_loss_total(a) for a in layer_aux)
    stats = {}
    for key in layer_aux[0]:
        values = [a[key] for a in layer_aux]
        if all(jnp.ndim(v) == 0 for v in values):
            stats[key] = jnp.stack([jnp.asarray(v, jnp.float32) for v in values])  # [L]
        elif all(hasattr(v, "shape") for v in values):
            stats[key] = jnp.stack(values)  # [L, ...], e.g. per-expert counts [L, E]
    stats["loss"] = total
    return stats


def aux_loss_total(aux: dict) -> jax.Array:
    """The weighted aux-loss total of one MoE layer's aux output."""
    return jnp.asarray(aux["loss"], jnp.float32)
