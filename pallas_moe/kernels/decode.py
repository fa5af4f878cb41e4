"""A persistent, event-driven MoE forward for small batches (the "decode megakernel").

    A[r] = silu(X[tok[r]] @ W1g[e]) * (X[tok[r]] @ W1u[e])    up tasks
    Y[r] = A[r] @ W2[e]                                        down tasks
    O[t] = sum over rows r of token t of s[r] * Y[r]           aggregation tasks

At serving batch sizes (T up to about 1,000 tokens) the kernel-by-kernel forward is three
short kernels plus metadata, and launch gaps, stage barriers and wave tails dominate. This
kernel runs the whole dataflow in one persistent launch of `num_sms` CTAs; tasks of the
three kinds synchronize through event counters in GMEM (`_events.py`) instead of kernel
boundaries. The design and how it is tested: `docs/decode.md`.

Tasks, in one global order (every dependency points to an earlier task, which is what makes
both schedulers deadlock-free, `docs/decode.md`):
- up (tile, cb): row tile `tile` (at most `block_m` rows of one expert, `tile_schedule`)
  times gate columns `[cb*U, (cb+1)*U)` and the matching up columns, U = `up_block_n`. The
  token gather is fused into the A load; the SwiGLU epilogue writes a `[block_m, U]` block
  of A into a tile-major slab (row `tile*block_m + i` is row i of the tile), so the down
  tasks read whole aligned TMA boxes. Then it raises `up_done[tile]` by one.
- down (tile, cb): `Y[tile rows, cb*bn : (cb+1)*bn] = A[tile rows] @ W2[e]`, bn =
  `down_block_n`, into a tile-major Y slab. Its producer first issues the weight loads of
  the first `num_stages` K steps (and an L2 prefetch of the rest), then waits until
  `up_done[tile] == n / U` (every up task of the tile), then loads A: the weight prefetch
  overlaps the wait. Done, it raises `tok_done[b]` for every token block b whose tokens the
  tile holds.
- aggregate (b): tokens `[b*bt, (b+1)*bt)`, bt = `token_block`; waits until `tok_done[b]`
  reaches its target (down tasks per tile times the tiles touching the block, computed from
  the plan at run time), then sums each token's rows of Y in the plan's CSR order (fp32,
  like `aggregate.py`, so the result is bitwise reproducible).

Each CTA has one producer warpgroup (TMA loads, the cp.async row gather, event waits before
dependent loads, and the scheduling) and two consumer warpgroups that take the CTA's tasks in
turn (ping-pong: one consumer's epilogue overlaps the other's wgmmas). The producer hands
each task to a consumer through an SMEM mailbox, together with the ring step its loads
start at, so both schedulers share every line of task code:
- static: CTA s runs tasks s, s + num_sms, ... (round robin over the global order);
- dynamic: the producer takes the next task from a global atomic counter.
`fused=False` is the control of the seed paper ("unfused"): the same tasks, but every down
task waits for all up tasks and every aggregation task for all down tasks (a global stage
barrier), so comparing the two measures what the fine-grained events buy.

Interpret mode runs the same kernel with plain-memory counters (`_events.Events`); it needs
`gather="tma"` semantics (it always runs the TMA row loader) and, for the static scheduler,
`num_sms=1` (CTAs are simulated one after another, so a wait on a later CTA could never be
satisfied).

Removed in session 64: `DecodeConfig.rebalance_registers=True` (setmaxnreg: the producer at
40 registers per thread, the consumers taking the rest), 0.95x at T = 1 (38.5 against 36.7
us) and level at T = 2 (1.008x) on the H100 (session 64, `benchmarks/decode.py --tokens 1,2
--variants static,static_regs`; session 12's gain was on the old 4-stage default);
`benchmarks/history/session64/decode_rebalance_registers.patch` restores it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe.kernels import _common
from pallas_moe.kernels._events import INTERPRET_ROWS, Events
from pallas_moe.kernels.aggregate import AGG_LOADS_IN_FLIGHT  # the same load budget
from pallas_moe.kernels.decode_meta import (  # noqa: F401  (re-exported)
    META_IMPLS, DecodeMeta, decode_meta, decode_meta_reference, max_decode_tiles,
    resolve_meta_impl,
)
from pallas_moe.numerics import AGGREGATIONS
from pallas_moe.ops.activation import SwiGLU

SCHEDULERS = ("static", "dynamic")
TASK_KINDS = ("up", "down", "aggregate")
BLOCK_K = 64  # one 128-byte swizzle row of bf16

_PRODUCER = 2  # warpgroup index of the producer; consumers are 0 and 1


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Configuration of the decode megakernel; validates itself.

    Attributes:
      scheduler: "static" (CTA s runs tasks s, s + num_sms, ...) or "dynamic" (a global
        atomic work queue).
      fused: True: fine-grained events (down tasks wait for their tile's up tasks,
        aggregation tasks for the down tasks of their tokens). False: the unfused control,
        a global barrier between the three stages, same task code.
      block_m: rows per tile (64: one wgmma M).
      up_block_n: gate columns (and as many up columns) per up task; multiple of 64, at
        most 256, divides n.
      down_block_n: output columns per down task; multiple of 64, at most 256, divides d.
      num_stages: SMEM ring depth of the producer's loads (>= 3 with the cp.async gather).
        Measured on the H100 (session 12, Qwen3-30B-A3B widths, two runs): 5 stages against
        4, MoE kernels 47.3 / 54.3 vs 60.2 / 60.4 us at T = 1, 551 vs 573 us at T = 1024,
        1308 vs 1414 us at T = 4096, the same within 2% at T = 8 to 512. 6 stages measured
        like 5 but do not fit next to the H tiles (`write_h`).
      token_block: tokens per aggregation task (and per aggregation event).
      gather: "cp_async" (the 128 producer threads issue 16-byte cp.async loads,
        compiled only) or "tma" (one TMA copy per row); interpret mode always runs "tma".
      num_sms: CTAs of the persistent grid; must not exceed the SMs of the device (all
        CTAs must be resident at once, or a wait could block forever).
      mailbox_depth: tasks the producer may hand a consumer ahead of it.
      prefetch_l2: down tasks prefetch their remaining weight tiles into L2 before waiting.
      approx_math: compiled kernels only: the up tasks' SwiGLU takes its exp from the
        hardware's `ex2.approx` (True, default) or the full-precision `exp` (False), as
        `UpProjConfig.approx_math` does for the kernel-by-kernel forward; the backward's
        `DHConfig.approx_math` must match it (`KernelConfig` checks it).
      meta_impl: how the per-plan metadata is computed (`decode_meta.py`): "jnp" (the
        reference: six small XLA kernels at T = 1, ~7 us of GPU time on an H200),
        "kernel" (the same arrays, bit for bit, from one Pallas program; in interpret mode
        it runs interpreted) or "auto" (default): "kernel" for batches of at most
        `decode_meta.META_KERNEL_MAX_TOKENS` tokens, "jnp" above (on an H200 the kernel
        took the call from 50.8 to 42.0 us at T = 1 and lost from T = 8 on, session 41).

    Removed in session 58 (a config naming them is a TypeError), each measured slower than
    the default or level with it (`docs/decode.md`): `lookahead_steps` and
    `lookahead_within_task` (L2 prefetches of the next task's weights), `up_split_k` (split K
    of the up tasks) and `early_weights` (an up task's first weights before its row ids).
    Removed in session 62: `early_down_l2` (each CTA's next down tasks' W2 tiles asked of L2
    at the start with `prefetch.global.L2::evict_last`), level at T = 1 on the H100 (44.9 us
    against the default's 44.8-46.1 in the same run) and 0.92x at T = 2 with two tasks ahead.
    Removed in session 64: `rebalance_registers` (setmaxnreg moving the producer's registers
    to the consumers; see the module docstring). The three warpgroups keep the even split.
    """

    scheduler: str = "static"
    fused: bool = True
    block_m: int = 64
    up_block_n: int = 64
    down_block_n: int = 128
    num_stages: int = 5
    token_block: int = 4
    gather: str = "cp_async"
    num_sms: int = 132
    mailbox_depth: int = 2
    prefetch_l2: bool = True
    approx_math: bool = True
    meta_impl: str = "auto"

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"config.scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}.")
        if not isinstance(self.fused, bool):
            raise ValueError(f"config.fused must be a bool, got {self.fused!r}.")
        if self.block_m != 64:
            raise ValueError(f"config.block_m={self.block_m} must be 64 (one wgmma M per tile).")
        for name in ("up_block_n", "down_block_n"):
            value = getattr(self, name)
            _common.require_multiple(f"config.{name}", value, 64, "tiles are 128-byte swizzled")
            if not 64 <= value <= 256:
                raise ValueError(f"config.{name}={value} must be in [64, 256] (one TMA box, one wgmma N).")
        if self.gather not in _common.GATHER_MODES:
            raise ValueError(f"config.gather must be one of {_common.GATHER_MODES}, got {self.gather!r}.")
        min_stages = 3 if self.gather == "cp_async" else 2
        if self.num_stages < min_stages:
            raise ValueError(
                f"config.num_stages={self.num_stages} must be >= {min_stages} with "
                f"gather={self.gather!r}."
            )
        for name in ("token_block", "num_sms", "mailbox_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config.{name}={value!r} must be a positive int.")
        if self.meta_impl not in ("auto", "jnp", "kernel"):
            raise ValueError(
                f"config.meta_impl must be 'auto', 'jnp' or 'kernel', got {self.meta_impl!r}."
            )
        for name in ("prefetch_l2", "approx_math"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"config.{name} must be a bool, got {getattr(self, name)!r}.")

    @classmethod
    def for_shape(cls, d: int, n: int, *, num_sms: int | None = None, **overrides) -> "DecodeConfig":
        """Defaults for model width `d` and expert width `n`: the widest up block that divides
        n among (64, 128) and a 128- (else 64-) column down block. `num_sms` defaults to the
        device's SM count (132 on an H100 SXM)."""
        from pallas_moe.kernels.moe_forward import default_num_sms

        _common.require_multiple("d", d, 128, "the aggregation loads 128-column chunks")
        _common.require_multiple("n", n, 64, "the kernels tile the expert width by 64")
        down = 128 if d % 128 == 0 else 64
        base = cls(up_block_n=64, down_block_n=down, num_sms=num_sms or default_num_sms())
        return dataclasses.replace(base, **overrides)


def default_config(d: int, n: int, interpret) -> DecodeConfig:
    """`DecodeConfig.for_shape(d, n)`, with one CTA and the TMA row loader when `interpret`:
    interpret mode runs CTAs one after another, so the static scheduler's cross-CTA waits
    need a single CTA, and it always runs the TMA loader."""
    if interpret:
        return DecodeConfig.for_shape(d, n, num_sms=1, gather="tma")
    return DecodeConfig.for_shape(d, n)


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Static sizes of one kernel instance."""

    num_tokens: int
    d: int
    n: int
    num_experts: int
    capacity: int
    max_tiles: int
    num_blocks: int  # token blocks (aggregation tasks)
    agg_vec: int  # elements per thread per Y load
    up_blocks: int
    down_blocks: int

    @property
    def agg_width(self) -> int:
        return 128 * self.agg_vec

    @property
    def num_events(self) -> int:
        return self.max_tiles + self.num_blocks + 3

    # Event layout: up_done[max_tiles], tok_done[num_blocks], stage_up, stage_down, queue.
    @property
    def tok_done(self) -> int:
        return self.max_tiles

    @property
    def stage_up(self) -> int:
        return self.max_tiles + self.num_blocks

    @property
    def stage_down(self) -> int:
        return self.stage_up + 1

    @property
    def queue(self) -> int:
        return self.stage_up + 2


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["out", "a_slab", "y_slab", "h", "events"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DecodeOutputs:
    """Everything the kernel writes.

    Attributes:
      out: [T, d] the layer output (written by aggregation tasks).
      a_slab: bf16 [M * block_m, n] A in tile-major order (row `tile * block_m + i`);
        rows past a tile's real rows are unspecified.
      y_slab: bf16 [M * block_m, d] Y in the same order.
      h: bf16 [P, 2n] H in grouped-row order (only with `write_h`; padding rows unwritten).
      events: interpret mode only: i32 [3, N + 1] per-warpgroup counter increments (a
        counter is a column sum) and, in column N, each warpgroup's timed-out waits.
    """

    out: jax.Array | None
    a_slab: jax.Array | None
    y_slab: jax.Array | None
    h: jax.Array | None
    events: jax.Array | None


def _check_inputs(x, plan, w_gate_up, w_down, config: DecodeConfig):
    num_tokens, d, num_experts, n = _common.check_layer_operands(x, plan, w_gate_up, w_down)
    _common.require_dtype("x", x, jnp.bfloat16)
    _common.require_dtype("w_gate_up", w_gate_up, jnp.bfloat16)
    _common.require_dtype("w_down", w_down, jnp.bfloat16)
    _common.require_multiple("d (x.shape[1])", d, 128, "the aggregation loads 128-column chunks")
    _common.require_multiple(
        "n (w_gate_up.shape[2] // 2)", n, config.up_block_n,
        f"an up task computes config.up_block_n={config.up_block_n} gate columns",
    )
    _common.require_multiple(
        "d (x.shape[1])", d, config.down_block_n,
        f"a down task computes config.down_block_n={config.down_block_n} columns",
    )
    return num_tokens, d, n, num_experts


def _weight_ring(up_block_n: int, down_block_n: int) -> tuple[int, int, bool]:
    """The weight half of the SMEM ring: `(up_blocks, down_blocks, shared)`.

    A ring slot holds one K step of either kind: the gate and up tiles ([64, U] each) of an
    up task, or the [64, bn] tile of a down task. The kinds share the slot's bytes, and that
    is only safe slot by slot: the producer reuses slot s for a down step once the step that
    last used slot s is consumed, while the up steps in the other slots may still be in
    flight (the ping-pong consumer is finishing them). So each kind is one SMEM array
    `[stages, blocks, 64, cols]` whose slot stride is the same `slot_bytes` for both: slot s
    is bytes `[s * slot_bytes, (s + 1) * slot_bytes)` in both views (a Pallas `RefUnion`
    places each member at the union's start; a tuple member would lay out all gate slots,
    then all up slots, so that down slot s would overlap up slots 2s and 2s + 1: the bug the
    first H100 run found). The up view uses blocks 0 (gate) and 1 (up) of a slot, the down
    view block 0. When no common slot size is a whole number of blocks of both kinds
    (e.g. U = 256 with bn = 192), the two kinds get separate rings (`shared=False`).
    """
    up_block = BLOCK_K * up_block_n * 2
    down_block = BLOCK_K * down_block_n * 2
    slot = max(2 * up_block, down_block)
    if slot % up_block or slot % down_block:
        return 2, 1, False
    return slot // up_block, slot // down_block, True


def _weight_ring_scratch(stages: int, up_block_n: int, down_block_n: int, interpret: bool):
    """SMEM of the weight ring: `(up, down)` views `[stages, blocks, 64, cols]` (a tuple, or
    a `RefUnion` of the two when they share bytes slot by slot, see `_weight_ring`)."""
    dtype = jnp.bfloat16
    tf = _common.mma_transforms(dtype)
    up_q, down_q, shared = _weight_ring(up_block_n, down_block_n)
    up_w = plgpu.SMEM((stages, up_q, BLOCK_K, up_block_n), dtype, transforms=tf)
    down_w = plgpu.SMEM((stages, down_q, BLOCK_K, down_block_n), dtype, transforms=tf)
    if interpret or not shared:  # interpret mode does not alias union members
        return (up_w, down_w)
    return plgpu.RefUnion(up_w, down_w)  # slot s: one step of either kind


def _smem_bytes(config: DecodeConfig, n_out: int) -> int:
    s, bm, u, bn = config.num_stages, config.block_m, config.up_block_n, config.down_block_n
    a = s * bm * BLOCK_K * 2
    up_blocks, down_blocks, shared = _weight_ring(u, bn)
    up_slot, down_slot = up_blocks * BLOCK_K * u * 2, down_blocks * BLOCK_K * bn * 2
    weights = s * (max(up_slot, down_slot) if shared else up_slot + down_slot)
    epilogue = 2 * n_out * bm * u * 2 + 2 * bm * bn * 2
    return a + weights + epilogue + bm * 4 + 2 * config.mailbox_depth * 2 * 4 + 4


def moe_decode(
    x: jax.Array,
    plan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    config: DecodeConfig | None = None,
    write_h: bool = False,
    aggregation: str = "fp32",
    interpret: bool | plgpu.InterpretGPUParams = False,
    activation: SwiGLU = SwiGLU(),
) -> tuple[jax.Array, jax.Array | None]:
    """The MoE layer forward as one persistent megakernel.

    Args:
      x: bf16 [T, d] tokens (d a multiple of 128).
      plan: a `DispatchPlan` over T tokens and E experts.
      w_gate_up: bf16 [E, d, 2n] (gate = [..., :n], up = [..., n:]).
      w_down: bf16 [E, n, d].
      config: a `DecodeConfig` (default `DecodeConfig.for_shape(d, n)`; in interpret mode
        with one CTA).
      write_h: also write H [P, 2n] (the residual of the minimal backward).
      aggregation: "fp32", "bf16_per_expert" or "bf16_scores" (`pallas_moe.numerics`).
      interpret: run in Mosaic GPU interpret mode (CPU) if True or an InterpretGPUParams.
      activation: the `SwiGLU` spec of the up tasks' epilogue (`_common.swiglu_epilogue`).
        The megakernel takes no expert biases.

    Returns:
      (out [T, d] in x.dtype, h bf16 [P, 2n] or None). Padding rows of h are unspecified.
    """
    outs = decode_tasks(
        x, plan, w_gate_up, w_down, config=config, write_h=write_h, aggregation=aggregation,
        interpret=interpret, activation=activation,
    )
    return outs.out, outs.h


def decode_tasks(
    x: jax.Array,
    plan,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    *,
    config: DecodeConfig | None = None,
    kinds: tuple[str, ...] = TASK_KINDS,
    a_slab: jax.Array | None = None,
    y_slab: jax.Array | None = None,
    write_h: bool = False,
    aggregation: str = "fp32",
    interpret: bool | plgpu.InterpretGPUParams = False,
    meta: DecodeMeta | None = None,
    activation: SwiGLU = SwiGLU(),
) -> DecodeOutputs:
    """Runs the megakernel on the task kinds in `kinds` (all three: the MoE forward).

    With a subset, the task space holds only those kinds and waits on kinds that do not run
    are skipped, which is how each task function is tested alone: ("up",) writes the A slab;
    ("down",) reads `a_slab` and writes the Y slab; ("aggregate",) reads `y_slab` and writes
    the output. `meta`: a precomputed `decode_meta(plan, config, d, aggregation)` (computed
    here if None). Other arguments as in `moe_decode`; see `DecodeOutputs` for the results.
    """
    if config is None:
        if x.ndim != 2 or w_gate_up.ndim != 3:
            raise ValueError(
                f"x must be [T, d] and w_gate_up [E, d, 2n], got {tuple(x.shape)} and "
                f"{tuple(w_gate_up.shape)}."
            )
        config = default_config(x.shape[1], w_gate_up.shape[2] // 2, interpret)
    if not isinstance(config, DecodeConfig):
        raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}.")
    num_tokens, d, n, num_experts = _check_inputs(x, plan, w_gate_up, w_down, config)
    kinds = tuple(kinds)
    if not kinds or any(k not in TASK_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"kinds must be distinct names from {TASK_KINDS}, got {kinds!r}.")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}.")
    interpret_mode = _common.interpret_params(interpret)
    has_waits = ("up" in kinds and "down" in kinds) or ("down" in kinds and "aggregate" in kinds)
    if (interpret_mode is not None and has_waits and config.scheduler == "static"
            and config.num_sms != 1):
        raise ValueError(
            f"config.num_sms={config.num_sms}: interpret mode runs CTAs one after another, so "
            "the static scheduler's cross-CTA waits can only be interpreted with num_sms=1 "
            "(use the dynamic scheduler for more CTAs)."
        )
    bm = config.block_m
    max_tiles = max_decode_tiles(plan.capacity, num_experts, bm)
    n_out = 3 if write_h else 1
    if _smem_bytes(config, n_out) > _common.SMEM_BUDGET:
        raise ValueError(
            f"config needs {_smem_bytes(config, n_out)} bytes of SMEM, more than {_common.SMEM_BUDGET}: "
            "lower num_stages, up_block_n or down_block_n."
        )
    slab_rows = max_tiles * bm
    if "down" in kinds and "up" not in kinds:
        if a_slab is None:
            raise ValueError("kinds without 'up' need a_slab (the A slab the down tasks read).")
        _common.require_shape("a_slab", a_slab, (slab_rows, n))
        _common.require_dtype("a_slab", a_slab, jnp.bfloat16)
    if "aggregate" in kinds and "down" not in kinds:
        if y_slab is None:
            raise ValueError("kinds without 'down' need y_slab (the Y slab the aggregation reads).")
        _common.require_shape("y_slab", y_slab, (slab_rows, d))
        _common.require_dtype("y_slab", y_slab, jnp.bfloat16)
    agg_vec = next(v for v in (8, 4, 2, 1) if (d // 128) % v == 0)
    dims = _Dims(
        num_tokens=num_tokens, d=d, n=n, num_experts=num_experts, capacity=plan.capacity,
        max_tiles=max_tiles, num_blocks=-(-num_tokens // config.token_block), agg_vec=agg_vec,
        up_blocks=n // config.up_block_n, down_blocks=d // config.down_block_n,
    )
    if meta is None:
        # Interpreted, the metadata kernel runs interpreted.
        impl = resolve_meta_impl(config.meta_impl, num_tokens, interpret=interpret)
        meta = decode_meta(plan, config, d, aggregation, impl=impl)
    elif not isinstance(meta, DecodeMeta):
        raise TypeError(f"meta must be a DecodeMeta or None, got {type(meta).__name__}.")
    else:
        _common.require_shape("meta.row_ids", meta.row_ids, (max_tiles, bm))
        _common.require_shape("meta.block_target", meta.block_target, (dims.num_blocks,))
    read_a = "down" in kinds and "up" not in kinds
    read_y = "aggregate" in kinds and "down" not in kinds
    kernel = _kernel(
        config, dims, kinds, write_h, aggregation != "fp32", x.dtype, read_a, read_y,
        interpret_mode, activation,
    )
    args = [
        meta.counts, meta.expert, meta.row_start, meta.num_rows, meta.row_ids, meta.block_lo,
        meta.block_count, meta.block_target, meta.offsets, meta.agg_row, meta.agg_score,
        x, w_gate_up, w_down,
    ]
    if read_a:
        args.append(a_slab)
    if read_y:
        args.append(y_slab)
    outs = list(kernel(*args))
    out, a_out, y_out = outs[:3]
    rest = outs[3:]
    h = rest.pop(0) if write_h else None
    events = rest.pop(0) if interpret_mode is not None else None
    return DecodeOutputs(out=out, a_slab=a_out, y_slab=y_out, h=h, events=events)


def _kernel(config: DecodeConfig, dims: _Dims, kinds, write_h: bool, round_bf16: bool,
            out_dtype, read_a: bool, read_y: bool, interpret_mode, activation: SwiGLU = SwiGLU()):
    bm, u_cols, bn = config.block_m, config.up_block_n, config.down_block_n
    stages, depth, num_sms = config.num_stages, config.mailbox_depth, config.num_sms
    bt = config.token_block
    d, n = dims.d, dims.n
    num_k_up, num_k_down = d // BLOCK_K, n // BLOCK_K
    interpret = interpret_mode is not None
    cp_async = config.gather == "cp_async" and not interpret
    dtype = jnp.bfloat16
    n_out = 3 if write_h else 1
    runs_up, runs_down, runs_agg = ("up" in kinds), ("down" in kinds), ("aggregate" in kinds)
    # Waits exist only between kinds that both run.
    down_waits = runs_up and runs_down
    agg_waits = runs_down and runs_agg
    agg_layout = plgpu.Layout.WG_STRIDED((dims.agg_width,), vec_size=dims.agg_vec)
    num_chunks = d // dims.agg_width
    agg_group = max(1, AGG_LOADS_IN_FLIGHT // num_chunks)  # rows per load group
    prefetch_steps = min(stages, num_k_down)  # down-task weight steps issued before the wait

    def body(*refs):
        (counts_ref, expert_ref, start_ref, rows_ref, ids_ref, blo_ref, bcnt_ref, btgt_ref,
         off_ref, arow_ref, ascore_ref, x_ref, w1_ref, w2_ref, *rest) = refs
        a_in = rest.pop(0) if read_a else None
        y_in = rest.pop(0) if read_y else None
        out_ref, a_slab, y_slab, *rest = rest
        h_ref = rest.pop(0) if write_h else None
        ev_out = rest.pop(0) if interpret else None
        (ids_smem, a_bufs, w_bufs, o_up, o_dn, box, queue_smem,
         full_up, full_dn, empty, ids_bar, box_full, box_empty) = rest
        a_copy, a_mma = a_views(a_bufs)
        w_up, w_dn = w_views(w_bufs)  # [stages, blocks, 64, cols]: slot s is one K step

        def wg_smem(slot):  # gate tile [64, U] of an up step
            return w_up.at[slot, 0]

        def wu_smem(slot):  # up tile [64, U] of an up step
            return w_up.at[slot, 1]

        def wd_smem(slot):  # weight tile [64, bn] of a down step
            return w_dn.at[slot, 0]

        a_src = a_in if read_a else a_slab
        y_src = y_in if read_y else y_slab
        ev_ref = ev_out if interpret else pl.get_global(plgpu.SemaphoreType.REGULAR((dims.num_events,)))

        wg = jax.lax.axis_index("wg")
        sm = jax.lax.axis_index("sm")
        real_tiles = counts_ref[0]
        n_up = real_tiles * dims.up_blocks if runs_up else jnp.int32(0)
        n_down = real_tiles * dims.down_blocks if runs_down else jnp.int32(0)
        n_agg = dims.num_blocks if runs_agg else 0
        total = n_up + n_down + n_agg

        def decode_task(task):
            """(is_up, is_down, tile, column block, token block) of a global task index."""
            is_up = task < n_up
            is_down = (task >= n_up) & (task < n_up + n_down)
            j_up = task
            j_down = task - n_up
            tile = jnp.where(is_up, j_up // dims.up_blocks, j_down // dims.down_blocks)
            cb = jnp.where(is_up, j_up % dims.up_blocks, j_down % dims.down_blocks)
            block = task - n_up - n_down
            return is_up, is_down, tile, cb, block

        # ------------------------------------------------------------------ producer
        @pl.when(wg == _PRODUCER)
        def _producer():
            events = Events(ev_ref, interpret=interpret, row=_PRODUCER,
                            num_events=dims.num_events, scratch=queue_smem)
            if interpret:
                pl.when(sm == 0)(events.zero)

            def post(c, k, task, g):
                """Hands `task` (starting at ring step g) to consumer c's k-th mailbox."""
                slot = k % depth

                @pl.when(k >= depth)
                def _():
                    with jax.named_scope("post_wait"):
                        plgpu.barrier_wait(box_empty.at[c, slot])

                box[c, slot, 0] = task
                box[c, slot, 1] = g
                plgpu.barrier_arrive(box_full.at[c, slot])

            def issue_up(tile, cb, c, g0):
                """The loads of an up task."""
                w_e = w1_ref.at[expert_ref[tile]]  # [d, 2n]

                def full_of(k):  # the barrier the task's step k completes on
                    return full_up.at[c, (g0 + k) % stages]

                def issue_weights(k):
                    """Waits for step k's slot, then issues its gate and up weight tiles;
                    returns (slot, first K row, the slot's `full` barrier)."""
                    g = g0 + k
                    slot = g % stages
                    k0, bar = k * BLOCK_K, full_up.at[c, slot]

                    @pl.when(g >= stages)
                    def _():
                        with jax.named_scope("empty_wait"):
                            plgpu.barrier_wait(empty.at[slot])

                    with jax.named_scope("weights"):
                        plgpu.copy_gmem_to_smem(  # [64, U] gate columns of W1[e]
                            w_e.at[pl.ds(k0, BLOCK_K), pl.ds(cb * u_cols, u_cols)], wg_smem(slot),
                            bar)
                        plgpu.copy_gmem_to_smem(  # [64, U] the matching up columns
                            w_e.at[pl.ds(k0, BLOCK_K), pl.ds(n + cb * u_cols, u_cols)],
                            wu_smem(slot), bar)
                    return slot, k0, bar

                # Every producer lane is done reading the previous tile's ids (generic
                # proxy) before the TMA (async proxy) overwrites them.
                with jax.named_scope("ids"):
                    plgpu.commit_smem()
                    plgpu.copy_gmem_to_smem(ids_ref.at[tile], ids_smem, ids_bar)
                    plgpu.barrier_wait(ids_bar)

                def step(k, carry):
                    slot, k0, bar = issue_weights(k)
                    if cp_async:
                        with jax.named_scope("gather"):
                            _common.cp_async_gather_rows(x_ref.at[:, pl.ds(k0, BLOCK_K)], ids_smem,
                                                         [a_mma.at[slot]], num_rows=bm,
                                                         zero_negative=True)

                        # Step k - (stages - 2), once its rows landed (`_common.cp_async_publish`).
                        with jax.named_scope("publish"):
                            _common.cp_async_publish(k, full_of, [], stages)
                    else:
                        rows_per_warp = bm // 4

                        def per_warp(w):
                            _common.gather_rows(
                                x_ref, ids_smem, [a_copy.at[slot]], bar, col0=k0, width=BLOCK_K,
                                first_row=w * rows_per_warp, num_rows=rows_per_warp, unroll=4,
                                negative_repeats=True,
                            )

                        plgpu.warp_map(per_warp)
                    return carry

                jax.lax.fori_loop(0, num_k_up, step, None)
                if cp_async:  # publish the last stages - 2 steps
                    _common.cp_async_publish_rest(num_k_up, full_of, [], stages)

            def issue_down(tile, cb, c, g0):
                w_e = w2_ref.at[expert_ref[tile]]  # [n, d]
                a_rows = pl.ds(tile * bm, bm)

                def w_tile(k):
                    return w_e.at[pl.ds(k * BLOCK_K, BLOCK_K), pl.ds(cb * bn, bn)]

                def wait_slot(g):
                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(empty.at[g % stages])

                # Weights first: they do not depend on the up tasks.
                for k in range(prefetch_steps):
                    g = g0 + k
                    wait_slot(g)
                    plgpu.copy_gmem_to_smem(w_tile(k), wd_smem(g % stages), full_dn.at[c, g % stages])
                if config.prefetch_l2 and not interpret:
                    for k in range(prefetch_steps, num_k_down):
                        plgpu.async_prefetch(w_tile(k))
                if down_waits:
                    with jax.named_scope("event_wait"):
                        if config.fused:
                            events.wait(tile, dims.up_blocks)  # up_done[tile]
                        else:
                            events.wait(dims.stage_up, n_up)
                for k in range(prefetch_steps):
                    g = g0 + k
                    plgpu.copy_gmem_to_smem(
                        a_src.at[a_rows, pl.ds(k * BLOCK_K, BLOCK_K)], a_mma.at[g % stages],
                        full_dn.at[c, g % stages],
                    )

                def step(k, carry):
                    g = g0 + k
                    slot = g % stages
                    wait_slot(g)
                    plgpu.copy_gmem_to_smem(w_tile(k), wd_smem(slot), full_dn.at[c, slot])
                    plgpu.copy_gmem_to_smem(
                        a_src.at[a_rows, pl.ds(k * BLOCK_K, BLOCK_K)], a_mma.at[slot],
                        full_dn.at[c, slot],
                    )
                    return carry

                jax.lax.fori_loop(prefetch_steps, num_k_down, step, None)

            def fetch_task():
                return events.fetch_add(dims.queue, 1)

            def schedule(carry):
                j, g, k0, k1, _ = carry
                if config.scheduler == "static":
                    task = sm + j * num_sms
                else:
                    task = fetch_task()
                valid = task < total
                c = j % 2
                is_up, is_down, tile, cb, _ = decode_task(task)
                steps = jnp.where(is_up, num_k_up, jnp.where(is_down, num_k_down, 0))
                for ci, kc in ((0, k0), (1, k1)):
                    @pl.when(valid & (c == ci))
                    def _(ci=ci, kc=kc):
                        post(ci, kc, task, g)

                        @pl.when(is_up)
                        def _():
                            issue_up(tile, cb, ci, g)

                        @pl.when(is_down)
                        def _():
                            issue_down(tile, cb, ci, g)

                g = g + jnp.where(valid, steps, 0)
                took0 = (valid & (c == 0)).astype(jnp.int32)
                took1 = (valid & (c == 1)).astype(jnp.int32)
                return j + valid.astype(jnp.int32), g, k0 + took0, k1 + took1, ~valid

            zero = jnp.int32(0)
            init = (zero, zero, zero, zero, jnp.bool_(False))
            _, g_end, k0, k1, _ = jax.lax.while_loop(lambda c: ~c[4], schedule, init)
            # No more tasks: a sentinel to each consumer.
            post(0, k0, jnp.int32(-1), g_end)
            post(1, k1, jnp.int32(-1), g_end)

            # Observe every barrier phase still pending, so none is left half-consumed
            # (interpret mode checks this).
            def drain_ring(g, carry):
                plgpu.barrier_wait(empty.at[g % stages])
                return carry

            jax.lax.fori_loop(jnp.maximum(g_end - stages, 0), g_end, drain_ring, None)
            for ci, kc in ((0, k0 + 1), (1, k1 + 1)):
                def drain_box(k, carry, ci=ci):
                    plgpu.barrier_wait(box_empty.at[ci, k % depth])
                    return carry

                jax.lax.fori_loop(jnp.maximum(kc - depth, 0), kc, drain_box, None)

        # ------------------------------------------------------------------ consumers
        for c in range(2):
            @pl.when(wg == c)
            def _consumer(c=c):
                events = Events(ev_ref, interpret=interpret, row=c, num_events=dims.num_events)

                def up_sums(g0):
                    """f32 [bm, U] gate and up sums over the task's `num_k_up` K steps."""
                    def mma_scope(acc_g, acc_u):
                        def mma(slot):
                            plgpu.wgmma(acc_g, a_mma.at[slot], wg_smem(slot))  # [64,64]@[64,U]
                            plgpu.wgmma(acc_u, a_mma.at[slot], wu_smem(slot))

                        with jax.named_scope("k_loop"):
                            _common.consumer_k_loop(
                                num_k_up, stages, lambda g, slot: plgpu.barrier_wait(
                                    full_up.at[c, slot]), mma, empty, mmas_per_step=2,
                                step_of=lambda k: g0 + k)
                        plgpu.barrier_arrive(empty.at[(g0 + num_k_up - 1) % stages])
                        return acc_g[...], acc_u[...]

                    return pl.run_scoped(
                        mma_scope, plgpu.ACC((bm, u_cols), jnp.float32),
                        plgpu.ACC((bm, u_cols), jnp.float32),
                    )

                def run_up(tile, cb, g0):
                    finish_up(tile, cb, *up_sums(g0))

                @jax.named_scope("epilogue")  # a region of the on-device profiler
                def finish_up(tile, cb, gate, up):
                    """The SwiGLU epilogue: A (and H) of the tile's column block, stored;
                    then up_done[tile] (or the unfused stage counter)."""
                    act, hg, hu = _common.swiglu_epilogue(gate, up, dtype, activation)
                    o_up[c, 0] = act
                    if write_h:
                        o_up[c, 1] = hg
                        o_up[c, 2] = hu
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_up.at[c, 0], a_slab.at[pl.ds(tile * bm, bm), pl.ds(cb * u_cols, u_cols)]
                    )
                    if write_h:
                        row0, count = start_ref[tile], rows_ref[tile]
                        _common.store_rows(
                            o_up.at[c, 1], h_ref.at[:, pl.ds(cb * u_cols, u_cols)], row0, count, bm
                        )
                        _common.store_rows(
                            o_up.at[c, 2], h_ref.at[:, pl.ds(n + cb * u_cols, u_cols)], row0, count, bm
                        )
                    plgpu.wait_smem_to_gmem(0)  # written, not just read: then notify
                    events.notify(tile if config.fused else dims.stage_up)

                def run_down(tile, cb, g0):
                    def mma_scope(acc):
                        def mma(slot):  # [64,64]@[64,bn]
                            plgpu.wgmma(acc, a_mma.at[slot], wd_smem(slot))

                        with jax.named_scope("k_loop"):
                            _common.consumer_k_loop(
                                num_k_down, stages, lambda g, slot: plgpu.barrier_wait(
                                    full_dn.at[c, slot]), mma, empty, mmas_per_step=1,
                                step_of=lambda k: g0 + k)
                        plgpu.barrier_arrive(empty.at[(g0 + num_k_down - 1) % stages])
                        return acc[...]

                    y = pl.run_scoped(mma_scope, plgpu.ACC((bm, bn), jnp.float32))
                    store_down(tile, cb, y)

                @jax.named_scope("epilogue")
                def store_down(tile, cb, y):
                    """Y of the tile's column block, stored; then its token blocks' events."""
                    o_dn[c] = y.astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_dn.at[c], y_slab.at[pl.ds(tile * bm, bm), pl.ds(cb * bn, bn)]
                    )
                    plgpu.wait_smem_to_gmem(0)
                    if config.fused:
                        events.notify_range(dims.tok_done + blo_ref[tile], bcnt_ref[tile])
                    else:
                        events.notify(dims.stage_down)

                def run_aggregate(block):
                    if agg_waits:
                        with jax.named_scope("event_wait"):
                            if config.fused:
                                events.wait(dims.tok_done + block, btgt_ref[block])
                            else:
                                events.wait(dims.stage_down, n_down)
                    for i in range(bt):
                        t = block * bt + i

                        @pl.when(t < dims.num_tokens)
                        def _(t=t):
                            aggregate_token(t)

                def aggregate_token(t):
                    j0, j1 = off_ref[t], off_ref[t + 1]
                    num_groups = (j1 - j0) // agg_group

                    def chunk(ch):
                        return pl.ds(ch * dims.agg_width, dims.agg_width)

                    def add(acc, y, s):
                        term = y.astype(jnp.float32) * s
                        if not round_bf16:
                            return acc + term
                        term = term.astype(jnp.bfloat16).astype(jnp.float32)
                        return (acc + term).astype(jnp.bfloat16).astype(jnp.float32)

                    def group(q, accs):
                        # Every load of the group first (agg_group rows x all column chunks in
                        # flight), then the sums, each chunk in CSR order.
                        base = j0 + q * agg_group
                        rows = [arow_ref[base + i] for i in range(agg_group)]
                        loads = [
                            [plgpu.load(y_src.at[r, chunk(ch)], layout=agg_layout)
                             for ch in range(num_chunks)]
                            for r in rows
                        ]
                        accs = list(accs)
                        for i, row_loads in enumerate(loads):
                            s = ascore_ref[base + i]
                            for ch, y in enumerate(row_loads):
                                accs[ch] = add(accs[ch], y, s)
                        return tuple(accs)

                    def single(j, accs):
                        r, s = arow_ref[j], ascore_ref[j]
                        loads = [plgpu.load(y_src.at[r, chunk(ch)], layout=agg_layout)
                                 for ch in range(num_chunks)]
                        return tuple(add(a, y, s) for a, y in zip(accs, loads))

                    zero = plgpu.layout_cast(jnp.zeros((dims.agg_width,), jnp.float32), agg_layout)
                    accs = (zero,) * num_chunks
                    accs = jax.lax.fori_loop(0, num_groups, group, accs)
                    accs = jax.lax.fori_loop(j0 + num_groups * agg_group, j1, single, accs)
                    for ch, acc in enumerate(accs):
                        out_ref[t, chunk(ch)] = acc.astype(out_dtype)

                def consume(carry):
                    k, _ = carry
                    slot = k % depth
                    with jax.named_scope("task_wait"):
                        plgpu.barrier_wait(box_full.at[c, slot])
                    task = box[c, slot, 0]
                    g0 = box[c, slot, 1]
                    plgpu.barrier_arrive(box_empty.at[c, slot])
                    valid = task >= 0
                    is_up, is_down, tile, cb, block = decode_task(task)

                    @pl.when(valid & is_up)
                    def _():
                        run_up(tile, cb, g0)

                    @pl.when(valid & is_down)
                    def _():
                        run_down(tile, cb, g0)

                    is_agg = valid & ~is_up & ~is_down

                    @pl.when(is_agg)
                    def _():
                        run_aggregate(block)

                    return k + 1, ~valid

                jax.lax.while_loop(lambda c: ~c[1], consume, (jnp.int32(0), jnp.bool_(False)))

    a_scratch, a_views = _common.row_gather_buffers(stages, bm, BLOCK_K, dtype, interpret)
    w_scratch = _weight_ring_scratch(stages, u_cols, bn, interpret)

    def w_views(refs):
        return refs[0], refs[1]

    up_arrivals = 2 + (1 if cp_async else bm)  # two weight copies + the A rows
    scratch = [
        plgpu.SMEM((bm,), jnp.int32),  # token ids of the up tile being gathered
        a_scratch,
        w_scratch,
        plgpu.SMEM((2, n_out, bm, u_cols), dtype),  # up epilogue tiles, per consumer
        plgpu.SMEM((2, bm, bn), dtype),  # down epilogue tiles, per consumer
        plgpu.SMEM((2, depth, 2), jnp.int32),  # mailboxes: (task, first ring step)
        plgpu.SMEM((1,), jnp.int32),  # the queue's fetch-and-add broadcast
        plgpu.Barrier(num_arrivals=up_arrivals, num_barriers=(2, stages)),
        plgpu.Barrier(num_arrivals=2, num_barriers=(2, stages)),  # A box + weight box
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(),
        plgpu.Barrier(num_arrivals=1, num_barriers=(2, depth)),
        plgpu.Barrier(num_arrivals=1, num_barriers=(2, depth)),
    ]
    slab_rows = dims.max_tiles * bm
    out_types = [
        jax.ShapeDtypeStruct((dims.num_tokens, d), out_dtype),
        jax.ShapeDtypeStruct((slab_rows, n), dtype),
        jax.ShapeDtypeStruct((slab_rows, d), dtype),
    ]
    if write_h:
        out_types.append(jax.ShapeDtypeStruct((dims.capacity, 2 * n), dtype))
    if interpret:
        out_types.append(jax.ShapeDtypeStruct((INTERPRET_ROWS, dims.num_events + 1), jnp.int32))
    return plgpu.kernel(
        body,
        kernel_name="moe_decode",
        out_type=tuple(out_types),
        scratch_types=scratch,
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Lane, approx_math=config.approx_math,
        ),
        interpret=interpret_mode,
    )
