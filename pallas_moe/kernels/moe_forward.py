"""Forward of one MoE layer through the Mosaic GPU kernels.

    H, A = up_proj(X, plan, b1)        gather fused into the load, bias + SwiGLU epilogue
    Y    = down_proj(A, plan, b2)      grouped GEMM, bias epilogue, Y transient
    O    = aggregate(Y, plan, scores)  deterministic CSR sum in the aggregation mode's order

The expert biases b1 [E, 2n] and b2 [E, d] are optional; the activation is a `SwiGLU` spec
(plain, or gpt-oss's clamped variant). With `fuse_swiglu=False`, A is recomputed in jnp
from H after the up-proj (the unfused order of a reference engine; the kernel's own A is
not used).

Returns `(O [T, d], H [P, 2n])`: H is the residual the backward needs (with X and the plan).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels.aggregate import AggregateConfig, aggregate
from pallas_moe.kernels.decode import DecodeConfig, default_config as default_decode_config
from pallas_moe.kernels.decode import moe_decode
from pallas_moe.kernels.down_proj import down_proj
from pallas_moe.kernels.grouped_gemm import GroupedMatmulConfig
from pallas_moe.kernels.schedules import (
    SCHEDULE_IMPLS, PlanSchedules, forward_schedules, require_block,
)
from pallas_moe.kernels.up_proj import UpProjConfig, persistent_smem_bytes, up_proj
from pallas_moe.ops.activation import SwiGLU


def _largest_block(dim: int, candidates: tuple[int, ...]) -> int | None:
    for c in candidates:
        if dim % c == 0:
            return c
    return None


# The widest d (the up-proj's K) at which the ping-pong up-proj is the default (see
# `ForwardConfig.for_shape`).
PINGPONG_UP_MAX_D = 1536
# The widest d at which the persistent split-M up-proj runs above PINGPONG_UP_MAX_D
# (measured on an H200 at d = 2048, 2880 and 4096, on the H100 at 4096; see
# `ForwardConfig.for_shape`).
SPLIT_M_UP_MAX_D = 4096
# The narrowest expert width n at which an H200 runs the split-M up-proj at d <=
# PINGPONG_UP_MAX_D too (measured at n = 512 and 1024; see `ForwardConfig.for_shape`).
SPLIT_M_UP_MIN_N = 512
# The down-proj's expert width (its K) from which split-M items 256 columns wide replace the
# 128-row ping-pong (session 61; see `ForwardConfig.for_shape`).
SPLIT_M_DOWN_MIN_N = 768
# The narrowest d at which the split-M up-proj runs its items on clusters of two CTAs that
# share each weight tile by multicast (`UpProjConfig.cluster_m=2`; see `split_m_up_config`).
CLUSTER_UP_MIN_D = 2880


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """Block sizes of the three forward kernels, or the decode megakernel.

    `decode`: a `pallas_moe.kernels.decode.DecodeConfig` runs the whole forward as the
    persistent event-driven megakernel (`docs/decode.md`) instead of the three kernels
    (whose configs are then unused). None (default): the kernel-by-kernel forward. Through
    `pm.moe_ffn` with no config, a batch of at most `decode_max_tokens()` tokens runs the
    megakernel (`forward_config`), where it measured faster.

    `schedule_impl`: how the kernel-by-kernel forward computes its tile metadata per plan
    (the up-proj's row tiles with token ids and the down-proj's aligned tiles,
    `schedules.forward_schedules`): "jnp" (default: `_common.tile_meta` and
    `_common.aligned_tile_meta`, 8 small XLA fusions), "kernel" (the same arrays, bit for
    bit, from one Pallas launch, `schedules.forward_schedule_kernel`; where the kernels run
    interpreted it runs interpreted) or "auto" ("kernel" for batches of at most
    `schedules.SCHEDULE_KERNEL_MAX_TOKENS` tokens, "jnp" above). Why a kernel: at T = 8 on
    the H100 (Qwen3-30B-A3B widths, issue 15) those 8 launches of 1.1-2.2 us each are ~12
    us of the call's 230 us GPU time. The default stays "jnp": the kernel's first form (one
    program walking the tiles) took 26.6 us (session 66); its per-chunk form is not yet
    timed (`benchmarks/decode.py --variants kernels,kernels_meta`). The backward's
    schedules are always jnp. Unused with `decode` (the megakernel has its own,
    `DecodeConfig.meta_impl`).
    """

    up: UpProjConfig = UpProjConfig()
    down: GroupedMatmulConfig = GroupedMatmulConfig()
    aggregate: AggregateConfig = AggregateConfig()
    decode: DecodeConfig | None = None
    schedule_impl: str = "jnp"

    def __post_init__(self):
        if self.decode is not None and not isinstance(self.decode, DecodeConfig):
            raise TypeError(
                f"decode must be a DecodeConfig or None, got {type(self.decode).__name__}."
            )
        if self.schedule_impl not in SCHEDULE_IMPLS:
            raise ValueError(
                f"schedule_impl must be one of {SCHEDULE_IMPLS}, got {self.schedule_impl!r}."
            )
        if self.up.fused_gate_up:
            # The fused up-proj reads W1 interleaved per block_n only, and the op's W1 is the
            # halves layout: fail here rather than at the first call.
            raise ValueError(
                "up.fused_gate_up=True cannot run in the forward: the op's W1 is the halves "
                "layout (gate = [..., :n], up = [..., n:]), and the fused up-proj reads W1 "
                "interleaved per block_n only (up_proj(gate_up_blocks=block_n)); set "
                "up.fused_gate_up=False."
            )

    @classmethod
    def for_shape(
        cls, d: int, n: int, *, num_sms: int | None = None, gather: str = "cp_async",
        device_kind: str | None = None, **overrides
    ) -> "ForwardConfig":
        """Default block sizes that divide the model widths `d` and `n` (both multiples of 64).

        `num_sms`: CTAs of the persistent down-proj (default: the device's SM count, 132 on
        H100). `device_kind`: the GPU the defaults are tuned for (default: the default
        device's `device_kind`, e.g. "NVIDIA H100 80GB HBM3"); an H200 gets its own measured
        choices. `overrides` may also set `decode=DecodeConfig.for_shape(d, n)` (the
        megakernel). `gather`: the up-proj's row loader, "cp_async" (default: measured faster
        on the H100, bitwise the same result) or "tma" (see `UpProjConfig.gather`; interpret
        mode always runs the TMA loader). `overrides` may replace the `up`, `down` or
        `aggregate` configs.
        """
        if num_sms is None:
            num_sms = default_num_sms()
        if device_kind is None:
            device_kind = default_device_kind()
        _common.require_multiple("d", d, 64, "the kernels tile the model width by 64")
        _common.require_multiple("n", n, 64, "the kernels tile the expert width by 64")
        # Measured on H100 (benchmarks/RESULTS.md, benchmarks/history/): the warp-specialized
        # up-proj with two consumers sharing each gathered stage is fastest, and the
        # persistent down-proj (132 CTAs) beats one CTA per tile.
        h200 = "H200" in device_kind
        split_m = d <= SPLIT_M_UP_MAX_D and (
            d > PINGPONG_UP_MAX_D or (h200 and n % 128 == 0 and n >= SPLIT_M_UP_MIN_N))
        if split_m:
            # Measured on an H200 (session 24, same runs, bitwise equal): persistent CTAs
            # walking 128-row items, both consumers taking every item with 64 rows each
            # (split-M: each weight tile feeds 128 rows, and the ring streams across items
            # instead of draining and refilling once per CTA), on W1's halves, against the
            # cooperative kernel below: 30B 3899.0 -> 3528.3 us (1.105x), the Qwen3 widths
            # (d = 2048, n = 768) 1634.4 -> 1468.0 (1.113x), d = 2880 (n = 1408, where the
            # cooperative kernel has one consumer) 1144.1 -> 902.1 (1.268x). Level at 7B
            # (569.4 vs the ping-pong's 569.3), so the ping-pong stays there. On the H100
            # (session 45, same run, 3 rounds, spread 3.0%, equal error against the
            # reference) at 30B: 4161.1 -> 3622.9 us (1.159x) against its cooperative
            # kernel, and the whole 30B training step 22.009 -> 20.682 ms (1.064x, paired,
            # spreads 6.7% / 4.5%); 7B's step level (3.579 / 3.571 ms, a ping-pong width).
            # So the H100 runs it above PINGPONG_UP_MAX_D as well (d = 2048 and 2880 not
            # yet measured on an H100; the H200 gained 1.11x and 1.27x there); its wide-n
            # rule below PINGPONG_UP_MAX_D stays the H200's (not measured on an H100).
            # Below PINGPONG_UP_MAX_D, from n = SPLIT_M_UP_MIN_N on (session 30, same run):
            # at d = 1536 the ping-pong's 64-row items fall behind with wide experts
            # (7b-n512 587.3 us, 7b-n1024 637.1; 7B itself 521.7) and split-M does not
            # (527.6, 528.0; 534.4 at 7B). The items' bytes per FLOP do not depend on n, but
            # the L2 served 1.36x more read sectors at n = 1024 for the same bytes delivered
            # to the SMs (ncu: 167 M vs 123 M; its output port 81% busy), so halving the
            # weight bytes per FLOP (128-row items) pays there. Inside the whole training
            # step (calls 4 and 6, both variant orders) the step stays level or gains
            # (7b-n512 2.935 -> 2.912 and 2.924 -> 2.902 ms, 7b-n1024 2.850 -> 2.775 and
            # 2.848 -> 2.762), although there the split-M kernel itself measured slower at
            # n = 512 (0.59 vs 0.54 ms; level at 1024): why the step's context reverses
            # the kernels' order at n = 512 is open (benchmarks/NOTES.md, session 30).
            # Session 48 on the H100 (`forward.py --up-sweep persistent`, same run, 3 rounds,
            # equal error): above PINGPONG_UP_MAX_D split-M also wins where 128 does not
            # divide n, with 64-column items: gpt-oss-20b's widths (d = n = 2880) 3972.5 ->
            # 2798.7 us (1.433x, spread 1.3%) against the cooperative kernel's one consumer of
            # 64 columns; and it confirmed the H100 rule at d = 2048 (1800.9 -> 1456.9 us,
            # 1.236x) and 2880 (n = 1408: 1284.4 -> 970.3, 1.324x). Not above
            # SPLIT_M_UP_MAX_D: at d = 7168 (n = 2048) split-M lost, 1617.7 -> 1894.4 us
            # (0.854x, spread 10.1%), so the cooperative kernel stays there. Session 49:
            # 64-column items take 192 rows and three consumers, and from d =
            # CLUSTER_UP_MIN_D on items run on clusters of two CTAs (session 50; see
            # split_m_up_config).
            up = split_m_up_config(num_sms, n, d=d)
        elif n % 128 == 0 and d <= PINGPONG_UP_MAX_D:
            # Measured on the H100 (session 20, same run, bitwise equal): the ping-pong
            # up-proj (two consumers taking alternate 64-row items, 5 stages, one-tile
            # epilogue buffers) against the cooperative kernel: 610 vs 676 us at 7B (d =
            # 1536, n = 256), 619 vs 681 skewed, 602 vs 681 at n = 512; level at d = 2048
            # (1759 vs 1736 us, n = 768); slower from d = 2880 on (0.76x; 30B 0.74x, d =
            # 7168 0.49x): its producer's time per K step grows with d (benchmarks/RESULTS.md).
            # How its gathered stages complete depends on the card. On an H200 (session 22,
            # same runs, bitwise equal) hardware-tracked mbarriers win, 7B 608.2 / 607.9 ->
            # 567.8 / 569.3 us: the lagged publish's producer stalls on its own cp.async
            # groups. On the H100 (session 20, same run) they lost, 610.1 -> 638.7 us.
            up = UpProjConfig(block_n=128, num_stages=5, num_consumers=2,
                              pingpong_ctas=num_sms,
                              gather_completion="mbarrier" if h200 else "wait_group")
        elif n % 256 == 0:
            up = UpProjConfig(block_n=128, num_stages=3, num_consumers=2)
        elif n % 128 == 0:
            up = UpProjConfig(block_n=128, num_stages=4, num_consumers=1)
        else:
            up = UpProjConfig(block_n=64, num_stages=4, num_consumers=1)
        # Down-proj: 128-row items, each weight tile feeding 128 rows. Measured on the H100
        # (session 9, same run, bitwise equal): the consumers alternating 128-row items
        # (`pingpong`, 5 stages) beat splitting every item's rows, 331 vs 349 us at 7B
        # (n=256) and 1794 vs 1858 us at 30B (n=512, against 256-column split-M items): the
        # K loop is short (n / 64 steps), so overlapping one consumer's epilogue with the
        # other's wgmmas pays. 4 stages hold only one item's steps and serialize the two
        # consumers (463 us at 7B). From n = 768 on (12 K steps and more) the split-M items
        # 256 columns wide win instead, as dX~'s do at its K = 2n: each 48-KB stage feeds
        # 4.2 MFLOP, against 2.1 for the ping-pong's 32 KB (session 61, H100,
        # `forward.py --down-sweep default --rounds 2`, paired, error 0 against the
        # reference): Qwen3-30B-A3B widths (n = 768) 807.4 -> 689.6 us (1.171x),
        # (24576, 1536, 1024, 32, 2) 1.047x, (32768, 4096, 1024, 64, 4) 2062.8 -> 1692.0
        # (1.219x), (32768, 4096, 2048, 64, 4) 1.249x, d = 7168 with n = 2048 1.199x; at
        # n = 512 the ping-pong still wins (30B 0.971x, (24576, 1536, 512, 64, 4) 0.963x).
        # The same rule on an H200 (not measured there).
        if n >= SPLIT_M_DOWN_MIN_N and d % 256 == 0:
            down = GroupedMatmulConfig(block_m=128, block_n=256, num_stages=3, num_sms=num_sms)
        elif d % PINGPONG_DOWN.block_n == 0:
            down = pingpong_down_config(num_sms, device_kind)
        else:
            bn = _largest_block(d, (128, 192, 256, 64))
            stages = 4 if bn <= 128 else 3
            down = GroupedMatmulConfig(block_m=128, block_n=bn, num_stages=stages, num_sms=num_sms)
        if not h200:
            # Measured on the H100 (session 54, two runs of `forward.py --up-sweep lag
            # --down-sweep lag`, paired, every config checked against the reference on
            # poisoned outputs): releasing each K step's slot as soon as its own wgmmas are
            # done (`wgmma_lag=0`) pays where the ring is short for its consumers: the
            # 192-row, three-consumer split-M up-proj (gpt-oss's d = n = 2880: 1.080x and
            # 1.069x, spreads <= 2.9%) and the three-stage down-proj of 192-column items
            # (1.043x and 1.065x). Elsewhere lag 0 was level or slower (up-proj 0.985x at 7B,
            # 1.007x at 30B, 1.013x at d = 2048; down-proj 1.017x at 7B, 0.961x at 30B).
            # Not measured on an H200.
            if up.block_m == 192:
                up = dataclasses.replace(up, wgmma_lag=0)
            if down.block_n == 192 and down.num_stages == 3:
                down = dataclasses.replace(down, wgmma_lag=0)
        agg = _aggregate_config(d)
        if gather not in _common.GATHER_MODES:
            raise ValueError(f"gather must be one of {_common.GATHER_MODES}, got {gather!r}.")
        if gather == "cp_async":  # needs >= 3 stages; the defaults above all have them
            up = dataclasses.replace(up, gather=gather)
        cfg = cls(up=up, down=down, aggregate=agg)
        return dataclasses.replace(cfg, **overrides)


def split_m_up_config(num_sms: int, n: int | None = None, *, d: int | None = None,
                      rows: int | None = None, cluster_m: int | None = None) -> UpProjConfig:
    """The persistent split-M up-proj (`UpProjConfig.pingpong_ctas` with block_m > 64) as
    every card runs it above `PINGPONG_UP_MAX_D`, and an H200 below it from
    `SPLIT_M_UP_MIN_N` on:
    `num_sms` CTAs, 4 stages on mbarriers (3 where 4 do not fit in SMEM), one-tile epilogue
    buffers, W1's halves. 128-row items that two consumers share (64 rows each), two
    N = 128 wgmmas per consumer and step; where 128 does not divide the expert width `n`
    (e.g. gpt-oss's 2880), items 64 columns wide (two N = 64 wgmmas) and 192 rows that three
    consumers share. `n=None`: 128-column items. `rows`: 128 or 192 instead of that choice.
    From the model width `d` = `CLUSTER_UP_MIN_D` on (and with an even `num_sms`), items run
    on clusters of two CTAs sharing each weight tile by multicast (`cluster_m=2`); `d=None`:
    no clusters. `cluster_m`: 1 or 2 instead of that choice.

    Why 192 rows only with 64-column items: measured on the H100 (session 49,
    `benchmarks/forward.py --up-sweep rows`, same run, 3 rounds, error 0 against the XLA
    tiles), gpt-oss-20b's widths (d = n = 2880) 2919.7 -> 2603.8 us (1.116x, spreads
    1.0% / 0.8%): each weight tile feeds 192 rows instead of 128, which cuts the L2 -> SMEM
    bytes the item reads (docs/kernels.md counts them); the whole gpt-oss training step
    13.567 -> 13.282 ms (1.021x, paired). With 128-column items the three consumers' two
    [64, 128] f32 accumulators do not fit their registers beside the epilogue (152 each):
    0.137-0.144x at the Qwen3-30B-A3B, d = 2880 (n = 1408) and 30B widths.

    Why clusters from d = 2880 on: measured on the H100 (session 50, `benchmarks/forward.py
    --up-sweep cluster`, same runs, error 0 against the XLA tiles), clusters against the
    same items on single CTAs: gpt-oss-20b's widths 2627.5 -> 2503.3 us (1.050x, spreads
    0.7% / 2.0%), and its whole training step 13.487 -> 13.335 ms (1.011x, paired); d =
    2880 with 128-column items (n = 1408) 935.8 -> 885.4 us (1.057x, spreads 0.3% / 0.2%);
    30B in three runs 3651.1 -> 3401.8 us (1.036x), 3677.0 -> 3521.0 (1.030x) and 3669.4
    -> 3460.7 (1.060x; spreads 4-22%). Each weight byte read from L2 feeds twice the rows.
    At the Qwen3-30B-A3B widths (d = 2048) they lost, 1426.7 -> 1450.4 us (0.984x); our
    guess (not measured) is that its shorter K loop leaves less time to hide the two CTAs'
    lock-step on each slot.
    """
    block_n = 64 if n is not None and n % 128 else 128
    if rows is None:
        rows = 192 if block_n == 64 else 128
    if cluster_m is None:
        cluster_m = 2 if d is not None and d >= CLUSTER_UP_MIN_D and num_sms % 2 == 0 else 1
    config = UpProjConfig(block_m=rows, block_n=block_n, num_stages=4,
                          num_consumers=rows // 64, pingpong_ctas=num_sms,
                          gather_completion="mbarrier", cluster_m=cluster_m)
    if persistent_smem_bytes(config) > _common.SMEM_BUDGET:
        config = dataclasses.replace(config, num_stages=3)
    return config


# The ping-pong grouped GEMM the down-proj (and dX~ with a short K loop) runs by default.
PINGPONG_DOWN = GroupedMatmulConfig(block_m=128, block_n=128, num_stages=5, pingpong=True)


def pingpong_down_config(num_sms: int, device_kind: str, *, num_stages: int | None = None
                         ) -> GroupedMatmulConfig:
    """`PINGPONG_DOWN` on `num_sms` CTAs as the card `device_kind` runs it (`num_stages`:
    instead of its 5).

    On an H200 each consumer stages its output tile one 64-column slab at a time
    (`out_slabs=1`). Measured there (session 37, `benchmarks/forward.py --down-sweep slabs`,
    same runs, bitwise equal, two machines): the down-proj 7B 282.9 -> 278.3 and 287.4 ->
    283.4 us (1.014-1.017x), 30B 1718.9 -> 1685.6 and 1741.0 -> 1720.2 (1.012-1.020x), the
    Qwen3-30B-A3B widths 685.8 -> 661.3 (1.037x) at the same 5 stages; the 6th stage the
    16 KB it frees would hold was slower there (0.97-0.99x: the K loop is only n / 64 =
    4-12 steps). The H100 keeps the whole tile (not measured there)."""
    config = dataclasses.replace(PINGPONG_DOWN, num_sms=num_sms)
    if num_stages is not None:
        config = dataclasses.replace(config, num_stages=num_stages)
    if "H200" in device_kind:
        config = dataclasses.replace(config, out_slabs=1)
    return config


def _default_gpu():
    """The default device if it is a GPU, else None."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    return dev if dev.platform == "gpu" else None


def default_num_sms() -> int:
    """SM count of the default device if it is a GPU, else 132 (H100 SXM)."""
    return int(getattr(_default_gpu(), "core_count", 0) or 132)


def default_device_kind() -> str:
    """`device_kind` of the default device if it is a GPU (e.g. "NVIDIA H200"), else ""."""
    return str(getattr(_default_gpu(), "device_kind", "") or "")


def _aggregate_config(d: int) -> AggregateConfig:
    """Widest vectors and a column block dividing `aggregate_width(d)`."""
    width = aggregate_width(d)
    vec = _largest_block(width // 128, (8, 4, 2, 1))
    chunk = 128 * vec
    block_d = width if width <= 4096 else _largest_block(width, (4096, 3072, 2048, 1024))
    block_d = block_d or chunk
    return AggregateConfig(block_t=4, block_d=block_d, vec=vec)


def aggregate_width(d: int) -> int:
    """Columns the aggregation runs on. A warpgroup loads `128 * vec` columns at a time, so
    d must be a multiple of 128; other widths (e.g. 2880) are rounded up to a multiple of
    1024 (16-byte loads) with unwritten pad columns in Y and a final column slice."""
    return d if d % 128 == 0 else -(-d // 1024) * 1024


# With no config, `pm.moe_ffn(backend="mosaic")` runs the forward as the decode megakernel
# for batches of at most this many tokens. Measured on the H100 (session 12, Qwen3-30B-A3B
# widths, one run, MoE kernels' GPU time): megakernel against kernel path 50.9 vs 59.5 us at
# T = 1, but 76.6 vs 69.6 at T = 2, 118.0 vs 111.2 at T = 4, 209.8 vs 200.4 at T = 8
# (`benchmarks/RESULTS.md`, session 12). Session 44 (the H100 again, after sessions 32-42's
# zero-filled padding rows, metadata kernel and one-program routing; whole jitted call with
# routing, GPU us, one run): the default megakernel against the kernel path 47.6 vs 80.9 at
# T = 1, 85.3 vs 91.2 at T = 2 (1.07x; dynamic 84.0), level at T = 4 (132.3 vs 132.1), then
# 0.94x at T = 8, 16 and 64 (232.0 vs 217.9, 318.7 vs 300.7, 472.8 vs 442.3).
DECODE_MAX_TOKENS = 2
# The same choice on an H200 (session 26, same widths, MoE kernels' GPU time, two runs on
# two machines): megakernel against kernel path 43.1-48.9 vs 56.4-68.3 us at T = 1, level
# at T = 2 (71.8 vs 71.6, 66.2 vs 67.1), faster at T = 4 (102.4 vs 118.1, 102.5 vs 123.8)
# and T = 8 (162.5 vs 179.6, 166.8 vs 177.3), then within 4% (T = 16-64, one run). Since
# session 32 zero-fills a tile's padding rows (no L2 hot spot in the gather), session 33's
# table (call 3, whole jitted call with routing, GPU us) has the megakernel ahead up to
# T = 32: 49.7 vs 83.6 (T = 1), 177.5 vs 201.5 (8), 245.1 vs 262.4 (16), 333.4 vs 348.9
# (32), then 359.3 vs 368.0 (64: 2%, and 0.99x in session 31) and 0.99x at T = 128.
H200_DECODE_MAX_TOKENS = 32


def decode_max_tokens(device_kind: str | None = None) -> int:
    """Largest batch that `pm.moe_ffn` with no config runs as the decode megakernel on
    `device_kind` (default: the default device's): `H200_DECODE_MAX_TOKENS` on an H200,
    else `DECODE_MAX_TOKENS` (the H100's, also the rule for an unmeasured GPU)."""
    if device_kind is None:
        device_kind = default_device_kind()
    return H200_DECODE_MAX_TOKENS if "H200" in device_kind else DECODE_MAX_TOKENS


def forward_config(
    config: ForwardConfig | None, d: int, n: int, interpret, *,
    num_tokens: int | None = None, megakernel: bool = False,
) -> ForwardConfig:
    """`config`, or the `for_shape(d, n)` defaults (4 persistent CTAs in interpret mode,
    where every simulated CTA costs time).

    `megakernel`: the caller can run the decode megakernel (no expert biases, SwiGLU fused);
    then, with no config, a batch of at most `decode_max_tokens()` tokens (`num_tokens`)
    runs it (`decode.default_config`), where it measured faster.
    """
    if config is not None:
        return config
    decode = None
    # Interpret mode keeps the H100's rule wherever it runs (its tests do not depend on
    # the machine's GPU).
    limit = DECODE_MAX_TOKENS if interpret else decode_max_tokens()
    if megakernel and num_tokens is not None and num_tokens <= limit and d % 128 == 0:
        decode = default_decode_config(d, n, interpret)
    return ForwardConfig.for_shape(d, n, num_sms=4 if interpret else None, decode=decode)


def moe_forward(
    x: jax.Array,
    plan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    interpret: bool | plgpu.InterpretGPUParams = False,
    config: ForwardConfig | None = None,
    inference: bool = False,
    aggregation: str = "fp32",
    fuse_swiglu: bool = True,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    schedules: PlanSchedules | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """MoE layer forward through the Mosaic GPU kernels.

    Args:
      x: bf16 [T, d].
      plan: a `DispatchPlan` over T tokens and E experts with capacity P.
      w_gate_up: bf16 [E, d, 2n] (gate = [..., :n], up = [..., n:]).
      w_down: bf16 [E, n, d].
      interpret: run every kernel in Mosaic GPU interpret mode (CPU) if True or an
        InterpretGPUParams.
      config: block sizes; `ForwardConfig.for_shape(d, n)` if None (with 4 persistent CTAs
        in interpret mode, where every simulated CTA costs time).
      inference: skip writing H (returns None for it; H is still written when
        `fuse_swiglu=False`, which needs it).
      aggregation: "fp32", "bf16_per_expert" or "bf16_scores" (`pallas_moe.numerics`).
      fuse_swiglu: True: A comes from the up-proj's SwiGLU epilogue. False: A =
        activation(H) in jnp from the written H, rounded to bf16.
      b_gate_up: optional bf16 [E, 2n] expert bias of the up-projection (in H).
      b_down: optional bf16 [E, d] expert bias of the down-projection.
      activation: the `SwiGLU` spec (default `silu(gate) * up`).
      schedules: the plan's tile metadata (`schedules.plan_schedules` with this config),
        computed once for the forward and backward; None computes this pass's here.

    Returns:
      (out bf16 [T, d], h bf16 [P, 2n] or None). Padding rows of h are unspecified.
    """
    _, d, _, n = _common.check_layer_operands(x, plan, w_gate_up, w_down)
    config = forward_config(config, d, n, interpret)
    if config.decode is not None:
        if b_gate_up is not None or b_down is not None:
            raise ValueError(
                "config.decode (the megakernel) takes no expert biases; pass "
                "b_gate_up/b_down with the kernel-by-kernel forward (config.decode=None)."
            )
        if not fuse_swiglu:
            raise ValueError(
                "config.decode (the megakernel) fuses SwiGLU into the up tasks; "
                "fuse_swiglu=False needs the kernel-by-kernel forward (config.decode=None)."
            )
        return moe_decode(
            x, plan, w_gate_up, w_down, config=config.decode, write_h=not inference,
            aggregation=aggregation, interpret=interpret, activation=activation,
        )
    # Tile metadata, once per plan and block size: from the op (`plan_schedules`, shared
    # with the backward), or computed here for a standalone call.
    if schedules is None:
        up_meta, down_meta = forward_schedules(plan, config, interpret=interpret)
    else:
        require_block("up", schedules.up, config.up.tile_rows)
        require_block("down", schedules.down, config.down.tile_rows)
        up_meta, down_meta = schedules.up, schedules.down

    h, a = up_proj(
        x, plan.token_ids, plan.group_sizes, w_gate_up,
        config=config.up, inference=inference and fuse_swiglu, interpret=interpret,
        meta=up_meta, pad_a_rows_to=config.down.tile_rows, bias=b_gate_up, activation=activation,
    )
    if not fuse_swiglu:
        # Same rows as the epilogue's A (padded to whole down-proj tiles); padding rows of H
        # are unspecified and so are these, which no real output row reads.
        a_after = activation(h).astype(a.dtype)  # [P, n]
        a = jnp.pad(a_after, ((0, a.shape[0] - a_after.shape[0]), (0, 0)))
        if inference:
            h = None
    # Y gets unwritten pad columns when d is not a multiple of 128, so every aggregation
    # block is whole; the output is sliced back below.
    width = aggregate_width(d)
    y = down_proj(
        a, plan.group_sizes, w_down, config=config.down, interpret=interpret, meta=down_meta,
        capacity=plan.capacity, out_cols=width, bias=b_down,
    )
    out = aggregate(
        y, plan.rows_by_token, plan.token_row_offsets, plan.scores, aggregation=aggregation,
        out_dtype=x.dtype, config=config.aggregate, interpret=interpret,
    )
    if width != d:
        out = out[:, :d]
    return out, h
