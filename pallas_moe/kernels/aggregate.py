"""Aggregation: deterministic weighted sum of each token's expert rows.

    O[t] = sum_{j in [off[t], off[t+1])} s[r_j] * Y[r_j],   r_j = rows_by_token[j]

fp32 accumulation in the plan's CSR order (ascending expert), no atomics: each output
element is produced by exactly one thread, so the result is bitwise reproducible. With
`scores=None` the weights are 1 (the backward's dX sum).

`aggregation=` picks the rounding order (`pallas_moe.numerics`): "fp32" (above),
"bf16_per_expert" (each `s * Y[r]` rounded to bf16, the running sum rounded to bf16 after
every add: HF's `index_add_` order) or "bf16_scores" (the same with the score rounded to
bf16 before the multiply: DeepEP's combine). The bf16 modes keep the running sum in fp32
registers holding bf16 values, so the order of roundings is the reference's exactly.

One CTA (one warpgroup) owns `block_t` consecutive tokens and `block_d` columns. For each
token it walks the token's rows, loading `Y[r, c0:c0+block_d]` straight from HBM into
registers (a strided warpgroup layout: `vec` contiguous elements per thread per load) and
accumulating in fp32; the result is stored straight from registers. There is no SMEM
traffic: the kernel is a pure HBM stream, and latency is hidden by many resident CTAs.
A CTA walks its rows in groups whose loads it issues before summing them (in CSR order:
the same bits; `AggregateConfig.rows_in_flight`), and where the grid would be small (decode
batches) CTAs take fewer tokens, down to one (`AggregateConfig.resident_ctas`): one row at
a time, a CTA's rows were a chain of dependent loads, ~0.45 us a row on the H100.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.numerics import AGGREGATIONS, multiplied_scores

_WG = 128  # threads in a warpgroup
# Mosaic GPU launches the grid reversed, so the token blocks land on the CUDA grid's y
# dimension, which holds at most 65535 blocks. Above 65535 * block_t tokens each CTA walks
# more tokens (on two H200s, an expert-parallel receiver's 262144 rows failed to launch
# with CUDA_ERROR_INVALID_VALUE at block_t = 4).
MAX_GRID_Y = 65535
# Y loads a thread issues before summing them: a group of rows times the loads of one row
# (`block_d / (128 * vec)`); 16 loads of 8 bf16 = 64 registers. The decode megakernel's
# aggregation tasks take the same budget.
AGG_LOADS_IN_FLIGHT = 16


@dataclasses.dataclass(frozen=True)
class AggregateConfig:
    """Block sizes of the aggregation kernel.

    Attributes:
      block_t: tokens per CTA (walked one after another); fewer where the grid would have
        fewer than `resident_ctas` CTAs, more where the token count would need over
        `MAX_GRID_Y` CTAs (`token_blocks`).
      block_d: columns per CTA; a multiple of 128 * vec that divides d.
      vec: elements each thread loads per row (8 -> 16-byte bf16 loads).
      resident_ctas: while `block_t` tokens per CTA would give the grid fewer CTAs than
        this, CTAs take fewer tokens (down to one; the same bits, each output element
        still one thread's sum in CSR order). A CTA's rows are one chain of dependent
        loads, so a small grid is latency-bound: on the H100 (session 66) the Qwen3-30B
        layer's aggregation took 16.4 us for 8 tokens (2 CTAs of 4 tokens, 32 rows each)
        and 18.0-18.5 us for 64-128 tokens, against 4.1 us for one token's 8 rows. The
        default, 8 one-warpgroup CTAs on each of 132 SMs, keeps `block_t` at training
        sizes. 0: always `block_t`.
      rows_in_flight: rows whose loads a CTA issues before it adds them (in CSR order, so
        the same bits), at most `AGG_LOADS_IN_FLIGHT` loads per thread: a token's K rows
        then cost about one load latency instead of K (session 66; the decode megakernel's
        aggregation tasks group their loads the same way). 1: one row at a time, the form
        before session 66.
    """

    block_t: int = 4
    block_d: int = 1024
    vec: int = 8
    resident_ctas: int = 1056
    rows_in_flight: int = 8


def token_blocks(num_tokens: int, block_t: int, col_blocks: int = 1,
                 resident_ctas: int = 0) -> tuple[int, int]:
    """(tokens per CTA, CTAs along the tokens) of a grid with `col_blocks` CTAs along the
    columns: `block_t`; fewer (the fewest that keep the grid within `resident_ctas` CTAs,
    at least one) where `block_t` would give it fewer than `resident_ctas`; more where
    `num_tokens` would need over `MAX_GRID_Y` CTAs."""
    if resident_ctas:
        block_t = min(block_t, pl.cdiv(num_tokens, max(resident_ctas // col_blocks, 1)))
    block_t = max(block_t, pl.cdiv(num_tokens, MAX_GRID_Y))
    return block_t, pl.cdiv(num_tokens, block_t)


def aggregate(
    y: jax.Array,
    rows_by_token: jax.Array,
    token_row_offsets: jax.Array,
    scores: jax.Array | None = None,
    *,
    aggregation: str = "fp32",
    out_dtype=None,
    config: AggregateConfig = AggregateConfig(),
    interpret: bool | plgpu.InterpretGPUParams = False,
) -> jax.Array:
    """Sums each token's rows of `y` in CSR order.

    Args:
      y: [P_y, d] rows in grouped order (bf16 or f32), P_y >= P (extra rows are ignored).
      rows_by_token: i32 [P] grouped-row indices ordered by (token, expert) (plan.rows_by_token).
      token_row_offsets: i32 [T + 1] CSR offsets (plan.token_row_offsets).
      scores: f32 [P] per-row weights (plan.scores), or None for weight 1.
      aggregation: "fp32", "bf16_per_expert" or "bf16_scores" (the bf16 modes need scores).
      out_dtype: output dtype (default y.dtype).
      config: block sizes.
      interpret: run in Mosaic GPU interpret mode if True or an InterpretGPUParams.

    Returns:
      [T, d] in out_dtype.
    """
    if y.ndim != 2:
        raise ValueError(f"y must be [P, d], got shape {tuple(y.shape)}.")
    y_rows, d = y.shape
    if rows_by_token.ndim != 1 or rows_by_token.shape[0] > y_rows:
        raise ValueError(
            f"rows_by_token must be [P] with P <= y.shape[0]={y_rows}, got "
            f"{tuple(rows_by_token.shape)}."
        )
    capacity = rows_by_token.shape[0]
    if token_row_offsets.ndim != 1 or token_row_offsets.shape[0] < 2:
        raise ValueError(
            f"token_row_offsets must be [T + 1] with T >= 1, got {tuple(token_row_offsets.shape)}."
        )
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    if scores is not None:
        _common.require_shape("scores", scores, (capacity,))
        # "bf16_scores" multiplies by bf16-rounded scores; rounding them here, once per row,
        # is the same as rounding the scalar in the loop.
        scores = multiplied_scores(scores, aggregation)
    elif aggregation != "fp32":
        raise ValueError(
            f"aggregation={aggregation!r} weights rows by their scores; scores=None (weight 1) "
            "is the plain fp32 sum."
        )
    round_bf16 = aggregation != "fp32"
    num_tokens = token_row_offsets.shape[0] - 1
    out_dtype = jnp.dtype(out_dtype or y.dtype)
    bt, bd, vec = config.block_t, config.block_d, config.vec
    if bt < 1:
        raise ValueError(f"config.block_t={bt} must be >= 1.")
    if config.resident_ctas < 0:
        raise ValueError(f"config.resident_ctas={config.resident_ctas} must be >= 0.")
    if config.rows_in_flight < 1:
        raise ValueError(f"config.rows_in_flight={config.rows_in_flight} must be >= 1.")
    _common.require_multiple(
        "config.block_d", bd, _WG * vec, f"each of the {_WG} threads loads vec={vec} elements"
    )
    _common.require_multiple("d (y.shape[1])", d, bd, f"a CTA sums block_d={bd} columns")
    bt, grid_t = token_blocks(num_tokens, bt, d // bd, config.resident_ctas)
    layout = plgpu.Layout.WG_STRIDED((bd,), vec_size=vec)
    weighted = scores is not None
    # Rows per load group: every load of a group is issued before the group's sums.
    group = max(1, min(config.rows_in_flight, AGG_LOADS_IN_FLIGHT // (bd // (_WG * vec))))

    def body(off_ref, rows_ref, *refs):
        if weighted:
            s_ref, y_ref, o_ref = refs
        else:
            y_ref, o_ref = refs
            s_ref = None
        ti = jax.lax.axis_index("t")
        c0 = jax.lax.axis_index("d") * bd

        def one_token(i):
            t = ti * bt + i

            @pl.when(t < num_tokens)
            def _():
                def add(acc, yr, r):  # acc + row r's contribution (yr: its loaded [bd])
                    yr = yr.astype(jnp.float32)
                    if s_ref is not None:
                        yr = yr * s_ref[r]
                    if not round_bf16:
                        return acc + yr
                    yr = yr.astype(jnp.bfloat16).astype(jnp.float32)  # the row's contribution
                    return (acc + yr).astype(jnp.bfloat16).astype(jnp.float32)

                def load(r):  # [bd] of row r
                    return plgpu.load(y_ref.at[r, pl.ds(c0, bd)], layout=layout)

                def add_row(j, acc):
                    r = rows_ref[j]
                    return add(acc, load(r), r)

                acc = plgpu.layout_cast(jnp.zeros((bd,), jnp.float32), layout)
                j0, j1 = off_ref[t], off_ref[t + 1]
                if group > 1:
                    def add_group(q, acc):  # every load of the group, then its sums in order
                        rows = [rows_ref[j0 + q * group + i] for i in range(group)]
                        for r, yr in zip(rows, [load(r) for r in rows], strict=True):
                            acc = add(acc, yr, r)
                        return acc

                    num_groups = (j1 - j0) // group
                    acc = jax.lax.fori_loop(0, num_groups, add_group, acc)
                    j0 = j0 + num_groups * group
                acc = jax.lax.fori_loop(j0, j1, add_row, acc)
                o_ref[t, pl.ds(c0, bd)] = acc.astype(out_dtype)

        if bt <= config.block_t:
            for i in range(bt):  # unrolled: at most the configured block
                one_token(i)
        else:  # more tokens per CTA than configured (MAX_GRID_Y): a loop, not bt copies
            jax.lax.fori_loop(0, bt, lambda i, carry: (one_token(i), carry)[1], 0)

    kernel = plgpu.kernel(
        body,
        kernel_name="moe_aggregate",
        out_type=jax.ShapeDtypeStruct((num_tokens, d), out_dtype),
        grid=(grid_t, d // bd),
        grid_names=("t", "d"),
        interpret=_common.interpret_params(interpret),
    )
    args = [token_row_offsets.astype(jnp.int32), rows_by_token.astype(jnp.int32)]
    if weighted:
        args.append(scores)
    return kernel(*args, y)
