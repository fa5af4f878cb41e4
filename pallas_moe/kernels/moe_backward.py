"""Backward of one MoE layer through the Mosaic GPU kernels (docs/math.md, without Y).

    dH, A', dS = dh_kernel(dO, H, plan)       gather of dO fused into the load, dSwiGLU epilogue
                 (or, d >= 2048: dh_split, the gathered GEMM dA' = dO[tok] W2^T rounded
                 to bf16, then the dSwiGLU row pass)
    dW2        = weight_grad(A', dO)          varlen-K, gather of dO fused into the load
    dW1        = weight_grad(X, dH)           varlen-K, gather of X fused into the load
    dX~        = dx_rows(dH, W1)              varlen-M grouped GEMM, dX~ transient
    dX         = aggregate(dX~, plan)         deterministic CSR sum (no scores), fp32 accumulate

The activation (plain or clamped SwiGLU) is the dH epilogue's. With expert biases, H
already holds b1 (the up-proj adds it before rounding), so the kernels above are unchanged;
db1, db2 and the b2 term of dS come from `ops.minimal_backward.expert_bias_gradients`:
three deterministic dense products over the plan (a one-hot GEMM over dH's rows, a
[E, T] score matrix times dO, and dO @ b2^T gathered per row).

Same contract as `pallas_moe.ops.minimal_backward.moe_ffn_backward`, which is its reference.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels.aggregate import AggregateConfig, aggregate
from pallas_moe.kernels.dh import DHConfig, dh_kernel, dh_split
from pallas_moe.kernels.dx import dx_rows
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
from pallas_moe.kernels.moe_forward import (
    PINGPONG_DOWN, ForwardConfig, aggregate_width, default_device_kind, default_num_sms,
    pingpong_down_config,
)
from pallas_moe.kernels.schedules import PlanSchedules, backward_schedules, require_block
from pallas_moe.kernels.weight_grad import (
    PERSISTENT_SMEM_BUDGET, WeightGradConfig, persistent_smem_bytes, weight_grad,
)
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.ops.minimal_backward import expert_bias_gradients


def _largest_block(dim: int, candidates: tuple[int, ...]) -> int:
    for c in candidates:
        if dim % c == 0:
            return c
    raise ValueError(f"no block size in {candidates} divides {dim}.")


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Block sizes of the five backward kernels."""

    dh: DHConfig = DHConfig()
    # dH split in two (`dh.dh_split`) where set: this gathered grouped GEMM writes dA' (in
    # `dh_da_dtype`), then the dSwiGLU row pass (with `dh.approx_math` and
    # `dh.pad_rows_to`); None runs the fused dH kernel with `dh`.
    dh_gemm: GroupedMatmulConfig | None = None
    # dA' between the split dH's two kernels: "float32" (dH and A' bitwise the fused
    # kernel's) or "bfloat16" (half its bytes written and read back; dH and dS from the
    # rounded dA', A' unchanged; `for_shape`'s choice wherever it splits dH, measured
    # faster in session 63). Only with `dh_gemm`: the fused kernel keeps dA' in registers.
    dh_da_dtype: str = "float32"
    dw_down: WeightGradConfig = WeightGradConfig()  # dW2 = A'^T dO: M = n, N = d (gathered)
    dw_gate_up: WeightGradConfig = WeightGradConfig()  # dW1 = X^T dH: M = d (gathered), N = 2n
    dx: GroupedMatmulConfig = GroupedMatmulConfig()
    aggregate: AggregateConfig = AggregateConfig()

    def __post_init__(self):
        if self.dh_da_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                f"dh_da_dtype must be 'float32' or 'bfloat16', got {self.dh_da_dtype!r}."
            )
        gemm = self.dh_gemm
        if gemm is None:
            if self.dh_da_dtype != "float32":
                raise ValueError(
                    f"dh_da_dtype={self.dh_da_dtype!r} is the split dH's intermediate: it "
                    "needs dh_gemm (None runs the fused dH, which keeps dA' in registers; "
                    "pass dh_da_dtype='float32' with dh_gemm=None)."
                )
            return
        if not isinstance(gemm, GroupedMatmulConfig):
            raise TypeError(
                f"dh_gemm must be a GroupedMatmulConfig or None, got {type(gemm).__name__}."
            )
        if not gemm.gathers_rows:
            raise ValueError(
                "dh_gemm runs the grouped GEMM's gathered mode: it needs split-M items "
                "(pingpong=False)."
            )

    @classmethod
    def for_shape(
        cls, d: int, n: int, *, num_sms: int | None = None, gather: str = "cp_async",
        device_kind: str | None = None, **overrides
    ) -> "BackwardConfig":
        """Default block sizes dividing the model width `d` and expert width `n`.

        Both must be multiples of 64 (`ValueError` naming the argument otherwise). `num_sms`:
        CTAs of the persistent dH, dX~ and weight-gradient kernels (default:
        the device's SM count). `gather`: the row loader of dH and both weight gradients,
        "cp_async" (default) or "tma" (see `DHConfig.gather`). `device_kind`: the GPU the
        defaults are tuned for (default: the default device's `device_kind`); an H200 gets
        its own measured choices. `overrides` may replace any of the five configs or
        `dh_da_dtype` (`dh_gemm=None`, the fused dH, implies `dh_da_dtype="float32"`).
        """
        if num_sms is None:
            num_sms = default_num_sms()
        if device_kind is None:
            device_kind = default_device_kind()
        if gather not in _common.GATHER_MODES:
            raise ValueError(f"gather must be one of {_common.GATHER_MODES}, got {gather!r}.")
        _common.require_multiple("d", d, 64, "the kernels tile the model width by 64")
        _common.require_multiple("n", n, 64, "the kernels tile the expert width by 64")
        k = 64  # contraction rows per step of the varlen-K kernels (one 8-row-tiled block)
        # dH: two consumer warpgroups of 128 (or 64) columns share each gathered dO stage;
        # A' and H reuse the pipeline's SMEM, which leaves room for 5 stages at 128
        # (measured on the H100 with the one-CTA-per-tile kernel, removed in session 42:
        # 5 stages 729 us, 4 760, 3 with H prefetched 901 at 7B).
        if n % 256 == 0:
            dh = DHConfig(block_n=128, num_stages=5, num_consumers=2, pad_rows_to=k)
        elif n % 128 == 0:
            dh = DHConfig(block_n=64, num_stages=4, num_consumers=2, pad_rows_to=k)
        elif n % 192 == 0:
            # Three consumers of 64 columns where 128 does not divide n but 192 does (gpt-oss:
            # n = 2880). Measured on the H100 (session 48, `benchmarks/backward.py --shapes
            # gpt-oss-20b --sweep narrow`, 2 rounds, same error against the reference): one
            # consumer of 64 columns 3605.3 us (151 TFLOP/s), three 1742.7 (2.069x), one of
            # 192 columns 1781.1 (2.024x). Three consumers write the same partial sums of dS
            # as one (64 columns each), so every output keeps its bits.
            dh = DHConfig(block_n=64, num_stages=4, num_consumers=3, pad_rows_to=k)
        else:
            dh = DHConfig(block_n=64, num_stages=4, num_consumers=1, pad_rows_to=k)
        # Persistent CTAs (one per SM) walk the tiles, the producer loading the next tile's
        # ids, scores and first K steps while the consumers run the epilogue, whose tiles
        # are 128-byte-swizzled slabs (no bank conflicts) that the consumers fill with their
        # own cp.async loads of H (the only dH kernel since session 42, which removed the
        # one-CTA-per-tile kernel and the untiled epilogue tiles measured here). Measured
        # (bitwise the same outputs every time): session
        # 14 on the H100, persistent with untiled tiles 7B 582.0 -> 556.5-558.1 us against
        # one CTA per tile with `early_h`, level at 30B (so d >= 4096 kept one CTA per tile,
        # loading H during its last K steps with hardware-tracked stages). Session 21, the
        # swizzled, cp.async-loaded epilogue, same runs: an H200, 7B 538.9 -> 437.7 us
        # (1.23x; skewed routing 1.23x), Qwen3 widths 1248.2 -> 1061.7 (1.18x); the H100,
        # 7B 565.5 -> 488.3 us (step 3.705 -> 3.621 ms), d = 2880 1237.3 -> 1151.5, 30B
        # 2848.7 (one CTA per tile) -> 2731.5 us (step 20.610 -> 20.374 ms, dH 3.322 ->
        # 2.932 in it), d = 7168 1152.2 (one CTA per tile) -> 1131.8. The same slabs loaded
        # by TMA boxes were 0.92-0.95x (session 19's finding, reproduced).
        dh = dataclasses.replace(dh, persistent_ctas=num_sms, h_loader="cp_async")
        # Long K loops (d >= 2048): dH split in two, the up-proj's 128 x 256 items writing
        # dA' rounded to bf16, then the dSwiGLU as a pass at copy speed. Measured on the
        # H100: session 60 (`history/session60/dh_split.py`, 2 paired rounds) with dA' in
        # f32 (dH and A' bitwise the fused kernel's): 30B 2638.8 -> 2295.4 us (1.150x; GEMM
        # 1660 us, 662 TFLOP/s; pass 616 us, 3.05 TB/s), Qwen3-30B-A3B widths (d = 2048)
        # 0.979x, 7B 0.866x. Session 63 (`history/session62/dh_bf16_da.py`, 2 paired
        # rounds), dA' in bf16 against the fused kernel: 30B 1.235x (the f32 split 1.154x),
        # Qwen3-30B-A3B widths 1.083x (f32 0.973x), 7B 0.994x (f32 0.868x); in the training
        # step's profiles dH 2.331 -> 2.157 ms at 30B, 1.214 -> 1.090 at Qwen3 widths. dH
        # from the rounded dA' has one more bf16 rounding than the fused kernel's (0.28%
        # against the XLA reference, 0.01% with dA' in f32): the rounding an unfused bf16
        # backward makes; `dh_da_dtype="float32"` keeps the fused kernel's bits. Four stages
        # of 48 KB beside one staged 64-column output slab per consumer. The same rule on an
        # H200 (not measured there; its faster HBM makes the pass cheaper).
        dh_gemm, dh_da_dtype = None, "float32"
        if d >= 2048 and n % 256 == 0:
            dh_gemm, dh_da_dtype = dh_split_gemm_config(num_sms, gather), "bfloat16"
        # Weight gradients: measured on the H100 (benchmarks/RESULTS.md, 7B sweep), a CTA
        # tile of 256 x 128 with 2 consumers beats 128 x 128 by ~20%; the output tile reuses
        # the pipeline's SMEM, which leaves room for 4 stages of 48 KB. (Session 23's
        # persistent CTAs, 3 stages beside whole output tiles, measured level at 7B and 30B
        # on an H200, 1.04-1.07x only at ~1000 rows per expert; the 4-stage form below won.)
        # dW2 = A'^T dO[tok]: consumers split n (A' columns), the gathered dO chunks span d.
        # Three consumers of 64 where 3 x 64 tiles the split side and the tiles below do not
        # (dW2: two consumers; dW1: 256 columns). gpt-oss (n = 2880), measured on the H100
        # (session 49, `benchmarks/backward.py --shapes gpt-oss-20b --sweep narrow`, 3
        # rounds, same error against the reference): dW2 one consumer 1842.4 us (295
        # TFLOP/s) -> three 1023.0 (531, 1.801x); dW1 two consumers 2602.5 -> three 2143.1
        # (1.214x). Other such widths are not measured. Each output element is still one
        # consumer's K loop in the same order, so the bits do not change.
        bm2 = 128 if n % 256 == 0 else 64
        dw_down = [
            WeightGradConfig(
                block_m=bm2, block_n=width, block_k=k, num_stages=stages,
                num_consumers=next((c for c in (2, 3) if n % (c * bm2) == 0), 1),
            )
            for width, stages in _gathered_chunks(d)
        ]
        # dW1 = X[tok]^T dH: the gathered X chunks span d, consumers split 2n (dH columns).
        wide = d % 128 == 0 and (2 * n) % 256 == 0  # 256-column CTA tiles
        dw_gate_up = [
            WeightGradConfig(
                block_m=width, block_n=128 if wide else 64, block_k=k, num_stages=stages,
                num_consumers=3 if not wide and (2 * n) % (3 * 64) == 0 else 2,
            )
            for width, stages in _gathered_chunks(d)
        ]
        # Persistent CTAs with 4 stages beside one output buffer per consumer, where they fit
        # (bitwise the same outputs as one CTA per item). Measured on an H200 (session 25,
        # same run): 7B dW1 573.0 -> 567.4 us (1.010x), dW2 309.7 -> 303.8 (1.019x); 30B dW1
        # 4184.9 -> 4018.9 (1.041x), dW2 2299.3 -> 2084.3 (1.103x). On the H100 (session 44,
        # `benchmarks/backward.py --sweep cards`, paired over 3 rounds): 7B dW1 575.4 ->
        # 542.9 us (1.060x), dW2 326.7 -> 309.6 (1.056x), spreads <= 0.3%; 30B dW1 level
        # (3876.6 vs 3881.4), dW2 2136.4 -> 2066.9 (1.034x), both with spreads of 4-10%.
        dw_down, dw_gate_up = (
            _persistent_weight_grad(candidates, gathered, num_sms)
            for candidates, gathered in ((dw_down, "rhs"), (dw_gate_up, "lhs"))
        )
        if gather == "cp_async":  # needs >= 3 stages; the defaults above all have them
            dh, dw_down, dw_gate_up = (
                dataclasses.replace(c, gather=gather) for c in (dh, dw_down, dw_gate_up)
            )
        cfg = cls(
            dh=dh,
            dh_gemm=dh_gemm,
            dh_da_dtype=dh_da_dtype,
            dw_down=dw_down,
            dw_gate_up=dw_gate_up,
            dx=_dx_config(d, n, num_sms, device_kind),
            aggregate=ForwardConfig.for_shape(d, n).aggregate,
        )
        if "dh_gemm" in overrides and overrides["dh_gemm"] is None:
            overrides.setdefault("dh_da_dtype", "float32")  # the fused dH has no dA' dtype
        return dataclasses.replace(cfg, **overrides)


def dh_split_gemm_config(num_sms: int, gather: str = "cp_async") -> GroupedMatmulConfig:
    """The split dH's GEMM (`BackwardConfig.dh_gemm`) as `for_shape` sets it where it splits
    dH: the up-proj's 128 x 256 items, 4 stages of 48 KB beside one staged output slab per
    consumer, `num_sms` persistent CTAs. Also what benchmarks and tests force where the
    default keeps the fused kernel."""
    return GroupedMatmulConfig(block_m=128, block_n=256, num_stages=4, out_slabs=1,
                               num_sms=num_sms, gather=gather)


def _gathered_chunks(d: int) -> list[tuple[int, int]]:
    """The weight gradients' gathered chunks along `d` (dW2's `block_n`, dW1's `block_m`) as
    (width, stages) candidates, in order of preference: 192 wide where 192 divides d, with 4
    or 3 stages, then the widest of 128, 192, 64 dividing d with 4 stages.

    Why 192 first: each contiguous K block then feeds 1.5x the gathered rows. Measured on
    the H100 at 7B (d = 1536; session 64, `benchmarks/backward.py --sweep persistent`, 2
    paired rounds, the same error against the reference): dW2 309.3 -> 302.8 us (1.021x),
    dW1 543.8 -> 535.9 (1.015x), spreads 0.2%, with 3 stages (4 do not fit beside the
    output buffer); 256-wide chunks spill (0.29-0.33x at 7B and 30B). gpt-oss (d = 2880,
    which 128 does not divide) had 192 already. Not measured on an H200.
    """
    preferred = [(192, 4), (192, 3)] if d % 192 == 0 else []
    return preferred + [(_largest_block(d, (128, 192, 64)), 4)]


def _persistent_weight_grad(candidates: list[WeightGradConfig], gathered: str,
                            num_sms: int) -> WeightGradConfig:
    """The first of `candidates` whose stages fit beside one output buffer per consumer in
    SMEM (bf16 weights), as `num_sms` persistent CTAs; if none fits, the last candidate
    unchanged (one CTA per item)."""
    for config in candidates:
        persistent = dataclasses.replace(config, persistent_ctas=num_sms, output_chunks=1)
        if persistent_smem_bytes(persistent, gathered, 2) <= PERSISTENT_SMEM_BUDGET:
            return persistent
    return candidates[-1]


def _dx_config(d: int, n: int, num_sms: int | None, device_kind: str) -> GroupedMatmulConfig:
    """dX~ (K = 2n): 128-row items. Measured on the H100 (session 9, same run, bitwise
    equal): with a short K loop (2n <= 512, 8 steps) the ping-pong schedule wins (533 vs
    553 us at 7B), with a long one the widest split-M column block does (3377 us against
    3767 for ping-pong at 30B, 2n = 1024: 256-column items read each dH tile half as often).
    On an H200 the ping-pong stages one output slab at a time, which frees SMEM for a 6th
    stage (session 37, `benchmarks/backward.py --sweep slabs`, same run, bitwise equal): 7B
    500.2 -> 488.9 us with the slab alone, 483.0 with the 6th stage (1.036x). The split-M
    items keep the whole tile: at 30B one slab was 0.89x (3138.5 -> 3519.9 us; with the 4th
    stage it frees 3248.7).

    On the H100, 192-column items (3 stages) release each K step's slot as soon as its own
    wgmmas are done (`wgmma_lag=0`), as the forward's down-proj of the same items does since
    session 54: gpt-oss widths (d = n = 2880; session 64, `benchmarks/backward.py --shapes
    gpt-oss-20b --sweep lag`, 3 paired rounds, bitwise the same output) 1971.9 -> 1883.9 us
    (1.047x, spreads <= 1.1%); 256-column items were 0.961x with it at 30B (session 52).
    Not measured on an H200, which keeps lag 1 like its down-proj."""
    num_sms = default_num_sms() if num_sms is None else num_sms
    if 2 * n <= 512 and d % PINGPONG_DOWN.block_n == 0:
        stages = PINGPONG_DOWN.num_stages + 1 if "H200" in device_kind else None
        return pingpong_down_config(num_sms, device_kind, num_stages=stages)
    bn = _largest_block(d, (256, 192, 128, 64))
    return GroupedMatmulConfig(
        block_m=128, block_n=bn, num_stages=3 if bn > 128 else 4, num_sms=num_sms,
        wgmma_lag=0 if bn == 192 and "H200" not in device_kind else 1,
    )


def backward_config(
    config: BackwardConfig | None, d: int, n: int, interpret
) -> BackwardConfig:
    """`config`, or the `for_shape(d, n)` defaults (in interpret mode with 4 persistent CTAs:
    every simulated CTA costs time), so interpret mode runs the compiled defaults' kernels
    (persistent dH and weight gradients) with only the loaders interpret mode can run.

    Until session 45 interpret mode ran dH on one CTA and the weight gradients one CTA per
    item inside the jitted backward: with the persistent forms the jitted interpret tests
    stalled on a 2-core machine (sessions 14, 42 and 44). Session 45 found the cause, the
    interpreter's blocked callbacks taking every thread of XLA's CPU pool (see
    `_common.interpret_params`, which warns below `INTERPRET_MIN_CPU_THREADS`; the test
    suite sets PJRT_NPROC). With that pool `pytest -n 2 tests/test_kernels_bwd.py
    tests/test_moe_ffn_kernels.py` passed with the persistent forms in 263.7 s against
    268.4 s with the overrides (fresh compile caches, one run each), so they went."""
    if config is not None:
        return config
    return BackwardConfig.for_shape(d, n, num_sms=4 if interpret else None)


def moe_backward(
    x: jax.Array,
    h: jax.Array,
    plan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    grad_out: jax.Array,
    *,
    interpret: bool | plgpu.InterpretGPUParams = False,
    config: BackwardConfig | None = None,
    activation: SwiGLU = SwiGLU(),
    b_down: jax.Array | None = None,
    schedules: PlanSchedules | None = None,
) -> tuple[jax.Array, ...]:
    """Gradients of the MoE layer from its minimal residuals, through the kernels.

    Args:
      x: bf16 [T, d] forward input.
      h: bf16 [P, 2n] saved up-proj output; padding rows are never read.
      plan: the forward's `DispatchPlan` (capacity P, E experts).
      w_gate_up: bf16 [E, d, 2n] (gate = [..., :n], up = [..., n:]).
      w_down: bf16 [E, n, d].
      grad_out: [T, d] cotangent of the output (cast to x.dtype).
      interpret: run every kernel in Mosaic GPU interpret mode (CPU) if True or an
        InterpretGPUParams.
      config: block sizes; `BackwardConfig.for_shape(d, n)` if None (with 4 persistent CTAs
        in interpret mode, where every simulated CTA costs time).
      activation: the forward's `SwiGLU` spec.
      b_down: [E, d] down-projection bias for a layer with expert biases (zeros if it has
        only `b_gate_up`), or None for a layer without biases.
      schedules: the plan's tile metadata (`schedules.plan_schedules` with this config),
        computed in the forward and saved; None computes this pass's here.

    Returns:
      (dx [T, d] x.dtype, d_scores f32[P] (0 on padding rows), dw_gate_up [E, d, 2n] in
      w_gate_up.dtype, dw_down [E, n, d] in w_down.dtype); with `b_down` given, two more:
      db_gate_up [E, 2n] and db_down [E, d] in b_down's dtype (the contract of
      `moe_ffn_backward`).
    """
    num_tokens, d, num_experts, n = _common.check_layer_operands(x, plan, w_gate_up, w_down)
    _common.require_shape("grad_out", grad_out, (num_tokens, d))
    _common.require_shape("h", h, (plan.capacity, 2 * n))
    if b_down is not None:
        _common.require_shape("b_down", b_down, (num_experts, d))
    config = backward_config(config, d, n, interpret)
    k_blocks = {config.dw_down.block_k, config.dw_gate_up.block_k}
    if len(k_blocks) != 1:
        raise ValueError(
            f"config.dw_down.block_k and config.dw_gate_up.block_k must be equal, got {k_blocks}."
        )
    (block_k,) = k_blocks
    _common.require_multiple(
        "config.dh.pad_rows_to", config.dh.pad_rows_to, block_k,
        f"the weight-gradient kernels load whole K-blocks of {block_k} rows of dH and A'",
    )
    capacity = plan.capacity
    grad_out = grad_out.astype(x.dtype)

    # Metadata, once per plan and block size: from the op (`plan_schedules`, computed in the
    # forward and saved), or computed here for a standalone call.
    split = config.dh_gemm is not None  # dH as the GEMM, then the row pass
    dh_rows = config.dh_gemm.tile_rows if split else config.dh.tile_rows
    if schedules is None:
        dh_meta, k_meta, dx_meta = backward_schedules(plan, config)
    else:
        require_block("dh", schedules.dh, dh_rows)
        require_block("weight_grad", schedules.weight_grad, block_k, field="block_k")
        require_block("dx", schedules.dx, config.dx.tile_rows)
        dh_meta, k_meta, dx_meta = schedules.dh, schedules.weight_grad, schedules.dx

    dh_operands = (grad_out, h, plan.token_ids, plan.group_sizes, plan.scores, w_down)
    if split:
        dh, a_scaled, d_scores = dh_split(
            *dh_operands, gemm=config.dh_gemm, pad_rows_to=config.dh.pad_rows_to,
            approx_math=config.dh.approx_math, interpret=interpret, meta=dh_meta,
            activation=activation, da_dtype=config.dh_da_dtype,
        )
    else:
        dh, a_scaled, d_scores = dh_kernel(
            *dh_operands, config=config.dh, interpret=interpret, meta=dh_meta,
            activation=activation,
        )
    dw_down = weight_grad(
        a_scaled, grad_out, plan.token_ids, plan.group_sizes, gathered="rhs",
        out_dtype=w_down.dtype, config=config.dw_down, interpret=interpret, meta=k_meta,
    )
    dw_gate_up = weight_grad(
        x, dh, plan.token_ids, plan.group_sizes, gathered="lhs",
        out_dtype=w_gate_up.dtype, config=config.dw_gate_up, interpret=interpret, meta=k_meta,
    )
    # dX~ gets unwritten pad columns when d is not a multiple of 128 (whole aggregation
    # blocks); the result is sliced back below.
    width = aggregate_width(d)
    dx_tilde = dx_rows(
        dh, plan.group_sizes, w_gate_up, capacity=capacity, config=config.dx,
        interpret=interpret, meta=dx_meta, out_cols=width,
    )
    dx = aggregate(
        dx_tilde, plan.rows_by_token, plan.token_row_offsets, None,
        out_dtype=x.dtype, config=config.aggregate, interpret=interpret,
    )
    if width != d:
        dx = dx[:, :d]
    if b_down is None:
        return dx, d_scores, dw_gate_up, dw_down
    ds_bias, db_gate_up, db_down = expert_bias_gradients(dh, plan, grad_out, b_down)
    return (
        dx, d_scores + ds_bias, dw_gate_up, dw_down,
        db_gate_up.astype(b_down.dtype), db_down.astype(b_down.dtype),
    )
