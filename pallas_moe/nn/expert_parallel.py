"""Expert parallelism (EP) for `pallas_moe.nn.MoE` with `jax.shard_map`.

Layout. Experts are sharded over one mesh axis (`ExpertParallel.axis`, size G): shard g
holds experts `[g*E/G, (g+1)*E/G)` of `w_gate_up [E, d, 2n]` and `w_down [E, n, d]`.
Tokens are sharded over `token_axes` (default: every mesh axis, so data-parallel axes and
the expert axis together split the batch). The router and the selection bias are
replicated. Every shard routes its own tokens over all E experts; dispatch and combine
move rows to the shards that own the experts, where the same `pm.moe_ffn` (the Pallas
kernels on GPU) runs on the local experts only.

Dispatch modes:

* `"all_gather"`: all-gather the tokens of the expert-parallel group (`[G*T_l, d]`) and
  all-to-all the routing columns of each shard's experts; every shard builds a plan over
  all the group's tokens for its local experts, runs `moe_ffn` and `psum_scatter`s the
  partial outputs back. Each shard moves `~2 * T_l*G * d` elements (gather + reduce-scatter)
  whatever the routing, and the gathered tokens are an all-gather XLA overlaps well. It
  wins at small EP (G=2..4), large K relative to G (`K >= G`: about every token is needed
  on every shard anyway), and small T. It runs on every backend, CPU included.
* `"ragged_all_to_all"`: each shard gathers its routed rows (`[T_l*K, d]`, grouped by
  expert, hence by destination shard) and sends each destination only its rows with
  `jax.lax.ragged_all_to_all`; the receiver runs `moe_ffn` over the received rows
  (regrouped by local expert), and a second ragged all-to-all returns the expert outputs,
  which the source combines with the router weights in fp32. Each shard moves
  `~2 * T_l*K * d * (G-1)/G` elements, only the routed rows: it wins when `K < G` and at
  scale (large T, many shards). XLA:CPU has no ragged all-to-all; use a GPU or TPU.
  Its receive buffer is static: worst case `G * T_l * min(K, E/G)` rows by default
  (exact, never drops), or `capacity_factor * T_l * K` rows; rows past a receiver's
  capacity are dropped (lower source shards first served) and counted in
  `aux["capacity_dropped_rows"]`.
* `"emulated_ragged_all_to_all"`: the ragged path with the collective emulated by an
  all-gather (moves G times the bytes). It exists to test the ragged bookkeeping on CPU.

Token rounding across shards. Rounding is per expert over the *global* batch: each shard
computes its top-K choices, counts are `psum`med over the token shards, and every shard
rounds the same global counts (the same PRNG key for "stochastic"). An expert then keeps
or adds rows by a global ranking (top-K rows first, each part by router score, ties by
global token index). An expert deviates by less than one tile, so only the best `tile`
candidates of each shard can matter: shards all-gather those (`[E, tile]` scores per
shard), find the global threshold per expert, and select their own rows against it. The
result equals single-device token rounding over the whole batch exactly (same plan rows),
whatever the layout.

Aux terms are computed from sums over tokens that are `psum`med over the token shards, so
`aux` equals the single-device module's; outputs and gradients equal it up to summation
order (the all-gather path sums expert partials across shards in the compute dtype).

Overlap (single-batch overlap; docs/ep_overlap.md):

* Shared experts: the shared MLP runs on each shard's tokens inside the same `shard_map`
  body as the dispatch and depends on nothing it receives, so XLA runs it while the
  dispatch collective is in flight.
* `overlap="chunked"`, ragged dispatches: the received rows, grouped by local expert, go
  through the down-proj in chunks cut at its row tiles, by work
  (`pallas_moe.ops.row_chunks`); each chunk's combine is its own ragged exchange, free to
  run while the next chunk's down-proj computes. All-gather dispatch: the shard's tokens
  go in chunks, each with its own all-gather, local experts and reduce-scatter, so a
  chunk's reduce-scatter is free to run while the next chunk's experts compute. Equal to
  `overlap="none"` in outputs and gradients.
* `overlap="signal"` (a down-proj kernel that signals per `block_m` rows and sends finished
  blocks to their sources) is not built; the doc says what JAX 0.11.2's Mosaic GPU offers
  for it (remote refs, remote semaphores) and why.

`pallas_moe.nn.overlap_check.ep_overlap_report` reads both overlaps from a compiled module.
Every exchange goes through `ragged_exchange`, whose VJP is the reverse exchange built
from the same `[sender, receiver]` tables. The layer runs unchanged across processes
(`jax.distributed`): give it a mesh over all processes' devices and global arrays.

Numerics (`pm.Numerics`). The ragged dispatch returns each routed row's expert output `Y`
to its source, which sums a token's rows in ascending expert order in the aggregation
mode's rounding order (`ops.xla.aggregate_rows`), exactly as the single-device layer does:
its forward is bitwise the single-device one whenever the expert GEMMs give each row the
same bits whatever rows share its tile (true of the `xla` backend on CPU). The all-gather
dispatch sums each shard's local experts, rounds that partial to the compute dtype, and
reduce-scatters the partials: in "fp32" that adds roundings, and in the bf16 modes it
re-associates a token's sum once a shard after the token's first holds two or more of its
rows, so it is not bitwise across EP sizes in general.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_moe import _checks
from pallas_moe._vma import vary, vary_together, varying_axes
from pallas_moe._xla_flags import add_xla_flag, has_xla_flag
from pallas_moe.nn import functional as F
from pallas_moe.numerics import Numerics
from pallas_moe.ops.activation import SwiGLU
from pallas_moe.ops.moe_ffn import moe_ffn, resolve_backend
from pallas_moe.ops.row_chunks import RowChunking, auto_num_chunks, chunked_row_ffn, down_proj_scope
from pallas_moe.ops.xla import aggregate_rows
from pallas_moe.routing.plan import plan_from_assignment
from pallas_moe.routing.token_rounding import rounded_counts
from pallas_moe.routing.topk import check_router_inputs, router_probabilities, topk_assignment

# XLA's default GPU `ragged_all_to_all` is a one-shot kernel that moved about 5 GB/s per GPU
# on two H200s (each GPU sending 134 MB: 49.9 ms; 537 MB: 197 ms), where a dense
# `all_to_all` of the same arrays took 0.82 / 1.99 ms. Its decomposer (this flag) took
# 1.79 / 5.43 ms (benchmarks/RESULTS.md, session 34). XLA reads its flags once, when the
# GPU backend starts.
RAGGED_ALL_TO_ALL_GPU_FLAG = "--xla_gpu_unsupported_enable_ragged_all_to_all_decomposer=true"


def use_fast_ragged_all_to_all() -> None:
    """Adds `RAGGED_ALL_TO_ALL_GPU_FLAG` to the XLA_FLAGS environment variable, unless it
    sets that flag already (`pallas_moe._xla_flags.add_xla_flag`).

    Call it before JAX starts its GPU backend (before the first `jax.devices()` or
    computation): `dispatch="ragged_all_to_all"` on GPUs is 30-100x slower without it.
    `python -m train.main` and `benchmarks/ep.py` call it for the ragged dispatch.

    Raises RuntimeError if XLA_FLAGS lacks the flag and JAX has already started its
    backends (XLA would ignore it; `add_xla_flag`). Set it in the environment instead, or
    call this before anything touches `jax.devices()`.
    """
    add_xla_flag(RAGGED_ALL_TO_ALL_GPU_FLAG)


def warn_if_slow_ragged_all_to_all(platform: str) -> None:
    """Warns when the ragged dispatch would run XLA's slow default GPU collective (XLA_FLAGS
    does not choose the decomposer, on or off)."""
    if platform == "gpu" and not has_xla_flag(RAGGED_ALL_TO_ALL_GPU_FLAG):
        warnings.warn(
            "dispatch='ragged_all_to_all' on GPUs: XLA's default ragged_all_to_all moved about "
            "5 GB/s per GPU on H200s (30-100x slower than its decomposer). Set XLA_FLAGS="
            f"{RAGGED_ALL_TO_ALL_GPU_FLAG} before JAX starts (pm.nn.use_fast_ragged_all_to_all()), "
            "or use dispatch='all_gather' (fewer bytes whenever top_k >= the EP size).",
            stacklevel=3,
        )


DISPATCHES = ("all_gather", "ragged_all_to_all", "emulated_ragged_all_to_all")
OVERLAPS = ("none", "chunked")
# Named scopes the schedule checks (`pallas_moe.nn.schedule`) find ops by.
SHARED_SCOPE = "shared_experts"
DISPATCH_SCOPE = "ep_dispatch"


def combine_scope(chunk: int) -> str:
    return f"ep_combine_chunk{chunk}"


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """How to shard a `MoE` layer's experts over a mesh.

    Attributes:
      mesh: a `jax.sharding.Mesh` holding `axis`.
      axis: mesh axis the experts are sharded over (size G; `num_experts % G == 0`).
      dispatch: "all_gather", "ragged_all_to_all" (GPU/TPU) or "emulated_ragged_all_to_all"
        (testing); see the module docstring for when each wins.
      token_axes: mesh axes the token dimension is sharded over, major to minor; must
        include `axis`. Default: every axis of the mesh, in mesh order.
      capacity_factor: ragged dispatch only; receive buffer of `capacity_factor * T_l * K`
        rows per shard (None: the exact worst case, never drops).
      overlap: how the experts' compute meets the combine. "none": all the experts, then
        one combine. "chunked", ragged dispatches: the received rows, grouped by local
        expert, are cut into `num_chunks` chunks at row tiles; each chunk's down-proj is
        followed by its own ragged combine, which XLA can run while the next chunk's
        down-proj computes. "chunked", all_gather dispatch: the shard's tokens are cut
        into `num_chunks` chunks, each all-gathered, run through the local experts and
        reduce-scattered on its own, so XLA can run chunk c's reduce-scatter while chunk
        c+1's experts compute. Outputs and gradients equal "none". ("signal", a down-proj
        kernel that sends finished blocks itself, is not built: see the module docstring.)
      num_chunks: chunks of the "chunked" overlap (at most; fewer when there are fewer
        `block_m` row blocks, or tokens), or "auto": `pallas_moe.ops.row_chunks.auto_num_chunks`
        picks it from the down-proj work a shard holds on average (`T_l * K` rows), one
        more chunk per 70 GFLOP, so each extra chunk's fixed cost stays under 5% of the
        down-proj. The ragged dispatches cut by work, in whole waves of the persistent
        down-proj kernel (`RowChunking`), not by the receive buffer's rows.
      check_vma: `jax.shard_map`'s varying-manual-axes type check of the per-shard body.
        Off by default (values are the same either way). It works with backend="xla" (the
        scans cast their carries with `jax.lax.pcast`); the Pallas kernels cannot run under
        it in JAX 0.11.2 (`plgpu.kernel` rejects varying inputs), which raises.

    `backend="interpret"` (the kernels in Mosaic GPU's interpreter) runs on a one-device
    mesh only; over several devices it raises (the interpreter's per-device state does not
    survive shard_map's concurrent devices). Test EP on CPU with `backend="xla"`.
    """

    mesh: jax.sharding.Mesh
    axis: str = "expert"
    dispatch: str = "all_gather"
    token_axes: tuple[str, ...] | None = None
    capacity_factor: float | None = None
    overlap: str = "none"
    num_chunks: int | str = 2
    check_vma: bool = False

    def __post_init__(self):
        if not isinstance(self.mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(self.mesh).__name__}.")
        if self.axis not in self.mesh.axis_names:
            raise ValueError(
                f"axis={self.axis!r} is not an axis of the mesh (axes {self.mesh.axis_names})."
            )
        _checks.check_choice("dispatch", self.dispatch, DISPATCHES)
        token_axes = self.mesh.axis_names if self.token_axes is None else self.token_axes
        if isinstance(token_axes, str):
            token_axes = (token_axes,)
        token_axes = tuple(token_axes)
        for name in token_axes:
            if name not in self.mesh.axis_names:
                raise ValueError(
                    f"token_axes names {name!r}, which is not an axis of the mesh "
                    f"(axes {self.mesh.axis_names})."
                )
        if self.axis not in token_axes:
            raise ValueError(
                f"token_axes={token_axes} must include the expert axis {self.axis!r}: each "
                "expert shard routes its own tokens."
            )
        if len(set(token_axes)) != len(token_axes):
            raise ValueError(f"token_axes has a repeated axis: {token_axes}.")
        object.__setattr__(self, "token_axes", token_axes)
        if self.capacity_factor is not None:
            if self.dispatch == "all_gather":
                raise ValueError("capacity_factor applies to the ragged dispatch only, not 'all_gather'.")
            if not isinstance(self.capacity_factor, (int, float)) or self.capacity_factor <= 0:
                raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor!r}.")
        if self.overlap == "signal":
            raise ValueError(
                "overlap='signal' (a down-proj kernel that signals per block_m rows and sends "
                f"finished blocks to their source shards) is not available in JAX {jax.__version__}: "
                "its Mosaic GPU interpret mode has no remote refs or semaphores, and on one GPU "
                "or across processes they need NVSHMEM, which this jaxlib cannot turn on, so "
                "the kernel could not be tested (docs/ep_overlap.md, section 6). Use "
                "overlap='chunked': the same down-proj/combine overlap at block_m-chunk "
                "granularity."
            )
        _checks.check_choice("overlap", self.overlap, OVERLAPS)
        if isinstance(self.num_chunks, str) and self.num_chunks != "auto":
            raise ValueError(f"num_chunks must be a positive int or 'auto', got {self.num_chunks!r}.")
        if self.num_chunks != "auto":
            _checks.check_positive_int("num_chunks", self.num_chunks)
        if not isinstance(self.check_vma, bool):
            raise TypeError(f"check_vma must be a bool, got {type(self.check_vma).__name__}.")
        if self.dispatch == "ragged_all_to_all":
            platform = self.mesh.devices.flat[0].platform
            if platform == "cpu":
                raise ValueError(
                    "dispatch='ragged_all_to_all' needs a GPU or TPU mesh: XLA:CPU has no "
                    "ragged_all_to_all. Use dispatch='all_gather' (or "
                    "'emulated_ragged_all_to_all' to test the ragged path) on CPU."
                )
            warn_if_slow_ragged_all_to_all(platform)

    @property
    def size(self) -> int:
        """G, the number of expert shards."""
        return self.mesh.shape[self.axis]

    @property
    def num_token_shards(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.token_axes)

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.size:
            raise ValueError(
                f"num_experts={num_experts} must be divisible by the size {self.size} of the "
                f"expert mesh axis {self.axis!r}."
            )

    def receive_capacity(self, cfg: F.RouterConfig, tokens_per_shard: int) -> int:
        """Static rows of a shard's receive buffer in the ragged dispatch."""
        local_experts = cfg.num_experts // self.size
        worst = self.size * cfg.capacity(tokens_per_shard, local_experts)
        if self.capacity_factor is None:
            return worst
        wanted = math.ceil(self.capacity_factor * tokens_per_shard * cfg.top_k)
        return min(worst, max(8, -(-wanted // 8) * 8))


def expert_parallel_moe(
    x: jax.Array,
    router: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    cfg: F.RouterConfig,
    ep: ExpertParallel,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
    backend: str = "auto",
    router_bias: jax.Array | None = None,
    b_gate_up: jax.Array | None = None,
    b_down: jax.Array | None = None,
    activation: SwiGLU = SwiGLU(),
    check_finite: bool | None = None,
    shared: tuple | None = None,
    numerics: Numerics = Numerics(),
) -> tuple[jax.Array, dict]:
    """A MoE layer (routed experts, plus shared experts if given) with experts sharded over `ep.axis`.

    Args:
      x: [T, d] tokens in the compute dtype (T divisible by the number of token shards).
      router: [d, E] router weights (used in fp32).
      w_gate_up: [E, d, 2n] and w_down: [E, n, d], in x's dtype.
      cfg: routing options.
      ep: the expert-parallel layout.
      bias: f32[E] selection bias (score="sigmoid") or None.
      key: PRNG key for rounding="stochastic".
      backend: `pm.moe_ffn` backend each shard runs its local experts with.
      router_bias: f32[E] bias of the router logits (gpt-oss) or None; replicated.
      b_gate_up: [E, 2n] and b_down: [E, d] expert biases (x's dtype) or None; sharded
        over `ep.axis` like the weights.
      activation: the experts' `SwiGLU` spec.
      check_finite: NaN/Inf check mode of each shard's bias and router logits (see
        `pm.nn.MoE`). True checks through checkify inside `shard_map`: every shard's check
        is reported by `err.throw()` after the step, so no shard waits on one that raised.
        Under `jit` with None, read `aux["nonfinite_tokens"]` (summed over shards) instead.
      shared: the shared (always-on) experts as `(w_gate_up [d, 2m], w_down [m, d],
        w_gate f32[d, 1] or None)` in x's dtype (`functional.shared_mlp`), or None. Each
        shard runs them on its own tokens inside the same `shard_map` as the dispatch: they
        do not depend on the dispatched rows, so XLA schedules them while the dispatch
        collective is in flight.
      numerics: `pm.Numerics` (router dtype, aggregation mode, SwiGLU fusion).

    Returns:
      (y [T, d] in x's dtype, aux dict as `functional.finish_aux`), equal to the
      single-device layer up to summation order.
    """
    num_tokens, _ = x.shape
    ep.check_experts(cfg.num_experts)
    shards = ep.num_token_shards
    if num_tokens % shards:
        raise ValueError(
            f"the number of tokens T={num_tokens} must be divisible by the {shards} token "
            f"shards of mesh axes {ep.token_axes}."
        )
    if cfg.rounding == "stochastic" and cfg.routing == "token_rounding" and key is None:
        raise ValueError("key must be a PRNG key for rounding='stochastic', got None.")
    extras = {}
    if bias is not None:
        extras["bias"] = bias
    if key is not None and cfg.routing == "token_rounding":
        extras["key"] = key
    if router_bias is not None:
        extras["router_bias"] = router_bias
    # Per-expert extras, sharded over the expert axis like the weights.
    expert_biases = {
        name: value for name, value in (("b_gate_up", b_gate_up), ("b_down", b_down)) if value is not None
    }
    if shared is not None:
        if not (isinstance(shared, tuple) and len(shared) == 3):
            raise ValueError(
                "shared must be (w_gate_up, w_down, w_gate or None), got "
                f"{type(shared).__name__} of length {len(shared) if isinstance(shared, tuple) else '?'}."
            )
        extras["shared"] = shared
    if resolve_backend(backend, x, w_down) == "interpret" and ep.mesh.devices.size > 1:
        raise ValueError(
            "backend='interpret' cannot run expert parallelism over several devices: Mosaic "
            "GPU's interpreter keeps per-device state that shard_map's concurrent devices "
            "corrupt (on 2 CPU devices the layer hung or failed an interpreter assertion, "
            "session 35). Test EP on CPU with backend='xla'; the kernels run under EP on GPUs."
        )
    if ep.check_vma and resolve_backend(backend, x, w_down) != "xla":
        raise ValueError(
            f"ExpertParallel(check_vma=True) runs only with backend='xla' (got {backend!r}): "
            "JAX 0.11.2's plgpu.kernel (mpmd_map) rejects inputs that vary over manual mesh "
            "axes. Use check_vma=False with the kernels."
        )
    token_spec = P(ep.token_axes, None)
    expert_spec = P(ep.axis, None, None)

    def body(x_l, router, w_gate_up_l, w_down_l, extras, expert_biases_l):
        return _shard_moe(
            x_l, router, w_gate_up_l, w_down_l, cfg, ep,
            bias=extras.get("bias"), key=extras.get("key"), backend=backend,
            router_bias=extras.get("router_bias"),
            ffn_options=dict(expert_biases_l, activation=activation, numerics=numerics),
            check_finite=check_finite,
            shared=extras.get("shared"), router_dtype=numerics.router_dtype,
        )

    in_specs = (token_spec, P(), expert_spec, expert_spec, P(), P(ep.axis, None))
    args = (x, router, w_gate_up, w_down, extras, expert_biases)
    explicit = jax.sharding.AxisType.Explicit in ep.mesh.axis_types
    if explicit:
        # Explicit-sharding meshes need the inputs laid out as the specs say (Auto ones let
        # shard_map reshard them); the output goes back to x's sharding, so the layer is
        # transparent to the caller's layout.
        x_sharding = jax.typeof(x).sharding
        if x_sharding.mesh.empty:  # x was not laid out on a mesh: give y back replicated
            x_sharding = jax.sharding.NamedSharding(ep.mesh, P())
        args = tuple(
            jax.tree.map(lambda a, s=spec: jax.sharding.reshard(a, jax.sharding.NamedSharding(ep.mesh, s)), arg)
            for arg, spec in zip(args, in_specs)
        )
    y, aux = jax.shard_map(
        body,
        mesh=ep.mesh,
        in_specs=in_specs,
        out_specs=(token_spec, P()),
        check_vma=ep.check_vma,
    )(*args)
    if explicit:
        y = jax.sharding.reshard(y, x_sharding)
    return y, aux


def _shard_moe(x_l, router, w_gate_up_l, w_down_l, cfg, ep, *, bias, key, backend, router_bias,
               ffn_options, check_finite, shared, router_dtype):
    """Per-shard body: route local tokens, dispatch, local experts, combine. x_l [T_l, d].

    `ffn_options` are the `moe_ffn` keywords of the local experts (biases, activation,
    numerics). The shared MLP (if any) reads only x_l: nothing orders it against the
    dispatch, so the scheduler can run it while the dispatch collective is in flight (SBO's
    first overlap).
    """
    logits = F.router_logits(x_l, router, router_bias, dtype=router_dtype)  # f32[T_l, E]
    if cfg.routing == "topk":
        selected, weights, tc_selected = F.route_assignment(
            logits, cfg, bias=bias, check_finite=check_finite
        )  # [T_l, E]
    else:
        selected, weights, tc_selected = distributed_token_rounding(
            logits, cfg, ep.token_axes, ep.num_token_shards, bias=bias, key=key,
            check_finite=check_finite,
        )  # [T_l, E]
    sums = F.router_sums(logits, F.assignment_counts(selected, tc_selected))
    ffn = functools.partial(moe_ffn, backend=backend, **ffn_options)
    if ep.dispatch == "all_gather":
        y_l = _all_gather_dispatch(x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, ffn)
        sums["capacity_dropped_rows"] = jnp.zeros((), jnp.int32)
    else:
        collective = (
            jax.lax.ragged_all_to_all if ep.dispatch == "ragged_all_to_all" else emulated_ragged_all_to_all
        )
        # The chunked overlap calls the per-row expert FFN itself: the expert options
        # (biases, activation) without the aggregation numerics.
        row_options = {k: v for k, v in ffn_options.items() if k != "numerics"}
        y_l, dropped = _ragged_dispatch(
            x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, ffn, collective,
            backend, ffn_options["numerics"].aggregation, row_options,
        )
        sums["capacity_dropped_rows"] = dropped
    if shared is not None:
        with jax.named_scope(SHARED_SCOPE):
            y_shared = F.shared_mlp(x_l, *shared)  # [T_l, d]
        y_l = y_l + y_shared
    aux = F.finish_aux(sums, cfg, lambda v: jax.lax.psum(v, ep.token_axes))
    return y_l, aux


def token_chunks(tokens_l: int, num_chunks: int) -> list[tuple[int, int]]:
    """[(start, stop)] cutting a shard's `tokens_l` tokens into at most `num_chunks`
    contiguous chunks of near-equal size (the all-gather dispatch's chunked overlap)."""
    size = -(-tokens_l // max(1, min(num_chunks, tokens_l)))
    return [(start, min(start + size, tokens_l)) for start in range(0, tokens_l, size)]


def _all_gather_dispatch(x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, ffn):
    """All-gather tokens over the expert axis, run local experts (`ffn`: `moe_ffn` with its
    options bound), reduce-scatter. -> [T_l, d].

    With `overlap="chunked"` the shard's tokens go in chunks (`token_chunks`): chunk c's
    all-gather, local experts and reduce-scatter depend on no other chunk, so XLA can run
    chunk c's reduce-scatter (and chunk c+1's all-gather) while chunk c+1's experts compute.
    Each chunk's plan holds the same rows as the unchunked plan's for those tokens (a
    token's rows never span chunks; the static capacity bound holds per chunk, since token
    rounding adds fewer than `tile` rows per expert over all chunks together), so outputs
    equal "none"'s; weight gradients are sums of per-chunk partials (fp32 order).
    """
    num_shards = ep.size
    local_experts = cfg.num_experts // num_shards
    tokens_l = x_l.shape[0]

    def columns_of_this_shard(a):
        # [T_l, E] of every shard -> [G, T_l, E_l]: all the group's tokens, this shard's experts.
        a = a.reshape(tokens_l, num_shards, local_experts).transpose(1, 0, 2)  # [G(dst), T_l, E_l]
        return jax.lax.all_to_all(a, ep.axis, 0, 0, tiled=True)  # [G(src), T_l, E_l]

    # One int32 exchange carries both masks: bit 0 = routed, bit 1 = kept top-K row.
    code = selected.astype(jnp.int32) + 2 * (selected & tc_selected).astype(jnp.int32)  # [T_l, E]
    code_g = columns_of_this_shard(code)  # [G, T_l, E_l]
    weights_g = columns_of_this_shard(weights)  # f32[G, T_l, E_l]
    if ep.overlap == "chunked":
        asked = (auto_num_chunks(tokens_l * cfg.top_k, x_l.shape[1], w_down_l.shape[1])
                 if ep.num_chunks == "auto" else ep.num_chunks)
        chunks = token_chunks(tokens_l, asked)
    else:
        chunks = [(0, tokens_l)]
    y_chunks = []
    for c, (start, stop) in enumerate(chunks):
        rows = num_shards * (stop - start)
        chunk_code = code_g[:, start:stop].reshape(rows, local_experts)  # [G*T_c, E_l]
        chunk_weights = weights_g[:, start:stop].reshape(rows, local_experts)
        with jax.named_scope(DISPATCH_SCOPE):
            x_g = jax.lax.all_gather(x_l[start:stop], ep.axis, axis=0, tiled=True)  # [G*T_c, d]
        plan = plan_from_assignment(
            (chunk_code & 1) > 0, chunk_weights, (chunk_code & 2) > 0,
            capacity=cfg.capacity(rows, local_experts),
        )
        with jax.named_scope(down_proj_scope(c)) if len(chunks) > 1 else contextlib.nullcontext():
            y_g = ffn(x_g, plan, w_gate_up_l, w_down_l)  # [G*T_c, d], local experts only
        with jax.named_scope(combine_scope(c)) if len(chunks) > 1 else contextlib.nullcontext():
            y_chunks.append(jax.lax.psum_scatter(y_g, ep.axis, scatter_dimension=0, tiled=True))  # [T_c, d]
    return y_chunks[0] if len(y_chunks) == 1 else jnp.concatenate(y_chunks, axis=0)  # [T_l, d]


def _exclusive_cumsum(a, axis):
    return jnp.cumsum(a, axis=axis, dtype=jnp.int32) - a


def _ragged_dispatch(x_l, selected, weights, tc_selected, w_gate_up_l, w_down_l, cfg, ep, ffn,
                     collective, backend, aggregation, row_options):
    """Send routed rows to their experts' shards, run local experts (`ffn`: `moe_ffn` with its
    options bound; `row_options`: the expert biases and activation, for the chunked
    overlap's `chunked_row_ffn`), send outputs back, sum each token's rows in the
    `aggregation` order.

    Returns ([T_l, d] output, i32[] rows this shard could not send for lack of capacity).
    """
    num_shards = ep.size
    local_experts = cfg.num_experts // num_shards
    tokens_l, d = x_l.shape
    dtype = x_l.dtype
    me = jax.lax.axis_index(ep.axis)
    exchange = functools.partial(ragged_exchange, axis_name=ep.axis, collective=collective)

    # Rows of this shard's tokens, grouped by expert, hence by destination shard.
    plan = plan_from_assignment(
        selected, weights, selected & tc_selected, capacity=cfg.capacity(tokens_l)
    )  # P_l rows
    counts = plan.group_sizes.reshape(num_shards, local_experts)  # [G(dst), E_l]
    all_counts = jax.lax.all_gather(counts, ep.axis)  # [G(src), G(dst), E_l]
    sizes = jnp.sum(all_counts, axis=-1, dtype=jnp.int32)  # [src, dst]
    receive_rows = ep.receive_capacity(cfg, tokens_l)
    # A receiver's buffer fills in source order; rows past its capacity are not sent.
    allowed = jnp.clip(receive_rows - _exclusive_cumsum(sizes, 0), 0, sizes)  # [src, dst]
    send_offsets = _exclusive_cumsum(sizes, 1)  # [src, dst] first row for dst in src's plan
    recv_offsets = _exclusive_cumsum(allowed, 0)  # [src, dst] first row from src in dst's buffer

    x_rows = x_l[plan.token_ids]  # [P_l, d]
    with jax.named_scope(DISPATCH_SCOPE):
        x_recv = exchange(
            x_rows, jnp.zeros((receive_rows, d), dtype), send_offsets, recv_offsets, allowed
        )  # [R, d], source-major, expert-major inside a source

    # Local expert of each received row, from the counts every source sent.
    row = jnp.arange(receive_rows, dtype=jnp.int32)  # [R]
    from_src = allowed[:, me]  # [G(src)]
    num_received = jnp.sum(from_src)
    src = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(from_src), row, side="right"), num_shards - 1
    )  # [R]
    pos = row - recv_offsets[src, me]  # [R] position inside its source's chunk
    ends = jnp.cumsum(all_counts[:, me, :], axis=1, dtype=jnp.int32)  # [G(src), E_l]
    expert = jnp.sum(pos[:, None] >= ends[src], axis=1, dtype=jnp.int32)  # [R]
    received = (row < num_received)[:, None] & (
        expert[:, None] == jnp.arange(local_experts, dtype=jnp.int32)[None, :]
    )  # [R, E_l]
    # Each received row is its own "token" with weight 1: the router weight is applied by
    # the source at combine, so the expert output Y is what comes back. Grouped by local
    # expert, stable by received row: source-major inside each expert.
    plan_recv = plan_from_assignment(
        received, jnp.ones(received.shape, jnp.float32), received, capacity=receive_rows
    )
    y_rows_init = jnp.zeros((plan.capacity, d), dtype)
    if ep.overlap == "chunked":
        y_rows = _chunked_experts_and_combine(
            x_recv, plan_recv, src, w_gate_up_l, w_down_l, all_counts, allowed, send_offsets,
            y_rows_init, ep, backend, exchange, row_options,
            expected_rows=min(receive_rows, tokens_l * cfg.top_k),
        )  # [P_l, d]
    else:
        y_recv = ffn(x_recv, plan_recv, w_gate_up_l, w_down_l)  # [R, d]
        # The reverse exchange: sender = expert shard, receiver = source.
        with jax.named_scope(combine_scope(0)):
            y_rows = exchange(y_recv, y_rows_init, recv_offsets.T, send_offsets.T, allowed.T)
    # y_rows [P_l, d]; rows not served stay 0

    # Combine: O[t] = sum_r s[r] * Y[r] over the rows of token t, in ascending expert order
    # and the aggregation mode's roundings, as the single-device layer sums them. Top-K has
    # exactly K rows per token (no scatter); token rounding walks the row tiles.
    rows_per_token = cfg.top_k if cfg.routing == "topk" else None
    y_l = aggregate_rows(
        y_rows, plan, aggregation, rows_per_token=rows_per_token
    )  # f32 [T_l, d]
    dropped = jnp.sum(sizes[me]) - jnp.sum(allowed[me])
    return y_l.astype(dtype), dropped


def _chunk_send_counts(kept, row_bounds):
    """i32[C, G(expert shard), G(source)]: rows of chunk c that an expert shard returns to a source.

    An expert shard groups its received rows by local expert, source-major inside each
    expert, and cuts them into chunks at `row_bounds`. Every shard computes this table for
    all shards from the all-gathered counts, so senders and receivers agree.

    Args:
      kept: i32[G(src), G(dst), E_l] rows each source sends to each local expert.
      row_bounds: i32[G(dst), C+1] each expert shard's chunk bounds (`RowChunking.bounds`).
    """
    group_start = _exclusive_cumsum(jnp.sum(kept, axis=0), 1)  # [d, e] on the expert shard
    block_start = group_start[None] + _exclusive_cumsum(kept, 0)  # [s, d, e] rows of (s, e) on d
    lo = row_bounds[:, :-1].T[:, None, :, None]  # [C, 1, d, 1]
    hi = row_bounds[:, 1:].T[:, None, :, None]
    inside = jnp.minimum(block_start + kept, hi) - jnp.maximum(block_start, lo)
    counts = jnp.sum(jnp.clip(inside, 0, None), axis=-1, dtype=jnp.int32)  # [C, s, d]
    return counts.transpose(0, 2, 1)  # [C, d, s]


def _chunked_experts_and_combine(
    x_recv, plan_recv, received_src, w_gate_up_l, w_down_l, all_counts, allowed, send_offsets,
    y_rows, ep, backend, exchange, row_options, expected_rows,
):
    """overlap="chunked": the down-proj in chunks (`RowChunking`), each sent back at once.

    `row_options`: `chunked_row_ffn` keywords of the local experts (`b_gate_up`, `b_down`,
    `activation`). `expected_rows`: rows a shard receives on average, for
    `num_chunks="auto"`.

    Chunk c's exchange depends only on chunk c's down-proj, so XLA can run it while chunk
    c+1's down-proj computes. The rows a chunk returns to one source are contiguous in
    that source's plan (the chunk cuts the expert-major, source-major grouped order), so
    after a stable sort of the chunk's rows by source, one ragged exchange sends it.

    Returns y_rows [P_l, d]: the expert output of every row this shard routed.
    """
    num_shards = ep.size
    receive_rows, d = x_recv.shape
    n = w_down_l.shape[1]
    me = jax.lax.axis_index(ep.axis)
    resolved = resolve_backend(backend, x_recv, w_down_l)
    asked = auto_num_chunks(expected_rows, d, n) if ep.num_chunks == "auto" else ep.num_chunks
    chunking = RowChunking.for_shape(resolved, d, n, receive_rows, asked)
    num_chunks, chunk_rows = chunking.num_chunks, chunking.rows
    # A source sends its rows for dst expert-major and truncated to `allowed`.
    kept = jnp.clip(allowed[:, :, None] - _exclusive_cumsum(all_counts, 2), 0, all_counts)  # [s, d, e]
    # Every expert shard's chunk bounds, from its received rows per local expert.
    row_bounds = jax.vmap(chunking.bounds)(jnp.sum(kept, axis=0))  # [G(dst), C+1]
    y = chunked_row_ffn(
        x_recv, plan_recv, w_gate_up_l, w_down_l, num_chunks=asked, backend=resolved,
        row_bounds=row_bounds[me], **row_options,
    )  # [C, S, d]: chunk c holds grouped rows [row_bounds[me, c], row_bounds[me, c+1])
    counts = _chunk_send_counts(kept, row_bounds)  # [C, d, s]
    before = _exclusive_cumsum(counts, 0)  # [C, d, s] rows returned in earlier chunks
    # Source of each grouped row; padding rows sort last and are never sent.
    grouped_src = jnp.where(plan_recv.row_is_valid, received_src[plan_recv.token_ids], num_shards)
    grouped_src = jnp.pad(grouped_src, (0, num_chunks * chunk_rows - receive_rows), constant_values=num_shards)
    mine = row_bounds[me]
    for c in range(num_chunks):
        chunk_src = jax.lax.dynamic_slice_in_dim(grouped_src, mine[c], chunk_rows)  # [S]
        chunk_src = jnp.where(
            jnp.arange(chunk_rows) < mine[c + 1] - mine[c], chunk_src, num_shards
        )  # rows past the chunk (the next chunk's) sort last too
        order = jnp.argsort(chunk_src, stable=True)  # [S]
        with jax.named_scope(combine_scope(c)):
            y_rows = exchange(
                y[c][order], y_rows,
                _exclusive_cumsum(counts[c], 1),  # [d, s] offset in the sorted chunk
                send_offsets.T + before[c],  # [d, s] offset in the source's plan
                counts[c],
            )
    return y_rows


def ragged_exchange(
    operand: jax.Array,
    output: jax.Array,
    in_offsets: jax.Array,
    out_offsets: jax.Array,
    sizes: jax.Array,
    *,
    axis_name,
    collective=jax.lax.ragged_all_to_all,
) -> jax.Array:
    """A ragged all-to-all given by whole `[sender, receiver]` tables, with its own VJP.

    Shard i sends rows `[in_offsets[i, j], + sizes[i, j])` of its `operand` to shard j,
    which writes them at rows `[out_offsets[i, j], + sizes[i, j])` of its `output`; other
    rows of `output` are kept. Every shard must hold the same tables (all i32[G, G]).

    Because the tables are known everywhere, the backward needs no offset exchange: it
    sends the cotangent rows back with the same `collective` and zeroes the written rows
    of `output`'s cotangent. So the gradient is the same code for the real collective and
    the emulated one that tests it on CPU, and chained sends into one buffer (the chunked
    combine) get exact cotangents.

    Args:
      operand: [N, ...] rows to send; output: [M, ...] buffer to write into.
      in_offsets, out_offsets, sizes: i32[G, G].
      axis_name: the mesh axis of the G shards.
      collective: `jax.lax.ragged_all_to_all` or `emulated_ragged_all_to_all`.

    Returns:
      [M, ...] `output` with the received rows written.
    """
    # Under shard_map(check_vma=True) both buffers enter varying over every axis the result
    # varies over, so the VJP's cotangents have their inputs' types (a zero `output` made
    # inside the body is invariant; its pcast transposes to a psum outside the VJP).
    axes = frozenset((axis_name,) if isinstance(axis_name, str) else axis_name)
    operand, output = vary_together(vary(operand, axes), output)
    return _exchange(operand, output, in_offsets, out_offsets, sizes, axis_name, collective)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _exchange(operand, output, in_offsets, out_offsets, sizes, axis_name, collective):
    me = jax.lax.axis_index(axis_name)
    return collective(
        operand, output, in_offsets[me], sizes[me], out_offsets[me], sizes[:, me], axis_name=axis_name
    )


def _exchange_fwd(operand, output, in_offsets, out_offsets, sizes, axis_name, collective):
    out = _exchange(operand, output, in_offsets, out_offsets, sizes, axis_name, collective)
    return out, (operand.shape, in_offsets, out_offsets, sizes)


def _exchange_bwd(axis_name, collective, residuals, grad):
    operand_shape, in_offsets, out_offsets, sizes = residuals
    me = jax.lax.axis_index(axis_name)
    # Reverse roles: send back the rows each sender wrote here, to where they came from.
    # The receive buffer varies like the cotangent (check_vma): `ragged_all_to_all` types
    # its result by that buffer, and the operand's cotangent must have the operand's type
    # (the emulated collective's all_gathers vary by themselves, the real one does not).
    axes = varying_axes(grad)
    grad_operand = collective(
        grad, vary(jnp.zeros(operand_shape, grad.dtype), axes), out_offsets[:, me], sizes[:, me],
        in_offsets[:, me], sizes[me], axis_name=axis_name,
    )
    grad_operand = vary(grad_operand, axes)
    # Rows of `output` that were overwritten get no cotangent (difference array, then cumsum).
    rows = grad.shape[0]
    starts, stops = out_offsets[:, me], out_offsets[:, me] + sizes[:, me]
    edges = jnp.zeros((rows + 1,), jnp.int32).at[starts].add(1).at[stops].add(-1)
    written = jnp.cumsum(edges[:rows]) > 0  # [M]
    grad_output = jnp.where(written.reshape(-1, *([1] * (grad.ndim - 1))), 0, grad)
    return grad_operand, grad_output, None, None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` semantics built from `all_gather` (G times the bytes).

    For testing the ragged dispatch where the collective is missing (XLA:CPU).
    Differentiable in operand and output.
    """
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [G, N, ...]
    starts = jax.lax.all_gather(output_offsets, axis_name)[:, me]  # [G(src)] where src writes in me
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]  # [G(src)]
    src_starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [G(src)]
    row = jnp.arange(output.shape[0], dtype=jnp.int32)  # [M]
    hit = (row[None, :] >= starts[:, None]) & (row[None, :] < (starts + sizes)[:, None])  # [G, M]
    src = jnp.argmax(hit, axis=0)  # [M]
    src_row = jnp.clip(src_starts[src] + row - starts[src], 0, operand.shape[0] - 1)  # [M]
    values = operands[src, src_row]  # [M, ...]
    mask = jnp.any(hit, axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(mask, values, output)


def distributed_token_rounding(
    logits: jax.Array,
    cfg: F.RouterConfig,
    token_axes: tuple[str, ...],
    num_shards: int,
    *,
    bias: jax.Array | None = None,
    key: jax.Array | None = None,
    check_finite: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Token rounding over the global batch, from inside `shard_map` (tokens sharded).

    Equals `functional.route_assignment` (token rounding, weights times the routed scaling
    factor) on the concatenated logits, restricted to this shard's tokens.

    Args:
      logits: f32[T_l, E] this shard's router logits.
      cfg: routing options (routing="token_rounding").
      token_axes: mesh axes the tokens are sharded over (major to minor).
      num_shards: static product of their sizes.
      bias, key: selection bias and stochastic-rounding key, as in token rounding.
      check_finite: NaN/Inf check mode of the bias and logits (see `pm.routing.topk_plan`).

    Returns:
      (selected bool[T_l, E], weights f32[T_l, E], tc_selected bool[T_l, E]).
    """
    k = check_router_inputs(logits, cfg.top_k, cfg.score, bias, check_finite)
    tokens_l = logits.shape[0]
    tc_selected, tc_weights = topk_assignment(
        logits, k, score=cfg.score, renormalize=cfg.renormalize, bias=bias
    )  # [T_l, E]
    probs = router_probabilities(logits, cfg.score)  # [T_l, E]
    rank_score = probs if bias is None else probs + bias.astype(jnp.float32)[None, :]
    global_token = jax.lax.axis_index(token_axes) * tokens_l + jnp.arange(tokens_l, dtype=jnp.int32)

    counts = jax.lax.psum(jnp.sum(tc_selected, axis=0, dtype=jnp.int32), token_axes)  # [E] global
    target = rounded_counts(
        counts, cfg.tile, cfg.rounding, max_count=tokens_l * num_shards, key=key
    )  # [E]
    num_add = jnp.maximum(target - counts, 0)  # [E], < tile
    num_drop = jnp.maximum(counts - target, 0)  # [E], < tile
    # Add the best non-top-K tokens: ascending (-score, token).
    added = _first_m_global(-rank_score, global_token, ~tc_selected, num_add, cfg.tile, token_axes)
    # Drop the worst top-K rows: the first in ascending (score, -token).
    dropped = _first_m_global(rank_score, -global_token, tc_selected, num_drop, cfg.tile, token_axes)
    selected = (tc_selected & ~dropped) | added  # [T_l, E]
    weights = jnp.where(selected, jnp.where(tc_selected, tc_weights, probs), 0.0)
    return selected, cfg.scale_weights(weights), tc_selected


def _first_m_global(primary, secondary, eligible, m, tile, token_axes):
    """bool[T_l, E]: eligible entries among the first `m[e]` of expert e's global order.

    The order is ascending (primary, secondary) over the eligible entries of all token
    shards. `m < tile`, so each shard's best `tile` candidates per expert decide it.

    Args:
      primary: f32[T_l, E]; secondary: i32[T_l] (unique per global token);
      eligible: bool[T_l, E]; m: i32[E]; tile: static bound on m.
    """
    tokens_l = primary.shape[0]
    keep = min(tile, tokens_l)
    ineligible = (~eligible).astype(jnp.int32)  # [T_l, E]
    p = jnp.where(eligible, primary, jnp.inf)  # [T_l, E]
    q = jnp.where(eligible, secondary[:, None], jnp.iinfo(jnp.int32).max)  # [T_l, E]
    local = jax.lax.sort((ineligible.T, p.T, q.T), dimension=1, num_keys=3)  # 3 x [E, T_l]
    candidates = [jax.lax.all_gather(a[:, :keep], token_axes, axis=1, tiled=True) for a in local]
    g_inel, g_p, g_q = jax.lax.sort(tuple(candidates), dimension=1, num_keys=3)  # [E, S*keep]
    idx = jnp.clip(m - 1, 0, g_p.shape[1] - 1)[:, None]  # [E, 1]
    th_p = jnp.take_along_axis(g_p, idx, axis=1)[:, 0]  # [E] key of the m-th entry
    th_q = jnp.take_along_axis(g_q, idx, axis=1)[:, 0]  # [E]
    at_or_before = (p < th_p[None, :]) | ((p == th_p[None, :]) & (q <= th_q[None, :]))  # [T_l, E]
    return eligible & (m[None, :] > 0) & at_or_before
