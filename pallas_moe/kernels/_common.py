"""Helpers shared by the forward kernels: input checks, per-tile metadata, row-exact stores.

Everything here is either plain jnp (run once per plan, outside the kernels) or a small
piece of Pallas Mosaic GPU code called from inside a kernel body.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_moe._xla_flags import xla_cpu_pool_threads
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.routing.plan import TileSchedule, count_at_most, tile_schedule

# bf16 with a 128-byte swizzle: the minor (K) dimension of an MMA operand tile in SMEM.
SWIZZLE_BYTES = 128
# Pallas starts every SMEM scratch ref, and every member of a RefUnion group, this aligned.
SMEM_ALIGNMENT = 1024
# Dynamic SMEM of an H100 (and H200) CTA: what Mosaic GPU refuses a kernel above.
SMEM_MAX = 232448
# SMEM_MAX less a margin for barriers, alignment and Pallas' own scratch (about 3 KB
# measured by lowering): what the kernels that size their pipelines from a config check
# their main buffers against (decode megakernel, ping-pong up-proj). The grouped GEMM
# counts every scratch ref, aligned, and its barriers, against SMEM_MAX itself.
SMEM_BUDGET = SMEM_MAX - 4096


def mma_transforms(dtype) -> tuple:
    """SMEM transforms for a wgmma operand tile whose minor dim is a multiple of 64 bf16."""
    elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


# The XLA CPU thread pool interpret mode needs so that its blocked callbacks cannot take
# every thread (`interpret_params`): no kernel here keeps more than ~16 simulated programs
# blocked at once (the launching program, at most 3 warpgroups, 4 warps under each).
INTERPRET_MIN_CPU_THREADS = 32


def is_interpreted(interpret: bool | plgpu.InterpretGPUParams) -> bool:
    """Whether the public `interpret` flag (True or an `InterpretGPUParams`) asks for
    interpret mode."""
    return isinstance(interpret, plgpu.InterpretGPUParams) or bool(interpret)


def interpret_params(interpret: bool | plgpu.InterpretGPUParams, detect_races: bool = False):
    """Maps the public `interpret` flag to what `plgpu.kernel` takes.

    Warns (RuntimeWarning) when interpret mode would run on an XLA CPU thread pool smaller
    than `INTERPRET_MIN_CPU_THREADS`. Mosaic GPU's interpreter runs every simulated
    warpgroup (and warp) as its own XLA program, and those programs block inside host
    callbacks (barrier waits; the launching program waits for its warpgroups), while XLA
    may move any part of any program onto its one shared CPU pool (one thread per core by
    default). When blocked callbacks hold every pool thread, the warpgroup they wait for
    never runs: a jitted kernel hangs with no CPU use (seen on 2-core machines; with a
    1-thread pool the jitted interpret backward hangs every time)."""
    if not is_interpreted(interpret):
        return None
    threads = xla_cpu_pool_threads()
    if threads < INTERPRET_MIN_CPU_THREADS:
        warnings.warn(
            f"Mosaic GPU interpret mode on an XLA CPU thread pool of {threads} threads can "
            "deadlock under jit (simulated warpgroups block in host callbacks on that pool). "
            f"Set PJRT_NPROC={INTERPRET_MIN_CPU_THREADS} in the environment before JAX "
            "creates its CPU backend.", RuntimeWarning, stacklevel=3)
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def require_multiple(arg: str, value: int, multiple: int, why: str) -> None:
    """Raises a ValueError naming `arg` when `value % multiple != 0`."""
    if value % multiple:
        raise ValueError(f"{arg}={value} must be a multiple of {multiple} ({why}).")


def require_wgmma_blocks(config, block_n_why: str, block_ks: tuple[int, ...] = (64,)) -> None:
    """Checks the block sizes shared by the varlen-M GEMM kernels (dH, dX~, down-proj).

    `config` has `block_m`, `block_n`, `block_k` and `num_stages`; errors name the field.
    `block_ks`: the allowed `block_k` (64 = one 128-byte swizzle row of bf16; the grouped
    GEMM's fp8 mode also takes 128, and checks it against the dtype).
    """
    require_multiple("config.block_m", config.block_m, 64, "wgmma tiles rows by 64")
    require_multiple("config.block_n", config.block_n, 64, block_n_why)
    if config.block_n > 256:
        raise ValueError(f"config.block_n={config.block_n} must be at most 256 (one wgmma N).")
    if config.block_k not in block_ks:
        allowed = " or ".join(map(str, block_ks))
        raise ValueError(
            f"config.block_k={config.block_k} must be {allowed} (one 128-byte swizzle row "
            "of the inputs: 64 bf16 elements, 128 fp8)."
        )
    if config.num_stages < 2:
        raise ValueError(f"config.num_stages={config.num_stages} must be >= 2.")


PRODUCER_REGISTERS = 40  # per thread of a producer warpgroup after `role_registers`


def launch_registers(num_warpgroups: int) -> int:
    """Registers per thread a CTA of `num_warpgroups` warpgroups launches with: the 64K
    register file over its threads, a multiple of 8, at most 248 (a thread's limit is 255)."""
    return min(65536 // (128 * num_warpgroups) // 8 * 8, 248)


def consumer_registers(num_consumers: int) -> int:
    """Registers per consumer thread once the producer warpgroup drops to
    `PRODUCER_REGISTERS` (a multiple of 8, at most 240).

    `setmaxnreg.inc` takes registers only from those the CTA's own `setmaxnreg.dec` released,
    not from the SM's unallocated ones, and blocks until they are there. So the consumers
    may share out only what the producer frees: launch + (launch - 40) / C each. Session 56
    found the old formula (the whole file split evenly: 112 for four consumers, against a
    launch count of 96 and 56 freed per producer thread, 14 per consumer thread) hanging a
    four-consumer dH on the H100; two and three consumers (232 and 152) are unchanged.
    """
    launch = launch_registers(num_consumers + 1)
    freed = (launch - PRODUCER_REGISTERS) // num_consumers
    return min(launch + freed // 8 * 8, 240)


def role_registers(role: str, num_consumers: int) -> None:
    """Moves registers from the producer warpgroup to the consumers (setmaxnreg). Call it
    first thing in each role's branch, from every warpgroup (a consumer's raise waits until
    the producers' registers are free, so a producer must lower even when it has no work).

    Without it every thread of a 3-warpgroup kernel is capped at 168 registers, and a
    consumer holding two 64x128 fp32 accumulators plus an epilogue spills to local memory
    (seen with Nsight Compute on the H100: 7.1 M spill requests in one 7B dH call). The
    producers only issue copies and need few registers.

    Why in the role's branch: ptxas allocates registers for the code a `setmaxnreg`
    dominates from its new count, and for other code from the launch count (65536 /
    threads). Measured on the H100 (session 11, benchmarks/RESULTS.md): a 4-warpgroup
    up-proj whose consumers hold 128 accumulator registers ran 4.2x slower with the raise
    in a separate branch at the top of the kernel (its wgmmas serialized at the launch
    count of 128) than with it in the consumer branch; the 3-warpgroup kernels were
    bitwise equal and within -4.5%..+0.9% either way.

    Args:
      role: "producer" (down to `PRODUCER_REGISTERS`) or "consumer" (up to
        `consumer_registers(num_consumers)`).
    """
    if role == "producer":
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
    elif role == "consumer":
        plgpu.set_max_registers(consumer_registers(num_consumers), action="increase")
    else:
        raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}.")


GATHER_MODES = ("tma", "cp_async")
# How consumers learn that a stage's cp.async rows landed (`config.gather_completion`):
# "mbarrier": every producer thread's `cp.async.mbarrier.arrive.noinc` on a per-slot mbarrier
#   (`cp_async_stage_barriers`), so the hardware completes the stage and the producer never
#   waits for its own loads: all `num_stages` steps can be in flight.
# "wait_group": the producer waits for its own group `stages - 2` steps later, fences it and
#   arrives on `full` (`cp_async_publish_lagged`): only `stages - 2` steps in flight.
# The kernels call `cp_async_publish`, `cp_async_publish_rest` and `cp_async_consumer_wait`,
# which pick the way from whether the kernel allocated the per-slot mbarriers.
GATHER_COMPLETIONS = ("mbarrier", "wait_group")


def require_gather_mode(config) -> None:
    """Checks `config.gather` of a gathering kernel (with `num_consumers`, `num_stages`)."""
    if config.gather not in GATHER_MODES:
        raise ValueError(f"config.gather must be one of {GATHER_MODES}, got {config.gather!r}.")
    if config.gather == "cp_async":
        if config.num_consumers < 1:
            raise ValueError(
                "config.gather='cp_async' needs the warp-specialized kernel "
                f"(num_consumers >= 1), got num_consumers={config.num_consumers}."
            )
        if config.num_stages < 3:
            raise ValueError(
                f"config.gather='cp_async' needs num_stages >= 3, got {config.num_stages}."
            )
    if config.gather_completion not in GATHER_COMPLETIONS:
        raise ValueError(
            f"config.gather_completion must be one of {GATHER_COMPLETIONS}, "
            f"got {config.gather_completion!r}."
        )


def gather_full_arrivals(config, rows: int, interpret: bool) -> int:
    """Arrivals the gathered A operand adds to a stage's `full` barrier: one per row copy
    with the TMA loader (the one interpret mode runs), one lagged publish with cp.async
    "wait_group", none with cp.async "mbarrier" (its own per-slot barriers track it)."""
    if config.gather != "cp_async" or interpret:
        return rows
    return 0 if config.gather_completion == "mbarrier" else 1


def uses_stage_mbarriers(config, interpret: bool) -> bool:
    """Whether a gathering kernel tracks its cp.async stages with `cp_async_stage_barriers`."""
    return config.gather == "cp_async" and not interpret and config.gather_completion == "mbarrier"


def gate_up_widths(x, w_gate_up) -> tuple[int, int]:
    """(d, n) of x [T, d] and w_gate_up [E, d, 2n], checked against each other (errors name
    the argument): the shape check of every kernel that multiplies x by w_gate_up."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}.")
    if w_gate_up.ndim != 3:
        raise ValueError(f"w_gate_up must be [E, d, 2n], got shape {tuple(w_gate_up.shape)}.")
    d = x.shape[1]
    _, d_w, two_n = w_gate_up.shape
    if d_w != d:
        raise ValueError(f"w_gate_up.shape[1]={d_w} must equal x.shape[1]={d}.")
    if two_n % 2:
        raise ValueError(f"w_gate_up.shape[2]={two_n} must be even (gate and up halves).")
    return d, two_n // 2


def check_layer_operands(x, plan, w_gate_up, w_down) -> tuple[int, int, int, int]:
    """Checks a layer's operands against each other: x [T, d], w_gate_up [E, d, 2n],
    w_down [E, n, d], and a plan over T tokens and E experts. Errors name the argument.

    Returns:
      (T, d, E, n).
    """
    if x.ndim != 2:
        raise ValueError(f"x must be [T, d], got shape {tuple(x.shape)}.")
    if w_gate_up.ndim != 3 or w_down.ndim != 3:
        raise ValueError(
            f"w_gate_up must be [E, d, 2n] and w_down [E, n, d], got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}."
        )
    num_tokens, _ = x.shape
    num_experts = w_gate_up.shape[0]
    d, n = gate_up_widths(x, w_gate_up)
    require_shape("w_down", w_down, (num_experts, n, d))
    if plan.num_tokens != num_tokens:
        raise ValueError(f"plan covers {plan.num_tokens} tokens but x has {num_tokens}.")
    if plan.num_experts != num_experts:
        raise ValueError(f"plan has {plan.num_experts} experts but w_gate_up has {num_experts}.")
    return num_tokens, d, num_experts, n


def require_shape(arg: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{arg} must have shape {tuple(shape)}, got {tuple(x.shape)}.")


def require_dtype(arg: str, x: jax.Array, dtype) -> None:
    if x.dtype != jnp.dtype(dtype):
        raise TypeError(f"{arg} must have dtype {jnp.dtype(dtype).name}, got {x.dtype}.")


# The grid axis of a kernel's clusters of CTAs (`cluster_m` of the configs below): the
# cluster rank of a CTA, the collective axis of multicast copies and of cluster barriers.
CLUSTER_AXIS = "cluster"


def cluster_grid(clusters: int) -> dict:
    """`plgpu.kernel` keyword arguments for a grid of clusters of `clusters` CTAs (none for
    one CTA: a plain grid)."""
    return dict(cluster=(clusters,), cluster_names=(CLUSTER_AXIS,)) if clusters > 1 else {}


def cluster_multicast(clusters: int) -> str | None:
    """The `collective_axes` of a copy every CTA of the cluster receives (None: one CTA)."""
    return CLUSTER_AXIS if clusters > 1 else None


def cluster_rank(clusters: int):
    """This CTA's rank in its cluster (0 with one CTA per cluster)."""
    return jax.lax.axis_index(CLUSTER_AXIS) if clusters > 1 else 0


def cluster_barrier(clusters: int, **kwargs):
    """A barrier the arrivals of every CTA of the cluster complete (`plgpu.ClusterBarrier`:
    each `num_arrivals` per CTA), or with one CTA a `plgpu.Barrier`; `kwargs` as theirs."""
    if clusters > 1:
        return plgpu.ClusterBarrier(collective_axes=(CLUSTER_AXIS,), **kwargs)
    return plgpu.Barrier(**kwargs)


def require_cluster_m(config) -> None:
    """A kernel config's `cluster_m` (CTAs per cluster) is 1 or 2."""
    if config.cluster_m not in (1, 2):
        raise ValueError(f"config.cluster_m={config.cluster_m} must be 1 or 2.")


class ClusterTiles:
    """Mixin of the kernel configs whose items may run on clusters of CTAs (`block_m` and
    `cluster_m` fields): a cluster item is `cluster_m` consecutive blocks of `block_m` rows,
    one per CTA, so its tile metadata is made for `tile_rows` rows."""

    @property
    def tile_rows(self) -> int:
        """Rows of one metadata tile (`TileMeta.block_m`): a cluster item's `cluster_m`
        row blocks of `block_m` rows."""
        return self.block_m * self.cluster_m


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["expert", "row_start", "num_rows", "row_ids"],
    meta_fields=["block_m"],
)
@dataclasses.dataclass(frozen=True)
class TileMeta:
    """What the kernels read per row tile, derived once per plan from `TileSchedule`.

    Attributes:
      expert: i32[num_tiles] expert of each tile.
      row_start: i32[num_tiles] first grouped row of the tile.
      num_rows: i32[num_tiles] real rows in the tile (0 for the empty tiles past the end).
      row_ids: i32[num_tiles, block_m] for the gathered up-proj: source token of each row of
        the tile; rows past `num_rows` repeat the tile's last real row (so every copy is in
        bounds and the number of copies per stage is static), empty tiles read token 0.
      block_m: static tile height.
    """

    expert: jax.Array
    row_start: jax.Array
    num_rows: jax.Array
    row_ids: jax.Array
    block_m: int

    @property
    def num_tiles(self) -> int:
        return self.expert.shape[0]

    def real_tiles(self) -> jax.Array:
        """i32[1]: the tiles with rows, a prefix of the schedule (`tile_schedule`); the
        persistent ping-pong kernels walk only those."""
        return jnp.sum(self.num_rows > 0, dtype=jnp.int32).reshape(1)


def tile_meta(
    group_sizes: jax.Array, token_ids: jax.Array, block_m: int, *, with_row_ids: bool = True
) -> TileMeta:
    """Per-tile metadata from `tile_schedule` (computed once per plan and block size)."""
    capacity = token_ids.shape[0]
    sched: TileSchedule = tile_schedule(group_sizes, capacity, block_m)
    num_rows = sched.row_end - sched.row_start  # [nt]
    if with_row_ids:
        local = jnp.arange(block_m, dtype=jnp.int32)[None, :]  # [1, bm]
        last = jnp.maximum(num_rows - 1, 0)[:, None]  # [nt, 1]
        rows = sched.row_start[:, None] + jnp.minimum(local, last)  # [nt, bm]
        rows = jnp.clip(rows, 0, capacity - 1)
        row_ids = jnp.where(num_rows[:, None] > 0, token_ids[rows], 0).astype(jnp.int32)
    else:
        row_ids = jnp.zeros((sched.max_tiles, 1), jnp.int32)
    return TileMeta(
        expert=sched.expert,
        row_start=sched.row_start,
        num_rows=num_rows.astype(jnp.int32),
        row_ids=row_ids,
        block_m=block_m,
    )


def row_gather_buffers(stages: int, block_m: int, block_k: int, dtype, interpret: bool):
    """SMEM for gathered A stages: (scratch type, fn(scratch) -> (copy view, mma view)).

    The wgmma view is tiled (8, 64) + 128-byte swizzle. Pallas only slices a tiled ref at
    multiples of the tile height, so one-row TMA copies go through a second view of the
    same bytes tiled (1, 64) + 128-byte swizzle: for a 64-column (128-byte) minor dim both
    tilings are row-major and the swizzle is a function of the SMEM address, so the views
    agree byte for byte. Interpret mode keeps logical (untiled) buffers and does not alias
    `RefUnion` members, and it allows one-row slices of the tiled view, so there one ref
    serves as both views.
    """
    return _two_view_buffer(*_gather_view_types((stages, block_m, block_k), dtype), interpret)


def _two_view_buffer(copy_view, mma_view, interpret: bool):
    """(scratch type, fn(scratch) -> (copy view, wgmma view)) of one buffer with two views:
    a `RefUnion` of both, or in interpret mode (which does not alias `RefUnion` members and
    allows one-row slices of the wgmma tiling) one ref that serves as both."""
    if interpret:
        return mma_view, lambda ref: (ref, ref)
    return plgpu.RefUnion(copy_view, mma_view), lambda refs: tuple(refs)


def _gather_view_types(shape, dtype):
    """(copy view, wgmma view) SMEM types of the same gathered-A bytes: tiled (1, 64) for
    one-row TMA copies and (8, 64) for wgmma, both 128-byte swizzled."""
    sw = plgpu.SwizzleTransform(SWIZZLE_BYTES)
    elems = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    copy_view = plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((1, elems)), sw))
    return copy_view, plgpu.SMEM(shape, dtype, transforms=mma_transforms(dtype))


def swiglu_epilogue(gate_acc, up_acc, dtype, activation=SwiGLU(), gate_bias=None, up_bias=None):
    """The up-proj's SwiGLU epilogue: `(A, H_gate, H_up)` in `dtype` from fp32 accumulators.

    Args:
      gate_acc, up_acc: fp32 [rows, cols] accumulators of the gate and up columns.
      dtype: H's and A's dtype (bf16).
      activation: the `SwiGLU` spec (plain or gpt-oss's clamped variant).
      gate_bias, up_bias: None, or fp32 [rows, cols] expert-bias columns (`bias_columns`),
        added to the accumulators before H is rounded.

    H (the saved residual) is the biased pre-activation rounded to `dtype`, and A is computed
    in fp32 from the rounded H by `activation.apply`, so A is exactly what the backward
    recomputes from the saved H, and every backend computes one formula.
    """
    if gate_bias is not None:
        gate_acc = gate_acc + gate_bias
        up_acc = up_acc + up_bias
    hg = gate_acc.astype(dtype)
    hu = up_acc.astype(dtype)
    act = activation.apply(hg.astype(jnp.float32), hu.astype(jnp.float32)).astype(dtype)
    return act, hg, hu


def bias_columns(bias_smem, rows: int):
    """fp32 [rows, cols]: a `[cols]` expert-bias row staged in SMEM, broadcast down the rows
    in the layout of a wgmma accumulator (each thread reads only its own columns).

    Kernels TMA the CTA's bias columns into SMEM once per tile (before the K loop, so the
    copy lands while the tile computes) and read them here in the epilogue. Needs the Lane
    lowering semantics (an explicit layout).
    """
    (cols,) = bias_smem.shape
    layout = plgpu.Layout.WGMMA.reduce(0)
    row = plgpu.load(bias_smem, layout=layout, optimized=False).astype(jnp.float32)
    return jax.lax.broadcast_in_dim(row, (rows, cols), [1])


def gathered_pipeline_smem(a_shape, dtype, others, epilogue, interpret: bool, row_tiles=()):
    """SMEM of a gathered-A pipeline whose epilogue reuses the pipeline's bytes.

    Args:
      a_shape: (slots, rows, 64) of the gathered A stages (bf16, 128-byte rows).
      dtype: A's dtype.
      others: SMEM types laid out after A in the pipeline (e.g. the B stages).
      epilogue: SMEM types only used after the K loop (output tiles), overlaying the
        pipeline, so the pipeline can have one more stage than with separate buffers. A
        kernel must make sure every consumer is done with the pipeline before writing them.
      interpret: interpret mode does not alias `RefUnion` members and allows one-row slices
        of the wgmma tiling: there the copy and wgmma views are one ref and the epilogue has
        its own buffers.
      row_tiles: shapes `(..., rows, cols)` of epilogue tiles that registers in the wgmma
        layout write and TMA stores row-exactly (`row_tile_types`), laid out after
        `epilogue`, each with two views of the same bytes.

    Returns:
      (scratch type, views) with `views(ref) -> (a_copy, a_mma, others, epilogue)`: the A
      stages tiled (1, 64) for one-row TMA copies and (8, 64) for wgmma (same bytes, see
      `row_gather_buffers`), then tuples of refs for `others` and `epilogue`; with
      `row_tiles`, `epilogue` ends with one `(copy view, wgmma view)` pair per row tile.
    """
    others, epilogue = tuple(others), tuple(epilogue)
    copy_a, mma_a = _gather_view_types(a_shape, dtype)
    mma_group = (mma_a, *others)
    tile_views = [row_tile_types(shape, dtype) for shape in row_tiles]
    if interpret:
        def views(refs):
            (a, *rest), epi = refs
            epi = tuple(epi)
            pairs = tuple((t, t) for t in epi[len(epilogue):])
            return a, a, tuple(rest), epi[:len(epilogue)] + pairs

        return (mma_group, (*epilogue, *(m for _, m in tile_views))), views

    def views(refs):
        (a_copy, *_), (a_mma, *rest), epi, epi_copy = refs
        epi, epi_copy = tuple(epi), tuple(epi_copy)
        pairs = tuple(zip(epi_copy[len(epilogue):], epi[len(epilogue):]))
        return a_copy, a_mma, tuple(rest), epi[:len(epilogue)] + pairs

    return plgpu.RefUnion(
        (copy_a, *others), mma_group,
        (*epilogue, *(m for _, m in tile_views)), (*epilogue, *(c for c, _ in tile_views)),
    ), views


def group_spans(types) -> list[tuple[int, int]]:
    """Byte spans `[lo, hi)` of SMEM types laid out as Pallas lays out the members of a
    `RefUnion` group: in order, each starting `SMEM_ALIGNMENT`-aligned (what a kernel needs
    to know which pipeline bytes an overlaid epilogue buffer shares)."""
    spans, offset = [], 0
    for t in types:
        offset = -(-offset // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
        size = math.prod(t.shape) * jnp.dtype(t.dtype).itemsize
        spans.append((offset, offset + size))
        offset += size
    return spans


def row_tile_types(shape, dtype):
    """SMEM types `(copy view, wgmma view)` of an output tile `shape = (..., rows, cols)`
    that registers write in the wgmma layout and TMA stores row-exactly (`write_row_tile`,
    `store_row_tile`), laid out as `(..., cols // w, rows, w)` slabs of w = 128 bytes
    (64 bf16 or 32 f32 columns).

    An untiled `[rows, cols]` buffer takes the accumulator layout's stores with bank
    conflicts (a warp writes 8 rows of one column group, and every row starts in the same
    bank); a 128-byte-swizzled (8, w) tiling spreads them over all banks. TMA's row-exact
    ladder (boxes of 1..32 rows) needs a (1, w) tiling; for a 128-byte slab both tilings
    are row-major and swizzle by address, so they are two views of one buffer (as the
    gathered A stages, `row_gather_buffers`).
    """
    *lead, rows, cols = shape
    w = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    if cols % w:
        raise ValueError(f"row tiles of {jnp.dtype(dtype).name} need a multiple of {w} columns, got {cols}.")
    return _gather_view_types((*lead, cols // w, rows, w), dtype)


def row_tile_buffers(shape, dtype, interpret: bool):
    """A standalone `row_tile_types` buffer: (scratch type, fn(scratch) -> (copy view,
    wgmma view)), as `row_gather_buffers` for the gathered A stages."""
    return _two_view_buffer(*row_tile_types(shape, dtype), interpret)


def write_row_tile(mma_view, value, first_slab: int = 0) -> None:
    """Writes `value` [rows, cols] (registers, wgmma layout) into a `row_tile_types` tile,
    from its slab `first_slab` on (cols // w slabs; all of them by default)."""
    w = mma_view.shape[-1]
    for h in range(value.shape[-1] // w):
        mma_view[first_slab + h] = value[:, h * w:(h + 1) * w]


def store_row_tile(copy_view, dst_gmem, row0, num_rows, max_rows: int, src_row0=0) -> None:
    """`store_rows` of a `row_tile_types` tile: rows `[src_row0, src_row0 + num_rows)` of
    every slab h to `dst_gmem[row0 + i, w h : w (h + 1)]` (dst_gmem [P, cols])."""
    slabs, w = copy_view.shape[-3], copy_view.shape[-1]
    for h in range(slabs):
        store_rows(copy_view.at[h], dst_gmem.at[:, pl.ds(h * w, w)], row0, num_rows,
                   max_rows, src_row0=src_row0)


def gather_rows(
    src_ref, token_ids, dsts, barrier, *, col0, width: int, first_row, num_rows: int, unroll: int,
    negative_repeats: bool = False,
) -> None:
    """The fused token gather: one `[1, width]` TMA copy per row and column chunk.

    Hopper's TMA has no row gather, so row `r` (for `r` in `first_row + [0, num_rows)`) of
    each destination gets `src[token_ids[r], col0 + j*width : col0 + (j+1)*width]`, with
    `dsts[j]` the destination of chunk `j`. Every copy arrives on `barrier`.

    Args:
      src_ref: GMEM ref [T, cols] (X or dO).
      token_ids: SMEM ref of source tokens, indexed by row.
      dsts: SMEM refs, one per column chunk, each [rows, width] in a layout TMA can write.
      barrier: the barrier the copies complete on.
      col0: first source column (traced or static).
      width: columns per copy (64 = one 128-byte swizzle row of bf16).
      first_row: first row this caller issues (a warp's share, or 0).
      num_rows: rows this caller issues.
      unroll: unroll factor of the row loop.
      negative_repeats: ids may be negative, `-1 - t` for a padding row that copies row `t`
        (`decode_meta`'s encoding; a TMA copy per row must land all its bytes, so padding
        rows are loaded here, where `cp_async_gather_rows(zero_negative=True)` skips them).
    """

    def row_copy(i, carry):
        r = i if isinstance(first_row, int) and first_row == 0 else first_row + i
        tok = token_ids[r]
        if negative_repeats:
            tok = jnp.maximum(tok, -1 - tok)
        for j, dst in enumerate(dsts):
            plgpu.copy_gmem_to_smem(
                src_ref.at[pl.ds(tok, 1), pl.ds(col0 + j * width, width)],
                dst.at[pl.ds(r, 1)],
                barrier,
            )
        return carry

    jax.lax.fori_loop(0, num_rows, row_copy, None, unroll=unroll)


def aligned_max_tiles(capacity: int, num_experts: int, block_m: int) -> int:
    """`aligned_tile_meta`'s length: each expert adds at most one piece to the
    `ceil(capacity / block_m)` aligned blocks."""
    return -(-capacity // block_m) + num_experts


def aligned_tile_meta(group_sizes: jax.Array, capacity: int, block_m: int) -> TileMeta:
    """Row tiles that never cross a `block_m`-aligned row boundary nor an expert boundary.

    For kernels that load a contiguous, tiled A operand: Mosaic's tiled TMA needs row
    offsets that are multiples of the 8-row tile, so each tile loads the aligned box
    `[row_start // block_m * block_m, + block_m)` and keeps only its own rows. Tiles are the
    non-empty pieces of [0, sum(group_sizes)) cut at every multiple of block_m and every
    group offset, in row order: expert e's rows `[lo, hi)` are the
    `ceil(hi / bm) - floor(lo / bm)` pieces of the aligned blocks they touch. There are at
    most `ceil(capacity / block_m) + E` of them (the same bound as `tile_schedule`); the
    entries past the real ones have `num_rows == 0`, `row_start == sum(group_sizes)` and
    the last expert, and the kernels stop at the first of them
    (`num_real = sum(num_rows > 0)`). Computed once per plan, in closed form: no sort.
    """
    num_experts = group_sizes.shape[0]
    group_sizes = group_sizes.astype(jnp.int32)
    hi = jnp.cumsum(group_sizes, dtype=jnp.int32)  # [E]
    lo = hi - group_sizes
    total = hi[-1]
    first_block = lo // block_m  # [E]
    pieces = jnp.where(group_sizes > 0, (hi + block_m - 1) // block_m - first_block, 0)  # [E]
    piece_end = jnp.cumsum(pieces, dtype=jnp.int32)  # [E]
    num_tiles = aligned_max_tiles(capacity, num_experts, block_m)
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    expert = jnp.minimum(count_at_most(piece_end, tile), num_experts - 1)  # [nt]
    block = first_block[expert] + tile - (piece_end - pieces)[expert]  # aligned block index
    start = jnp.maximum(lo[expert], block * block_m)
    end = jnp.minimum(hi[expert], (block + 1) * block_m)
    is_real = tile < piece_end[-1]
    return TileMeta(
        expert=expert,
        row_start=jnp.where(is_real, start, total),
        num_rows=jnp.where(is_real, end - start, 0),
        row_ids=jnp.zeros((num_tiles, 1), jnp.int32),
        block_m=block_m,
    )


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["bounds"], meta_fields=["rows"]
)
@dataclasses.dataclass(frozen=True)
class TileChunks:
    """Consecutive ranges of an `aligned_tile_meta`'s real tiles, one kernel call per range.

    A kernel call for chunk c walks tiles `[bounds[0, c], bounds[0, c+1])` of the whole
    plan's metadata, reads A at the tiles' own grouped rows, and writes grouped row `g` to
    row `g - bounds[1, c]` of its own `[rows, N]` output. So no chunk needs a slice of A or
    metadata of its own, and its tiles are the whole call's tiles (the same bits).

    Attributes:
      bounds: i32[2, C+1]. Row 0: tile bounds (`bounds[0, C]` = the number of real tiles).
        Row 1: the grouped row where each chunk starts, each a tile's first row
        (`bounds[1, C]` = rows in all); chunk c holds at most `rows` rows.
      rows: static rows of each chunk's output buffer.
    """

    bounds: jax.Array
    rows: int

    @property
    def num_chunks(self) -> int:
        return self.bounds.shape[1] - 1


def tile_chunks(meta: TileMeta, row_bounds: jax.Array, rows: int) -> TileChunks:
    """`TileChunks` cutting `meta`'s tiles at the grouped rows `row_bounds`.

    Args:
      meta: `aligned_tile_meta` of the whole plan.
      row_bounds: i32[C+1] nondecreasing; chunk c is grouped rows `[row_bounds[c],
        row_bounds[c+1])`. Inner bounds must be tile boundaries (a `meta.block_m` multiple
        or an expert's first row), the last one the plan's row count, and no chunk longer
        than `rows`.
      rows: static rows of each chunk's output buffer.
    """
    if row_bounds.ndim != 1 or row_bounds.shape[0] < 2:
        raise ValueError(f"row_bounds must be i32[C+1] with C >= 1, got shape {tuple(row_bounds.shape)}.")
    real = meta.num_rows > 0
    num_real = jnp.sum(real, dtype=jnp.int32)
    # Real tiles come first, in row order: the tiles of chunk c start where rows reach its bound.
    starts = jnp.sum(
        real[None, :] & (meta.row_start[None, :] < row_bounds[:-1, None]), axis=1, dtype=jnp.int32
    )  # [C]
    tile_bounds = jnp.concatenate([starts, num_real[None]])
    return TileChunks(bounds=jnp.stack([tile_bounds, row_bounds.astype(jnp.int32)]), rows=rows)


def whole_tile_chunk(meta: TileMeta, rows: int) -> TileChunks:
    """One chunk over all of `meta`'s real tiles, written to a `[rows, N]` output."""
    ends = jnp.sum(jnp.stack([meta.num_rows > 0, meta.num_rows]), axis=1, dtype=jnp.int32)
    return TileChunks(bounds=jnp.stack([jnp.zeros((2,), jnp.int32), ends], axis=1), rows=rows)


def wave_chunk_bounds(
    meta: TileMeta, num_chunks: int, rows: int, *, items_per_tile: int, wave: int
) -> jax.Array:
    """i32[C+1] grouped-row bounds of `num_chunks` chunks that waste no persistent-kernel wave.

    A persistent kernel with `wave` CTAs takes `items_per_tile` work items per tile (its
    column blocks), and CTA s takes items s, s + wave, ...; a call of I items lasts about
    `ceil(I / wave)` item times (plus a fixed cost per call). The whole plan needs
    `Q = ceil(I / wave)` waves. Chunk c is given `floor(Q (c+1) / C) - floor(Q c / C)` whole
    waves and ends at the tile where they end (rounded down to a whole tile), so every chunk
    but the last holds at most its whole waves of items and never ends on a partial wave of
    its own; the last takes what is left. Together the chunks then run `Q` waves, or `Q + 1`
    when the items lost to the rounding outgrow the whole's idle slots in its last wave.
    A bound moves to a `block_m` multiple only where the chunks would not hold every row
    otherwise (at most `rows` each; `RowChunking.rows` leaves room for a wave of tiles).

    Args:
      meta: `aligned_tile_meta` of the whole plan (real tiles first, in row order).
      num_chunks: static C >= 1.
      rows: static rows of each chunk's buffer, a multiple of `meta.block_m`;
        `C * rows` must cover the plan's capacity.
      items_per_tile: work items per tile (the kernel's column blocks).
      wave: work items running at once (the kernel's CTAs).

    Returns:
      i32[C+1]: `[0, r_1, ..., r_{C-1}, total]`, nondecreasing; each inner bound is a tile's
      first row (a `block_m` multiple or an expert's first row).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}.")
    block_m = meta.block_m
    require_multiple("rows", rows, block_m, "the chunks' buffers hold whole row blocks")
    real = meta.num_rows > 0
    num_real = jnp.sum(real, dtype=jnp.int32)
    total = jnp.sum(meta.num_rows, dtype=jnp.int32)
    waves = (num_real * items_per_tile + wave - 1) // wave
    bounds = [jnp.int32(0)]
    first_tile, start = jnp.int32(0), jnp.int32(0)
    for c in range(1, num_chunks):
        own_waves = waves * c // num_chunks - waves * (c - 1) // num_chunks
        target = jnp.minimum(first_tile + own_waves * wave // items_per_tile, num_real)
        end = jnp.where(
            target < num_real, meta.row_start[jnp.minimum(target, meta.num_tiles - 1)], total
        )
        # Chunks c.. must hold the rows left, and this one at most `rows`. Both limits are
        # block_m multiples (tile boundaries), and the range between them is never empty:
        # by induction, ceil(total) - floor(start) <= (C - c + 1) * rows in block_m units.
        least = -(-total // block_m) * block_m - (num_chunks - c) * rows
        most = start // block_m * block_m + rows
        end = jnp.clip(end, least, most)
        first_tile = jnp.sum(real & (meta.row_start < end), dtype=jnp.int32)
        start = end
        bounds.append(end)
    bounds.append(total)
    return jnp.stack(bounds).astype(jnp.int32)

def store_rows(src_smem, dst_gmem, row0, num_rows, max_rows: int, src_row0=0) -> None:
    """TMA-stores rows `[0, num_rows)` of an untiled SMEM block to `dst_gmem[row0 + i]`.

    A TMA box has a static height, so the dynamic row count is written as a sum of powers
    of two (at most log2(max_rows) + 1 stores); rows of the block past `num_rows` are never
    written, so a tile never touches rows that belong to another expert's tiles.

    Args:
      src_smem: SMEM ref [max_rows, cols] (no tiling/swizzle).
      dst_gmem: GMEM ref [rows, cols], already sliced to the destination columns.
      row0: i32 first destination row.
      num_rows: i32 number of rows to store, in [0, max_rows].
      max_rows: static block height.
      src_row0: first SMEM row to store (rows `[src_row0, src_row0 + num_rows)`).
    """
    start = jnp.int32(0)
    size = 1 << (max_rows.bit_length() - 1)
    while size >= 1:
        this = size

        @pl.when((num_rows & this) != 0)
        def _():
            plgpu.copy_smem_to_gmem(
                src_smem.at[pl.ds(src_row0 + start, this)],
                dst_gmem.at[pl.ds(row0 + start, this)],
            )

        start = start + (num_rows & this)
        size //= 2


# --- The cp.async row gather (compiled kernels only; interpret mode uses `gather_rows`) ---
#
# Hopper's TMA cannot gather rows, and one TMA copy per 128-byte row chunk costs the issuing
# warp dozens of cycles plus an mbarrier update per lane. Instead all 128 threads of the
# producer warpgroup issue 16-byte `cp.async` loads straight into the 128-byte-swizzled SMEM
# layout that wgmma reads: 8 threads per 128-byte row (64 bf16 or 128 e4m3 columns), 16 rows
# per pass. A stage's
# loads form one cp.async group. `cp_async_stage_done` later waits until at most `pending`
# newer groups are in flight, and fences them for the async proxy (wgmma); the caller then
# arrives on the stage barrier from every producer thread (`plgpu.barrier_arrive` in Lane
# semantics counts 128 thread arrivals as one).

CP_ASYNC_BYTES = 16
CP_ASYNC_ROW_THREADS = SWIZZLE_BYTES // CP_ASYNC_BYTES  # 8 threads load one 128-byte row


def _mlir_int_types():
    """(i32, i64, i8, index) MLIR types, for the kernels' inline Mosaic GPU code."""
    from jax._src.lib.mlir import ir

    return (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
            ir.IntegerType.get_signless(8), ir.IndexType.get())


def cp_async_gather_rows(src_ref, token_ids, dsts, *, num_rows: int,
                         zero_negative: bool = False) -> None:
    """Issues `dsts[j][r, :] = src[token_ids[r], c*j : c*(j+1)]` for r < num_rows, as one
    cp.async group, with `c` the elements of one 128-byte row (64 bf16, 128 e4m3). Called by
    a whole (producer) warpgroup in Lane semantics.

    With `zero_negative`, rows whose id is negative (padding, see `decode_meta`) are
    zero-filled: their copies read 0 source bytes (from row 0's address) and touch no
    memory. Why: a tile of a small batch is mostly padding, and padding rows that all read
    the tile's last real row send every SM's copies to the same few L2 lines (session 32,
    H200: the decode megakernel's up tasks at T = 1 took 36 us with the gather, 17 without).

    Args:
      src_ref: GMEM ref [T, c * len(dsts)] bf16 or e4m3, a column window of X, dO or the
        quantized tokens (`x.at[:, pl.ds(col0, c * len(dsts))]`); rows may have any stride.
      token_ids: SMEM ref i32 [>= num_rows], the source row of each destination row.
      dsts: SMEM refs [num_rows, c] of src's dtype (pipeline slots) with `mma_transforms`
        (tiled (8, c), 128-byte swizzle: row r at `128 * r`, its 16-byte chunk k at
        `(k ^ (r % 8)) * 16`, the same bytes for every dtype; each slot starts 1024-byte
        aligned).
      num_rows: static rows to load, a multiple of 16.
    """
    from jax._src.lib.mlir.dialects import arith, memref

    def source(row, ids):  # (source row as i64, bytes to copy: all, or 0 for padding)
        i32, i64, _, index = _mlir_int_types()
        token = memref.load(ids, [arith.index_cast(index, row)])
        if not zero_negative:
            return arith.extui(i64, token), None
        zero = arith.constant(i32, 0)
        valid = arith.cmpi(arith.CmpIPredicate.sge, token, zero)
        size = arith.select(valid, arith.constant(i32, CP_ASYNC_BYTES), zero)
        return arith.extui(i64, arith.select(valid, token, zero)), size

    _cp_async_rows(src_ref, token_ids, dsts, num_rows, source)


def cp_async_load_rows(src_ref, dsts, row_count) -> None:
    """Issues `dsts[j][r, :] = src[r, c*j : c*(j+1)]` for the rows r < `row_count[0]` and
    zero-fills the rest (their cp.async copies 0 source bytes and reads nothing), as one
    cp.async group, `c` as in `cp_async_gather_rows`. Called by a whole warpgroup in Lane
    semantics; it waits for nothing (`cp_async_stage_done`, then a warpgroup barrier such
    as `plgpu.commit_smem`, before any thread reads rows another thread loaded).

    What it is for: rows of a tile whose TMA boxes would be the row-exact ladder of
    `load_rows`, straight into the 128-byte-swizzled layout whose register reads are free
    of bank conflicts, without the TMA unit (which the kernel's producer keeps busy).

    Args:
      src_ref: GMEM ref [R, c * len(dsts)] starting at the tile's first row (rows past
        `row_count[0]` may lie past the array's end: they are not read).
      dsts: SMEM refs [R, c] with `mma_transforms`, as in `cp_async_gather_rows`; R is a
        multiple of 16.
      row_count: ref i32 [1] (GMEM or SMEM): the rows to load, in [1, R].
    """
    from jax._src.lib.mlir.dialects import arith, memref

    def source(row, count_ref):  # rows past the count: the first row's address, 0 bytes
        i32, i64, _, index = _mlir_int_types()
        count = memref.load(count_ref, [arith.constant(index, 0)])
        valid = arith.cmpi(arith.CmpIPredicate.slt, row, count)
        src_row = arith.select(valid, row, arith.constant(i32, 0))
        size = arith.select(valid, arith.constant(i32, CP_ASYNC_BYTES), arith.constant(i32, 0))
        return arith.extui(i64, src_row), size

    _cp_async_rows(src_ref, row_count, dsts, tuple(dsts)[0].shape[0], source)


def _cp_async_rows(src_ref, index_ref, dsts, num_rows: int, source) -> None:
    """The 16-byte cp.async loads of `cp_async_gather_rows` / `cp_async_load_rows`: thread
    t of the warpgroup copies chunk `t % 8` of rows `t // 8 + 16 p`, row r's source row and
    byte count given by `source(r, index_ref) -> (i64 row, i32 bytes or None for all 16)`."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, llvm, nvvm

    rows_per_pass = 128 // CP_ASYNC_ROW_THREADS
    if num_rows % rows_per_pass:
        raise ValueError(f"num_rows={num_rows} must be a multiple of {rows_per_pass}.")
    dsts = tuple(dsts)
    dtype = jnp.dtype(dsts[0].dtype)
    itemsize = dtype.itemsize
    dst_type = plgpu.RefType(transforms=mma_transforms(dtype))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), (dst_type,) * len(dsts)))
    def _issue(ctx, src, index, dst_refs):
        del ctx
        utils = mgpu.utils
        i32, i64, i8, _ = _mlir_int_types()
        src_ty = ir.MemRefType(src.type)
        (row_stride, col_stride), _ = src_ty.get_strides_and_offset()
        if col_stride != 1 or src_ty.shape[-1] * itemsize != SWIZZLE_BYTES * len(dst_refs):
            raise ValueError(
                f"src must be a contiguous window of one 128-byte row per dst, got {src_ty}."
            )
        tid = arith.remui(utils.thread_idx(), utils.c(128, i32))  # thread in the warpgroup
        chunk = arith.remui(tid, utils.c(CP_ASYNC_ROW_THREADS, i32))  # 16-byte chunk of a row
        row_in_pass = arith.divui(tid, utils.c(CP_ASYNC_ROW_THREADS, i32))
        # Passes step by 16 rows, so `r % 8 == row_in_pass % 8` in every pass.
        swizzled = arith.xori(chunk, arith.andi(row_in_pass, utils.c(7, i32)))
        dst_offset = arith.addi(
            arith.muli(row_in_pass, utils.c(SWIZZLE_BYTES, i32)),
            arith.muli(swizzled, utils.c(CP_ASYNC_BYTES, i32)),
        )
        dst_bases = [utils.getelementptr(utils.memref_ptr(d), [dst_offset], i8) for d in dst_refs]
        src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1), utils.memref_ptr(src))
        src_base = utils.getelementptr(
            src_base, [arith.muli(chunk, utils.c(CP_ASYNC_BYTES, i32))], i8
        )

        def source_row(p):  # (source row address, bytes) of pass p
            row = arith.addi(row_in_pass, utils.c(p * rows_per_pass, i32))
            src_index, size = source(row, index)
            return utils.getelementptr(
                src_base, [arith.muli(src_index, utils.c(row_stride * itemsize, i64))], i8
            ), size

        # Every pass's source row (an SMEM id load each) and address first, then the copies:
        # no copy's address waits on a load issued just before it, and no address register
        # is rewritten while an earlier copy still reads it (ptxas then stalls the producer
        # until the LSU has taken that copy). Session 27, H200, bitwise: the up-proj
        # 1.03-1.07x, dH 1.04x, dW1 1.07x, dW2 1.04x at 7B; the up-proj 1.05x at 30B.
        sources = [source_row(p) for p in range(num_rows // rows_per_pass)]
        for p, (src_row, size) in enumerate(sources):
            for j, dst_base in enumerate(dst_bases):
                nvvm.cp_async_shared_global(
                    utils.getelementptr(dst_base, [p * rows_per_pass * SWIZZLE_BYTES], i8),
                    utils.getelementptr(src_row, [j * SWIZZLE_BYTES], i8),
                    CP_ASYNC_BYTES,
                    nvvm.LoadCacheModifierKind.CG,
                    cp_size=size,
                )
        nvvm.cp_async_commit_group()

    _issue(src_ref, index_ref, dsts)


def cp_async_publish(ki, full, landed, stages: int) -> None:
    """After issuing step `ki`'s cp.async group, publish it the kernel's way
    (`config.gather_completion`): with per-slot mbarriers (`landed` = [the
    `cp_async_stage_barriers` ref]) every producer thread arrives on its slot's mbarrier
    when its loads land; without (`landed` = []) step `ki - (stages - 2)` is published on
    `full` (`cp_async_publish_lagged`).

    `full` is the stages' barrier array (step j arrives on `full.at[j % stages]`) or a
    function `step -> barrier ref`, for kernels whose consumers wait on separate barrier
    sets (the ping-pong up-proj: one per consumer)."""
    if landed:
        cp_async_stage_arrive(landed[0].at[ki % stages])
    else:
        cp_async_publish_lagged(ki, stages - 2, full, stages)


def cp_async_publish_rest(num_k, full, landed, stages: int) -> None:
    """After the last of `num_k` steps (static or traced, >= 1): publish the steps the
    lagged publish still holds; nothing with per-slot mbarriers (see `cp_async_publish`)."""
    if landed:
        return
    if isinstance(num_k, int):
        cp_async_publish_tail(num_k, stages - 2, full, stages)
    else:
        cp_async_publish_tail_dynamic(num_k, stages - 2, full, stages)


def pingpong_full_barrier(full, step, num_k: int, stages: int, consumers: int = 2):
    """The `full` barrier of global step `step` in a ping-pong ring whose consumers take
    every `consumers`-th item of `num_k` steps in turn: consumer c waits only on its own set
    `full[c * stages : (c + 1) * stages]` (each consumer waits on every phase of its own
    barriers, which is how Pallas tracks phases)."""
    return full.at[((step // num_k) % consumers) * stages + step % stages]


def pingpong_producer_drain(total, full_of, empty, landed, stages: int, cp_async: bool):
    """A persistent producer's end, after issuing `total` (traced) steps: publish the steps
    the lagged cp.async publish still holds, then observe the last release of every slot
    used in the last `stages` steps, so that no barrier phase is left unconsumed."""
    if cp_async:
        @pl.when(total > 0)
        def _():
            cp_async_publish_rest(total, full_of, landed, stages)

    for slot in range(stages):
        @pl.when(total > slot)
        def _(slot=slot):
            plgpu.barrier_wait(empty.at[slot])


WGMMA_LAGS = (0, 1)


def require_wgmma_lag(config) -> None:
    """A grouped-GEMM config's `wgmma_lag` is one of `WGMMA_LAGS` (see `consumer_k_loop`)."""
    if config.wgmma_lag not in WGMMA_LAGS:
        raise ValueError(f"config.wgmma_lag={config.wgmma_lag} must be one of {WGMMA_LAGS}.")


def consumer_k_loop(num_k, stages: int, wait, mma, empty, *, mmas_per_step: int,
                    step_of=None, wgmma_lag: int = 1) -> None:
    """A consumer warpgroup's K loop over a `stages`-slot ring (the one the kernels share).

    Step ki is the pipeline's global step g = `step_of(ki)` (g = ki without `step_of`; a
    persistent kernel's steps run on across its items) in slot g % stages: `wait(g, slot)`
    waits until it landed, `mma(slot)` issues `mmas_per_step` wgmmas reading it, and then:

    - `wgmma_lag=1` (default): once step g - 1's wgmmas are done (`wgmma_wait(
      mmas_per_step)`) its slot is released on `empty`. Step g's wgmmas run on while the
      consumer waits for step g + 1, so the tensor cores never idle on the wait, but the
      consumer holds two slots: `stages - 2` of them load at a time.
    - `wgmma_lag=0`: once step g's own wgmmas are done (`wgmma_wait(0)`) its slot is
      released at once, so `stages - 1` slots load while one is multiplied; the tensor
      cores idle from the last wgmma's end to the next step's issue unless another
      consumer's wgmmas fill the gap.

    Returns with every wgmma finished and the last step's slot still held: the caller
    releases it (or the producer observes it).

    Interpret mode runs a wgmma to completion when it is issued, so its race detector
    checks the barrier protocol (a slot released twice or never fails there), not whether
    a slot was released before the wgmmas reading it finished: only the GPU tests
    (poisoned outputs, bitwise the default) can see that."""
    if wgmma_lag not in WGMMA_LAGS:
        raise ValueError(f"wgmma_lag={wgmma_lag} must be one of {WGMMA_LAGS}.")

    def step(ki, carry):
        g = ki if step_of is None else step_of(ki)
        slot = g % stages
        wait(g, slot)
        mma(slot)
        if wgmma_lag:
            plgpu.wgmma_wait(mmas_per_step)  # step g - 1 is done: release its slot

            @pl.when(ki >= 1)
            def _():
                plgpu.barrier_arrive(empty.at[(g - 1) % stages])
        else:
            plgpu.wgmma_wait(0)  # step g is done: release its slot (the last one: the caller)

            @pl.when(ki < num_k - 1)
            def _():
                plgpu.barrier_arrive(empty.at[slot])

        return carry

    jax.lax.fori_loop(0, num_k, step, None)
    plgpu.wgmma_wait(0)


def cp_async_consumer_wait(ki, landed, stages: int) -> None:
    """Consumer, after waiting on step `ki`'s `full` slot: with per-slot mbarriers also wait
    for its cp.async rows (`cp_async_stage_wait`); the lagged publish needs nothing more."""
    if landed:
        cp_async_stage_wait(landed[0], ki, stages)


def cp_async_publish_lagged(ki, lag: int, full, stages: int) -> None:
    """After issuing step `ki`'s cp.async group: publish step `ki - lag` on its `full` slot.

    Every producer thread waits for its own loads of that step, fences them for the async
    proxy and arrives (128 thread arrivals = one Pallas arrival in Lane semantics). A
    consumer releases step j only while waiting on step j + 2, so `lag <= stages - 2` keeps
    the producer from waiting on a slot the consumers cannot free yet.
    """

    @pl.when(ki >= lag)
    def _():
        cp_async_stage_done(lag)
        plgpu.barrier_arrive(_step_barrier(full, ki - lag, stages))


def cp_async_publish_tail(num_k: int, lag: int, full, stages: int) -> None:
    """After the last step (static `num_k`): publish the `lag` steps still in flight."""
    tail = range(max(num_k - lag, 0), num_k)
    for i, step in enumerate(tail):
        cp_async_stage_done(len(tail) - 1 - i)
        plgpu.barrier_arrive(_step_barrier(full, step, stages))


def cp_async_publish_tail_dynamic(num_k, lag: int, full, stages: int) -> None:
    """`cp_async_publish_tail` for a traced `num_k` (>= 1)."""
    for i in range(lag):  # step num_k - lag + i, if it exists
        step = num_k - lag + i

        @pl.when(step >= 0)
        def _(step=step, i=i):
            cp_async_stage_done(lag - 1 - i)
            plgpu.barrier_arrive(_step_barrier(full, step, stages))


def _step_barrier(full, step, stages: int):
    """The barrier step `step` is published on: `full(step)` if `full` is a function (see
    `cp_async_publish`), else `full.at[step % stages]`."""
    return full(step) if callable(full) else full.at[step % stages]


def cp_async_stage_done(pending: int) -> None:
    """Waits for this thread's cp.async groups but the newest `pending`, then fences them
    for the async proxy, so an arrive that follows publishes them to wgmma."""
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def _wait(ctx):
        del ctx
        nvvm.cp_async_wait_group(pending)
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    _wait()


# --- Hardware-tracked cp.async stages (`gather_completion="mbarrier"`) ---
#
# Pallas does not hand its barriers' addresses to `inline_mgpu`, so the kernels keep one
# extra mbarrier per pipeline slot in SMEM and drive it with NVVM ops: initialised once for
# CP_ASYNC_THREADS arrivals per phase, each producer thread arrives on it with
# `cp.async.mbarrier.arrive.noinc` right after issuing its loads (the arrival happens when
# they land), and the consumers wait on its phase parity, then fence the async proxy so
# their wgmma reads see the generic-proxy cp.async writes.

CP_ASYNC_THREADS = 128  # the producer warpgroup's threads, each arriving once per stage
_MBARRIER_BYTES = 8


def cp_async_stage_barriers(stages: int):
    """SMEM type of one mbarrier per pipeline slot (8 bytes each, as int32 pairs)."""
    return plgpu.SMEM((stages, _MBARRIER_BYTES // 4), jnp.int32)


def cp_async_stage_barriers_init(bars) -> None:
    """Initialises every slot's mbarrier for CP_ASYNC_THREADS arrivals. Call once at the top
    of the kernel body from every thread of the CTA (it ends with a CTA-wide barrier, so the
    init is visible before any producer arrives or consumer waits)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import gpu, nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _init(ctx, ref):
        del ctx
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        i8 = ir.IntegerType.get_signless(8)
        stages = ir.MemRefType(ref.type).shape[0]
        base = utils.memref_ptr(ref)
        one_thread = utils.single_thread_predicate(utils.ThreadSubset.BLOCK)
        for s in range(stages):
            nvvm.mbarrier_init(
                utils.getelementptr(base, [s * _MBARRIER_BYTES], i8),
                utils.c(CP_ASYNC_THREADS, i32),
                predicate=one_thread,
            )
        gpu.barrier()

    _init(bars)


def cp_async_stage_arrive(bar) -> None:
    """Producer thread: the slot's mbarrier (`bars.at[slot]`) gets this thread's arrival
    once all its cp.async loads issued so far have landed. Does not wait."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir.dialects import nvvm

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _arrive(ctx, ref):
        del ctx
        nvvm.cp_async_mbarrier_arrive(mgpu.utils.memref_ptr(ref), noinc=True)

    _arrive(bar)


def cp_async_stage_wait(bars, ki, stages: int) -> None:
    """Consumer: waits until step `ki`'s rows landed in slot `ki % stages`, then fences
    the async proxy. Phase parity of step ki is `(ki // stages) % 2`; the producer is never
    more than `stages` steps ahead (it waits on `empty`), so the parity is unambiguous."""
    cp_async_stage_wait_parity(bars.at[ki % stages], (ki // stages) % 2)


def cp_async_stage_wait_parity(bar, parity) -> None:
    """Consumer: waits for the phase of one slot's mbarrier (`bars.at[slot]`) with the given
    parity (traced 0 or 1: the slot's uses so far, mod 2), then fences the async proxy so
    wgmma sees the generic-proxy cp.async writes. `cp_async_stage_wait`'s body, kept apart
    (the jaxprs name it) since the persistent dH, whose slot order restarted per item, passed
    its own parity (its hardware-tracked stages were removed in session 64)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, nvvm

    def waiter(parity: int):
        @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
        def _wait(ctx, ref):
            del ctx
            utils = mgpu.utils
            i32 = ir.IntegerType.get_signless(32)
            nvvm.mbarrier_try_wait_parity(
                utils.memref_ptr(ref), utils.c(parity, i32), arith.constant(i32, 10000000)
            )
            nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

        return _wait

    @pl.when(parity == 0)
    def _():
        waiter(0)(bar)

    @pl.when(parity == 1)
    def _():
        waiter(1)(bar)
