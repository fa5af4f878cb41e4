"""`pm.quant.moe_ffn_fp8`: the 8-bit inference forward of a SwiGLU MoE layer, fp8 (e4m3) or
int8 (W8A8 SmoothQuant), by the dtype of the quantized experts (`quantize_experts(dtype=)`):
every quantized tensor below is in that dtype, and the int8 GEMMs sum exactly in s32
(`kernels/grouped_gemm.py`, "The int8 mode").

Without smooth scales on the up-proj (`smooth_up=None`, the common fp8 serving recipe):

    Qx, sx = quantize each token of X once               e4m3 [T, d], f32 [T]: T rows, not P
    A      = swiglu(Qx[tok] @ W1q[e]^T * sx[tok] * c1[e])  bf16 [P, n]: the GEMM gathers Qx rows

With per-expert smooth scales S1 [E, d] each (token, expert) row is scaled differently, so
the rows are quantized per row, in grouped order:

    Q1, s1 = moe_smoothquant(X, S1, plan)                e4m3 [P, d], f32 [P]: gather fused
    A      = swiglu(Q1 @ W1q[e]^T * s1 * c1[e])          bf16 [P, n]: fp8 grouped GEMM, gated

Then, either way:

    Q2, s2 = smoothquant(A, S2[e(r)])                    e4m3 [P, n]: contiguous rows, no gather
    Y      = Q2 @ W2q[e]^T * s2 * c2[e]                  bf16 [P, d]: fp8 grouped GEMM
    O      = aggregate(Y, plan, scores)                  the bf16 path's aggregation

The two up-proj recipes give the same Q and s for a row when S1 is ones (`quantize_row(x[t]
* 1)` is `quantize_row(x[t])`), so they agree bit for bit on the same data. Weights come
from `quantize_experts` (per expert, per output channel e4m3 with f32 scales, stored K-major
`[E, 2n, d]` / `[E, d, n]`: 8-bit wgmma takes B only K-major). The smooth scales S1 [E, d],
S2 [E, n] multiply the activations (`calibrate_smoothing`); None means no smoothing.

A's quantization needs each row's max over all n columns: the up-proj writes A in bf16 and
the row-block quantizer (`quant.kernel.quantize_row_blocks`) quantizes its grouped rows, 64
at a time, no gather (`requantize_rows`). (Quantizing A in the up-proj's epilogue instead,
`Fp8ForwardConfig.fuse_requant`, was removed in session 63: it measured slower, docs/quant.md.)

Inference only: differentiating `moe_ffn_fp8` raises a TypeError (the quantizers have no
useful gradient).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe import _checks
from pallas_moe.numerics import AGGREGATIONS
from pallas_moe.ops.moe_ffn import resolve_backend
from pallas_moe.quant.reference import QUANTIZED_DTYPES, smoothquant_rows_reference
from pallas_moe.quant.weights import quantize_weights
from pallas_moe.routing.plan import DispatchPlan

Backend = Literal["auto", "mosaic", "interpret", "xla"]
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
# The kernels' width unit: a warpgroup's 128 threads split a SmoothQuant row, and a K step
# of the fp8 GEMM is 128 elements (one 128-byte swizzle row).
FP8_WIDTH_MULTIPLE = 128


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["w_gate_up", "gate_up_scales", "w_down", "down_scales", "smooth_up",
                 "smooth_down"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class QuantizedExperts:
    """An MoE layer's expert weights in e4m3 or int8, as `moe_ffn_fp8` reads them.

    Attributes:
      w_gate_up: e4m3 or int8 [E, 2n, d], `quantize_weights(w_gate_up, k_major=True)`.
      gate_up_scales: f32 [E, 2n], per output channel.
      w_down: [E, d, n] in w_gate_up's dtype, `quantize_weights(w_down, k_major=True)`.
      down_scales: f32 [E, d].
      smooth_up: f32 [E, d], SmoothQuant scales multiplying X before its quantization, or
        None (no smoothing: X is quantized once per token and the up-proj gathers its rows).
      smooth_down: f32 [E, n], SmoothQuant scales multiplying A before its quantization, or
        None (no smoothing).
    """

    w_gate_up: jax.Array
    gate_up_scales: jax.Array
    w_down: jax.Array
    down_scales: jax.Array
    smooth_up: jax.Array | None
    smooth_down: jax.Array | None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, d, n)."""
        num_experts, two_n, d = self.w_gate_up.shape
        return num_experts, d, two_n // 2

    @property
    def dtype(self):
        """The quantized dtype (e4m3 or int8) of the weights, and of the forward's
        quantized activations."""
        return jnp.dtype(self.w_gate_up.dtype)


def quantize_experts(
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    smooth_up: jax.Array | None = None,
    smooth_down: jax.Array | None = None,
    dtype=jnp.float8_e4m3fn,
) -> QuantizedExperts:
    """Quantizes bf16 (or f32) expert weights for `moe_ffn_fp8`.

    Args:
      w_gate_up: [E, d, 2n] (gate = [..., :n], up = [..., n:]), with the up-proj's smoothing
        already folded in when `smooth_up` is given (`calibrate_smoothing` returns both).
      w_down: [E, n, d], likewise for `smooth_down`.
      smooth_up: f32 [E, d] or None (no smoothing; kept as None, which selects the
        per-token quantization of X with the gather in the up-proj).
      smooth_down: f32 [E, n] or None (no smoothing).
      dtype: float8_e4m3fn (default: the fp8 forward) or int8 (the W8A8 forward: int8
        weights and activations, s32 sums).

    Returns:
      A `QuantizedExperts`.
    """
    _checks.check_floating("w_gate_up", w_gate_up, ndim=3)
    _checks.check_floating("w_down", w_down, ndim=3)
    num_experts, d, two_n = w_gate_up.shape
    if two_n % 2:
        raise ValueError(f"w_gate_up's last dim must be 2n (gate then up), got odd {two_n}.")
    n = two_n // 2
    if w_down.shape != (num_experts, n, d):
        raise ValueError(f"w_down must be [E, n, d] = {(num_experts, n, d)}, got {w_down.shape}.")
    smooth_up = _checked_smooth("smooth_up", smooth_up, (num_experts, d))
    smooth_down = _checked_smooth("smooth_down", smooth_down, (num_experts, n))
    dtype = jnp.dtype(dtype)
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"dtype must be float8_e4m3fn or int8, got {dtype.name}.")
    w1, c1 = quantize_weights(w_gate_up, out_dtype=dtype, k_major=True)
    w2, c2 = quantize_weights(w_down, out_dtype=dtype, k_major=True)
    return QuantizedExperts(w1, c1, w2, c2, smooth_up, smooth_down)


def _checked_smooth(name, smooth, shape):
    if smooth is None:
        return None
    _checks.check_floating(name, smooth, ndim=2)
    if tuple(smooth.shape) != shape or smooth.dtype != jnp.float32:
        raise ValueError(f"{name} must be f32 {shape}, got {smooth.dtype} {tuple(smooth.shape)}.")
    return smooth


@dataclasses.dataclass(frozen=True)
class Fp8ForwardConfig:
    """Block sizes of the fp8 forward's kernels.

    Attributes:
      up: the gated fp8 grouped GEMM (`block_k` 128).
      down: the fp8 down-proj grouped GEMM (`block_k` 128).
      quant: the SmoothQuant kernel quantizing X (per token, or per row with smooth scales).
      aggregate: the aggregation kernel.
      requant: the row-block quantizer re-quantizing A (`quant.kernel.quantize_row_blocks`:
        A's rows are already grouped, so whole 64-row blocks stream through SMEM; rows wider
        than `row_blocks_fit` allows go through the SmoothQuant kernel, one CSR entry per
        row, with its defaults).

    Session 63 removed `fuse_requant` (A quantized in the up-proj's epilogue where a CTA held
    whole rows: 7B's n = 256 only). It never won on the H100: the forward 0.89x in session 6
    (1320.7 against 1171.8 us) and 0.86x in session 10 (1295.8 against 1111.2 us);
    `benchmarks/history/session63/fp8_fused_requant.patch` restores it.
    """

    up: "GroupedMatmulConfig"
    down: "GroupedMatmulConfig"
    quant: "SmoothQuantConfig"
    aggregate: "AggregateConfig"
    requant: "RowBlockQuantConfig | None" = None

    def __post_init__(self):
        if self.requant is None:
            from pallas_moe.quant.kernel import RowBlockQuantConfig

            object.__setattr__(self, "requant", RowBlockQuantConfig())

    @classmethod
    def for_shape(cls, d: int, n: int, *, num_sms: int | None = None,
                  promote_every: int = 0) -> "Fp8ForwardConfig":
        """Defaults for model width `d` and expert width `n` (multiples of 128).

        Promotion is off by default: measured on the H100 (session 4, `benchmarks/quant.py
        --fp8`), it slows the forward by 10-16% (7B 1476 -> 1618 us, 30B 5558 -> 6463 us at
        every K block) and leaves the layer's error unchanged (0.0646 against bf16 with or
        without; the re-quantization of A to e4m3 dominates the error, not the accumulation).
        Pass `promote_every=1` for GEMM outputs closer to exact f32 sums.

        `promote_every`: both GEMMs' `fp8_promote_every` (K blocks of 128 between the adds
        of the tensor cores' partial sums into f32 registers; 0 = never, see
        `kernels/grouped_gemm.py`). Promotion holds a second accumulator set, so it takes
        narrower column blocks. SMEM per CTA, promoted: up 6 stages x (A 16 KB + gate and up
        tiles 2 x 8 KB) + 16 KB output = 208 KB; down 128 columns, 5 x 32 KB + 32 KB = 192 KB.
        Not promoted: up 128 columns, 4 x 48 KB + 16 KB (one output slab per consumer at a
        time, `out_slabs=1`) = 208 KB; down 256 columns,
        3 x 48 KB + 64 KB = 208 KB (128 columns, 4 stages, when 256 does not divide d), or
        from n = 512 on the 128-row ping-pong schedule, 5 x 32 KB + 2 x 16 KB (one output
        slab per consumer) = 192 KB.
        """
        from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
        from pallas_moe.kernels.moe_forward import ForwardConfig, default_num_sms
        from pallas_moe.quant.kernel import SmoothQuantConfig

        for name, value in (("d", d), ("n", n)):
            if value % FP8_WIDTH_MULTIPLE:
                raise ValueError(
                    f"{name}={value} must be a multiple of {FP8_WIDTH_MULTIPLE} for the fp8 kernels."
                )
        num_sms = default_num_sms() if num_sms is None else num_sms
        gemm = functools.partial(GroupedMatmulConfig, block_m=128, block_k=128, num_sms=num_sms,
                                 fp8_promote_every=promote_every)
        # The up-proj gathers token rows with cp.async: with 3 stages the lagged publish
        # ("wait_group") would keep one step of loads in flight, the hardware-tracked one
        # ("mbarrier") all three (benchmarks/quant.py --fp8 times both).
        gemm = functools.partial(gemm, gather_completion="mbarrier")
        if promote_every:
            up = gemm(block_n=64, num_stages=6)
            down = gemm(block_n=128, num_stages=5)
        else:
            # 4 stages of 48 KB fit only beside one staged 64-column output slab per consumer
            # (the whole 128-column tile: 229 KB of 227). Measured on an H200 (session 36,
            # `benchmarks/quant.py --fp8 --up-sweep`, same runs, bitwise equal): 30B 1746 us
            # against 1802-1805 with 3 stages, and 1772-1776 against 1826 (1.03x; the slab
            # staging alone: level); 7B 312-321 against 324 (1.01-1.04x).
            up = gemm(block_n=128, num_stages=4, out_slabs=1)
            if n >= 512:
                # Measured on the H100 (session 9, same run, bitwise equal): with K = n of at
                # least 4 blocks of 128, the consumers alternating 128-row items (ping-pong,
                # 5 x 32 KB + 64 KB) beat split-M 256-column items, 1177.6 vs 1341.5 us at
                # 30B; at 7B (n = 256, 2 K blocks per item) split M stays ahead (267.6 vs
                # 290.8 us).
                # One output slab staged at a time (as the up-proj; its freed 16 KB would
                # hold a 6th stage, measured slower): on an H200 (session 37,
                # `benchmarks/quant.py --fp8 --down-sweep`, two runs, bitwise equal) 30B
                # 1139.4 -> 1123.9 us and 1158-1159 -> 1144 (1.011-1.012x); 6 stages
                # 0.99x in both.
                down = gemm(block_n=128, num_stages=5, pingpong=True, out_slabs=1)
            elif d % 256 == 0:
                down = gemm(block_n=256, num_stages=3)
            else:
                down = gemm(block_n=128, num_stages=4)
        agg = ForwardConfig.for_shape(d, n, num_sms=num_sms).aggregate
        # X per token, one token per CTA: 41.5 us at 7B (0.93 of a device copy; 4 per CTA
        # 40.1), 133.3 us at 30B (1.03; 4 per CTA 148.1) on the H100 (session 10, same run,
        # `benchmarks/history/session10/quant_ab.py`).
        return cls(up=up, down=down, quant=SmoothQuantConfig(), aggregate=agg)


def check_fp8_inputs(x: jax.Array, plan: DispatchPlan, experts: QuantizedExperts) -> None:
    """Raises a clear error when `moe_ffn_fp8`'s inputs disagree."""
    if not isinstance(plan, DispatchPlan):
        raise TypeError(f"plan must be a pallas_moe.routing.DispatchPlan, got {type(plan).__name__}.")
    if not isinstance(experts, QuantizedExperts):
        raise TypeError(
            "experts must be a pallas_moe.quant.QuantizedExperts (from quantize_experts), got "
            f"{type(experts).__name__}."
        )
    _checks.check_floating("x", x, ndim=2)
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"x must be bf16, got {x.dtype}.")
    num_tokens, d = x.shape
    if experts.w_gate_up.ndim != 3:
        raise ValueError(f"experts.w_gate_up must be [E, 2n, d], got {experts.w_gate_up.shape}.")
    num_experts, d_w, n = experts.shape
    if d_w != d:
        raise ValueError(f"experts.w_gate_up must be [E, 2n, d] with d={d} from x; got "
                         f"{experts.w_gate_up.shape}.")
    if experts.dtype not in QUANTIZED_DTYPES:
        raise ValueError(
            f"experts.w_gate_up must be float8_e4m3fn or int8, got {experts.dtype.name}."
        )
    expected = {
        "w_gate_up": ((num_experts, 2 * n, d), experts.dtype),
        "gate_up_scales": ((num_experts, 2 * n), jnp.float32),
        "w_down": ((num_experts, d, n), experts.dtype),
        "down_scales": ((num_experts, d), jnp.float32),
        "smooth_up": ((num_experts, d), jnp.float32),
        "smooth_down": ((num_experts, n), jnp.float32),
    }
    for name, (shape, dtype) in expected.items():
        value = getattr(experts, name)
        if value is None and name.startswith("smooth_"):
            continue
        if tuple(value.shape) != shape or value.dtype != jnp.dtype(dtype):
            raise ValueError(
                f"experts.{name} must be {jnp.dtype(dtype).name} {shape}, got "
                f"{value.dtype} {tuple(value.shape)}."
            )
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan was built for T={plan.num_tokens} tokens but x has T={num_tokens}.")
    if plan.num_experts != num_experts:
        raise ValueError(f"experts has {num_experts} experts but the plan routes to E={plan.num_experts}.")


def moe_ffn_fp8(
    x: jax.Array,
    plan: DispatchPlan,
    experts: QuantizedExperts,
    *,
    backend: Backend = "auto",
    config: Fp8ForwardConfig | None = None,
    aggregation: str = "fp32",
    interpret_params: plgpu.InterpretGPUParams | None = None,
) -> jax.Array:
    """8-bit inference forward of a SwiGLU MoE layer: fp8 (e4m3) or, with int8 experts,
    W8A8 int8 (module docstring for the steps).

    Args:
      x: bf16 [T, d] tokens.
      plan: the `DispatchPlan` (top-K or token rounding).
      experts: `quantize_experts(w_gate_up, w_down, ...)`; its dtype (e4m3 or int8) picks
        the forward's.
      backend: "mosaic" (Pallas kernels on a Hopper GPU), "interpret" (the same kernels in
        Mosaic GPU interpret mode, for CPU tests), "xla" (jnp references of every step,
        runs anywhere) or "auto" (mosaic on Hopper when d and n are multiples of 128, else xla).
      config: kernel block sizes (`Fp8ForwardConfig.for_shape(d, n)` if None).
      aggregation: "fp32", "bf16_per_expert" or "bf16_scores" (`pallas_moe.numerics`).
      interpret_params: interpret-mode settings (e.g. `detect_races=True`) for "interpret".

    Returns:
      bf16 [T, d]. Not differentiable: `jax.grad` / `jax.jvp` raise a TypeError.
    """
    check_fp8_inputs(x, plan, experts)
    _checks.check_choice("aggregation", aggregation, AGGREGATIONS)
    num_experts, d, n = experts.shape
    widths_fit = d % FP8_WIDTH_MULTIPLE == 0 and n % FP8_WIDTH_MULTIPLE == 0
    resolved = resolve_backend(backend)
    if backend == "auto" and not widths_fit:
        resolved = "xla"
    if config is not None:
        if not isinstance(config, Fp8ForwardConfig):
            raise TypeError(f"config must be an Fp8ForwardConfig or None, got {type(config).__name__}.")
        if resolved == "xla" and backend == "xla":
            raise ValueError("config sets kernel block sizes; backend='xla' runs no kernels.")
    if resolved == "xla":
        run = functools.partial(_forward_xla, aggregation=aggregation)
    else:
        if not widths_fit:
            raise ValueError(
                f"backend={backend!r}: the fp8 kernels need d and n multiples of "
                f"{FP8_WIDTH_MULTIPLE}, got d={d}, n={n}; use backend='xla' or 'auto'."
            )
        interpret = (interpret_params or True) if resolved == "interpret" else False
        if config is None:
            config = Fp8ForwardConfig.for_shape(d, n, num_sms=4 if interpret else None)
        run = functools.partial(_forward_kernels, config=config, aggregation=aggregation,
                                interpret=interpret)
    return _inference_only(run, x, plan, experts)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _inference_only(run, x, plan, experts):
    return run(x, plan, experts)


@_inference_only.defjvp
def _no_derivative(run, primals, tangents):
    del run, primals, tangents
    raise TypeError(
        "pm.quant.moe_ffn_fp8 is inference-only: its quantizers have no useful derivative. "
        "Differentiate pm.moe_ffn (bf16) instead."
    )


def _row_experts(plan: DispatchPlan) -> jax.Array:
    """i32 [P] expert of each grouped row, clamped to [0, E) (padding rows: E - 1)."""
    return jnp.minimum(plan.expert_ids, plan.num_experts - 1)


def _smooth_or_ones(smooth: jax.Array | None, num_experts: int, width: int) -> jax.Array:
    """f32 [E, width]: the smooth scales, or ones (`x * 1` is exact) where there are none."""
    return jnp.ones((num_experts, width), jnp.float32) if smooth is None else smooth


def _forward_kernels(x, plan, experts: QuantizedExperts, *, config: Fp8ForwardConfig,
                     aggregation, interpret):
    return fp8_forward_stages(x, plan, experts, config=config, aggregation=aggregation,
                              interpret=interpret)["out"]


def fp8_forward_stages(x, plan, experts: QuantizedExperts, *, config: Fp8ForwardConfig,
                       aggregation: str = "fp32", interpret=False) -> dict[str, jax.Array]:
    """The kernels of `moe_ffn_fp8` step by step (no input checks; the GPU tests check each
    step against its reference fed with the kernel's own inputs).

    Returns:
      dict: "q1" (the experts' dtype: e4m3 or int8, as "q2") and "s1" f32, the up-proj's quantized input (without smooth scales:
      per token, [T, d] and [T]; with them: per grouped row, [P_up, d] and [P_up]), "a" bf16
      [P, n], "q2" [P_down, n] and "s2" f32 [P_down], "y" bf16 [P, width] (width =
      `aggregate_width(d)`), "out" bf16 [T, d] (`moe_ffn_fp8`'s result).
    """
    from pallas_moe.kernels import _common
    from pallas_moe.kernels.aggregate import aggregate
    from pallas_moe.kernels.grouped_gemm import grouped_matmul
    from pallas_moe.kernels.moe_forward import aggregate_width
    from pallas_moe.quant.kernel import quantize_tokens_kernel, smoothquant_kernel

    d = experts.shape[1]
    qdtype = experts.dtype
    prefix = "moe_fp8" if qdtype == E4M3 else "moe_int8"
    capacity = plan.capacity
    # Each GEMM loads whole aligned row blocks: the quantized rows (and their scales) come
    # out of the SmoothQuant kernel padded to them, zero-filled, so no copy pads them later.
    up_rows = -(-capacity // config.up.block_m) * config.up.block_m
    down_rows = -(-capacity // config.down.block_m) * config.down.block_m
    row_experts = _row_experts(plan)
    up_meta = _common.aligned_tile_meta(plan.group_sizes, capacity, config.up.block_m)
    up = dict(transpose_w=True, config=config.up, interpret=interpret, meta=up_meta,
              capacity=capacity, col_scales=experts.gate_up_scales, gated=True,
              names=("q", "experts.w_gate_up"), kernel_name=f"{prefix}_up_proj")
    if experts.smooth_up is None:
        q1, s1 = quantize_tokens_kernel(x, out_dtype=qdtype, config=config.quant,
                                        interpret=interpret)
        a = grouped_matmul(q1, plan.group_sizes, experts.w_gate_up, row_scales=s1,
                           token_ids=plan.token_ids, **up)
    else:
        q1, s1 = smoothquant_kernel(  # tokens' rows at their grouped positions (gather fused)
            x, experts.smooth_up, plan.token_row_offsets, plan.rows_by_token,
            row_experts[plan.rows_by_token], plan.num_rows, num_out_rows=up_rows,
            out_dtype=qdtype, config=config.quant, interpret=interpret,
        )
        a = grouped_matmul(q1, plan.group_sizes, experts.w_gate_up, row_scales=s1, **up)
    # a: bf16 [P, n]; padding rows unwritten (never read: rows past num_rows come out as zeros)
    q2, s2 = requantize_rows(a, experts.smooth_down, plan, num_out_rows=down_rows,
                             config=config.requant, interpret=interpret, out_dtype=qdtype)
    down_meta = up_meta if config.down.block_m == config.up.block_m else (
        _common.aligned_tile_meta(plan.group_sizes, capacity, config.down.block_m)
    )
    width = aggregate_width(d)
    y = grouped_matmul(
        q2, plan.group_sizes, experts.w_down, transpose_w=True, config=config.down,
        interpret=interpret, meta=down_meta, capacity=capacity, out_cols=width, row_scales=s2,
        col_scales=experts.down_scales, names=("q", "experts.w_down"),
        kernel_name=f"{prefix}_down_proj",
    )  # bf16 [P, width]
    out = aggregate(
        y, plan.rows_by_token, plan.token_row_offsets, plan.scores, aggregation=aggregation,
        out_dtype=x.dtype, config=config.aggregate, interpret=interpret,
    )
    out = out[:, :d] if width != d else out
    return dict(q1=q1, s1=s1, a=a, q2=q2, s2=s2, y=y, out=out)


def requantize_rows(a, smooth, plan: DispatchPlan, *, num_out_rows: int,
                    config: "RowBlockQuantConfig", interpret=False, out_dtype=E4M3):
    """`(Q [num_out_rows, n] in out_dtype (e4m3 or int8), s f32 [num_out_rows])` of A's
    grouped rows, each row times its expert's smooth scale (`smooth` f32 [E, n] or None),
    zero rows past `plan.num_rows`: the row-block quantizer, or for rows too wide for its
    SMEM blocks the SmoothQuant kernel with one CSR entry per row (no gather)."""
    from pallas_moe.quant.kernel import (
        SmoothQuantConfig, quantize_row_blocks, row_blocks_fit, smoothquant_kernel,
    )

    if row_blocks_fit(a.shape[1], a.dtype.itemsize, 1) and num_out_rows % 64 == 0:
        return quantize_row_blocks(a, smooth, plan.group_sizes, plan.num_rows,
                                   num_out_rows=num_out_rows, out_dtype=out_dtype, config=config,
                                   interpret=interpret)
    rows = jnp.arange(plan.capacity + 1, dtype=jnp.int32)
    return smoothquant_kernel(
        a, smooth, jnp.minimum(rows, plan.num_rows), rows[:-1], _row_experts(plan),
        plan.num_rows, num_out_rows=num_out_rows, out_dtype=out_dtype,
        config=SmoothQuantConfig(block_t=16), interpret=interpret,
    )


def _forward_xla(x, plan, experts: QuantizedExperts, *, aggregation):
    """The same steps through the jnp references (same formulas and rounding points; the
    GEMMs' f32 sums run in another order)."""
    from pallas_moe.kernels.reference import fp8_grouped_matmul_reference
    from pallas_moe.ops.xla import aggregate_rows

    num_experts, d, n = experts.shape
    row_experts = _row_experts(plan)
    valid = plan.row_is_valid
    # Per (token, expert) row, the formula both kernel recipes compute (module docstring).
    q1, s1 = smoothquant_rows_reference(
        x, _smooth_or_ones(experts.smooth_up, num_experts, d), plan.token_ids, row_experts,
        valid, experts.dtype
    )
    a = fp8_grouped_matmul_reference(
        q1, plan.group_sizes, experts.w_gate_up, s1, experts.gate_up_scales, gated=True
    )
    rows = jnp.arange(plan.capacity, dtype=jnp.int32)
    q2, s2 = smoothquant_rows_reference(
        a, _smooth_or_ones(experts.smooth_down, num_experts, n), rows, row_experts, valid,
        experts.dtype,
    )
    y = fp8_grouped_matmul_reference(
        q2, plan.group_sizes, experts.w_down, s2, experts.down_scales, gated=False
    )
    return aggregate_rows(y, plan, aggregation).astype(x.dtype)
