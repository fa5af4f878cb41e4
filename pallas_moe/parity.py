"""Training–inference drift: k3 and exact KL between two configurations of one model, the
per-layer hidden-state error and routing flip rate, and a sampler for causal LMs.

The measurement (`python -m train.parity` runs it on the byte-level model of `train/`):

1. A reference configuration samples N prompts x M tokens (`sample_continuations`).
2. The reference and a candidate configuration score the same sequences.
3. `drift` compares them over the generated tokens:

   - `k3`: the mean over generated tokens x of `r - 1 - log r` with
     `r = q(x) / p(x)`, p the reference (the sampler), q the candidate. It is Schulman's
     non-negative, unbiased estimator of KL(p || q) from samples of p; the pass bar used for
     RL on MoE models is k3 < 1e-3.
   - `kl`: the exact KL(p || q) over the whole byte vocabulary, averaged over the same
     positions (what k3 estimates).
   - `max_abs_logp`: the largest |log q(x) - log p(x)| over generated tokens.
   - per layer, `hidden_rel_err` (||h_q - h_p||_F / ||h_p||_F over the scored positions)
     and `flip_rate`: the share of those positions whose top-K expert set differs.

Everything is computed in float64 numpy from the models' float32 outputs (`expm1` keeps
k3 exact for tiny log-ratios, where `r - 1 - log r` would cancel to 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


def log_softmax64(logits) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def k3_per_token(logp_sampler, logp_other) -> np.ndarray:
    """`r - 1 - log r` with `log r = logp_other - logp_sampler`, elementwise, float64.

    Args:
      logp_sampler: log-probabilities of the sampled tokens under the distribution that
        sampled them (p).
      logp_other: log-probabilities of the same tokens under the other distribution (q).

    Returns:
      k3 of each token (>= 0); its mean estimates KL(p || q).
    """
    log_r = np.asarray(logp_other, np.float64) - np.asarray(logp_sampler, np.float64)
    return np.expm1(log_r) - log_r


def k3(logp_sampler, logp_other) -> float:
    """Mean k3 over all given tokens (see `k3_per_token`)."""
    return float(np.mean(k3_per_token(logp_sampler, logp_other)))


def exact_kl(logits_p, logits_q) -> float:
    """Mean over positions of KL(p || q) = sum_v p_v (log p_v - log q_v), float64.

    Args:
      logits_p, logits_q: [..., V] logits (unnormalized) of the two distributions.
    """
    lp, lq = log_softmax64(logits_p), log_softmax64(logits_q)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def relative_error(reference, candidate) -> float:
    """||candidate - reference||_F / ||reference||_F in float64."""
    ref = np.asarray(reference, np.float64)
    diff = np.asarray(candidate, np.float64) - ref
    return float(np.linalg.norm(diff) / max(np.linalg.norm(ref), np.finfo(np.float64).tiny))


def flip_rate(selected_ref, selected_cand) -> float:
    """Share of tokens whose expert set differs. selected_*: bool [..., E]."""
    a, b = np.asarray(selected_ref, bool), np.asarray(selected_cand, bool)
    return float(np.mean(np.any(a != b, axis=-1)))


@dataclasses.dataclass(frozen=True)
class Drift:
    """How far a candidate configuration is from the reference (module docstring).

    Attributes:
      k3: mean k3 over generated tokens.
      kl: mean exact KL(reference || candidate) over the same positions.
      max_abs_logp: max |log q(x) - log p(x)| over generated tokens.
      hidden_rel_err: per layer, relative Frobenius error of the hidden state.
      flip_rate: per layer, share of positions whose top-K expert set differs.
      num_tokens: generated tokens compared.
    """

    k3: float
    kl: float
    max_abs_logp: float
    hidden_rel_err: tuple[float, ...]
    flip_rate: tuple[float, ...]
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def logit_drift(generated, logits_p, logits_q) -> tuple[float, float, float]:
    """(k3, exact KL, max |dlogp|) of sampled tokens under two distributions' logits.

    Args:
      generated: int [...] the tokens sampled from p.
      logits_p, logits_q: [..., V] the logits each distribution gave at those positions.
    """
    generated = np.asarray(generated)
    lp, lq = log_softmax64(logits_p), log_softmax64(logits_q)
    logp = np.take_along_axis(lp, generated[..., None], axis=-1)[..., 0]
    logq = np.take_along_axis(lq, generated[..., None], axis=-1)[..., 0]
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))
    return k3(logp, logq), kl, float(np.max(np.abs(logq - logp)))


def drift(
    tokens,
    prompt_len: int,
    ref_logits,
    cand_logits,
    *,
    ref_hidden=None,
    cand_hidden=None,
    ref_selected=None,
    cand_selected=None,
) -> Drift:
    """Compares two scorings of the same sequences over their generated tokens.

    Args:
      tokens: int [N, S] sequences: a prompt of `prompt_len` tokens, then generated ones.
      prompt_len: P; positions P-1 .. S-2 predict the generated tokens P .. S-1.
      ref_logits, cand_logits: [N, S, V] logits of the reference and the candidate.
      ref_hidden, cand_hidden: optional [L, N, S, d] hidden state after each layer.
      ref_selected, cand_selected: optional bool [L, N, S, E] top-K expert sets per layer.

    Returns:
      A `Drift` (per-layer fields are empty tuples when the hidden states or sets are None).
    """
    tokens = np.asarray(tokens)
    num_seqs, seq_len = tokens.shape
    if not 1 <= prompt_len < seq_len:
        raise ValueError(f"prompt_len must be in [1, S={seq_len}), got {prompt_len}.")
    for name, a in (("ref_logits", ref_logits), ("cand_logits", cand_logits)):
        if np.shape(a)[:2] != (num_seqs, seq_len):
            raise ValueError(f"{name} must be [N, S, V] with N, S = {tokens.shape}, got {np.shape(a)}.")
    scored = slice(prompt_len - 1, seq_len - 1)  # positions whose logits predict a generated token
    generated = tokens[:, prompt_len:]  # [N, M]
    k3_value, kl, max_abs = logit_drift(
        generated, np.asarray(ref_logits)[:, scored], np.asarray(cand_logits)[:, scored]
    )
    hidden_err: tuple[float, ...] = ()
    if ref_hidden is not None and cand_hidden is not None:
        hidden_err = tuple(
            relative_error(r[:, scored], c[:, scored]) for r, c in zip(ref_hidden, cand_hidden)
        )
    flips: tuple[float, ...] = ()
    if ref_selected is not None and cand_selected is not None:
        flips = tuple(flip_rate(r[:, scored], c[:, scored]) for r, c in zip(ref_selected, cand_selected))
    return Drift(
        k3=k3_value,
        kl=kl,
        max_abs_logp=max_abs,
        hidden_rel_err=hidden_err,
        flip_rate=flips,
        num_tokens=int(generated.size),
    )


def sample_continuations(
    logits_fn: Callable[[Any, jax.Array], jax.Array],
    state: Any,
    prompts,
    num_tokens: int,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Samples `num_tokens` tokens after each prompt from a causal LM, at temperature 1.

    Every step runs `logits_fn(state, buffer)` on the whole fixed-size buffer `[N, P + M]`
    (positions not generated yet hold 0; a causal model never reads them for earlier
    positions), so one compiled program serves every step.

    Args:
      logits_fn: `(state, tokens i32[N, S]) -> logits [N, S, V]`, causal.
      state: the model's arrays (a pytree), passed through to `logits_fn`.
      prompts: int [N, P] prompt tokens.
      num_tokens: M >= 1 tokens to generate per prompt.
      key: PRNG key; step i samples with `fold_in(key, i)`.

    Returns:
      (tokens i32[N, P + M], logits f32[N, M, V]): the sequences and the logits each
      generated token was sampled from.
    """
    prompts = jnp.asarray(prompts, jnp.int32)
    if prompts.ndim != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [N, P] with P >= 1, got shape {prompts.shape}.")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}.")
    num_seqs, prompt_len = prompts.shape

    @jax.jit
    def run(state, prompts, key):
        buf = jnp.zeros((num_seqs, prompt_len + num_tokens), jnp.int32).at[:, :prompt_len].set(prompts)

        def step(i, carry):
            buf, sampled_logits = carry
            logits = logits_fn(state, buf)  # [N, S, V]
            pos = prompt_len + i
            last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)  # [N, V]
            last = last.astype(jnp.float32)
            tok = jax.random.categorical(jax.random.fold_in(key, i), last).astype(jnp.int32)  # [N]
            buf = jax.lax.dynamic_update_index_in_dim(buf, tok, pos, axis=1)
            sampled_logits = jax.lax.dynamic_update_index_in_dim(sampled_logits, last, i, axis=1)
            return buf, sampled_logits

        vocab = jax.eval_shape(logits_fn, state, buf).shape[-1]
        init = (buf, jnp.zeros((num_seqs, num_tokens, vocab), jnp.float32))
        return jax.lax.fori_loop(0, num_tokens, step, init)

    return run(state, prompts, key)


def topk_sets(layer, x: jax.Array) -> jax.Array:
    """bool [T, E]: the top-K expert set a `pm.nn.MoE` layer picks for each token of x.

    Token choice only (token rounding's additions depend on the whole batch); uses the
    layer's router, selection bias, score order and `numerics.router_dtype`.
    """
    from pallas_moe.nn import functional as F
    from pallas_moe.routing.topk import topk_assignment

    xt = x.reshape(-1, layer.d_model).astype(layer.compute_dtype(x))  # [T, d]
    logits = F.router_logits(xt, layer.router[...], dtype=layer.numerics.router_dtype)  # f32[T, E]
    bias = None if layer.selection_bias is None else layer.selection_bias[...]
    selected, _ = topk_assignment(
        logits, layer.top_k, score=layer.config.score, renormalize=layer.config.renormalize,
        bias=bias,
    )
    return selected
