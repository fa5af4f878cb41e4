"""Expert-parallel MoE vs the single-device MoE on a multi-device CPU mesh.

Run in its own process (the device count is fixed when jax is imported):

    python -m tests.ep_check --cases fast      # what tests/test_expert_parallel.py runs
    python -m tests.ep_check --cases fast_extra  # its opt-in extras (slow)
    python -m tests.ep_check --cases full      # every combination (slow)

For each case it builds the same `MoE` twice (same init), once with
`expert_parallel=ExpertParallel(mesh, ...)` on a (data, expert) mesh of 8 CPU devices, and
compares outputs, the aux pytree, and the gradients of a loss that mixes the output and
the aux loss with respect to every parameter and the input. Prints one JSON line per case
and exits non-zero on a mismatch.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 unless set
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pallas_moe as pm  # noqa: E402

D, N, E, K, T, TILE = 16, 8, 8, 2, 64, 4

# Model-family options, by name so that cases stay JSON-printable.
PRESETS = {
    # gpt-oss: router and expert biases (set to random values in build), clamped SwiGLU
    "biases_clamped": dict(router_bias=True, expert_bias=True, activation=pm.ops.SwiGLU.clamped()),
    # DeepSeek-V3 routing plus Qwen2-MoE's gated shared expert
    "grouped_scaled_gated": dict(
        score="sigmoid", selection_bias=True, renormalize=True, num_groups=4, topk_groups=2,
        routed_scaling_factor=2.5, shared_expert_gate=True,
    ),
}


def build(routing, skew, ep=None, **extra):
    extra = {"tile": TILE, **extra}
    preset = extra.pop("preset", None)
    extra.update(PRESETS.get(preset, {}))
    layer = pm.nn.MoE(
        D, N, E, K, routing=routing, backend="xla", rngs=nnx.Rngs(0),
        load_balance_weight=1.0, z_loss_weight=0.1, num_shared_experts=1,
        expert_parallel=ep, **extra,
    )
    if extra.get("expert_bias"):
        keys = jax.random.split(jax.random.key(7), 3)
        layer.router_bias[...] = jax.random.normal(keys[0], (E,))
        layer.b_gate_up[...] = 2.0 * jax.random.normal(keys[1], (E, 2 * N))  # reaches the clamps
        layer.b_down[...] = jax.random.normal(keys[2], (E, D))
    if skew:
        # Feature 0 of the input is a large constant and pushes tokens to the last experts.
        layer.router[0, :] = jnp.linspace(-1.0, 2.0, E)
    if extra.get("selection_bias"):
        layer.selection_bias[...] = jnp.linspace(0.3, -0.3, E)  # moves which experts are picked
    return layer


def inputs(skew):
    x = jax.random.normal(jax.random.key(1), (4, T // 4, D))  # [B, S, d]
    if skew:
        x = x.at[..., 0].set(3.0)
    return x


def loss_fn(layer, x):
    y, aux = layer(x)
    probe = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y * probe) + aux["loss"], (y, aux)


value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
_reference_cache = {}


def reference(routing, skew, extra):
    key = (routing, skew, tuple(sorted(extra.items())))
    if key not in _reference_cache:
        _reference_cache[key] = value_and_grad(build(routing, skew, **extra), inputs(skew))
    return _reference_cache[key]


def max_rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-6))


def chunks_used(ep, routing, extra):
    """Chunks the chunked overlap cuts a shard's received rows (ragged dispatches, xla
    backend) or tokens (all-gather dispatch) into."""
    from pallas_moe.nn.expert_parallel import token_chunks
    from pallas_moe.ops.row_chunks import XLA_CHUNK_ALIGN, chunk_layout

    if ep.dispatch == "all_gather":
        return len(token_chunks(T // ep.num_token_shards, ep.num_chunks))
    cfg = build(routing, False, **extra).config
    rows = ep.receive_capacity(cfg, T // ep.num_token_shards)
    return chunk_layout(rows, ep.num_chunks, XLA_CHUNK_ALIGN)[1]


def run_case(routing, dispatch, ep_size, skew, extra, ep_options=None):
    """EP layer vs the single-device layer; `ep_options`: overlap, num_chunks, check_vma."""
    ep_options = ep_options or {}
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(8 // ep_size, ep_size), ("data", "expert"))
    ep = pm.nn.ExpertParallel(mesh, axis="expert", dispatch=dispatch, **ep_options)
    (l0, (y0, a0)), g0 = reference(routing, skew, extra)
    start = time.time()
    (l1, (y1, a1)), g1 = value_and_grad(build(routing, skew, ep, **extra), inputs(skew))
    result = {
        "routing": routing, "dispatch": dispatch, "ep": ep_size, "skew": skew, **extra, **ep_options,
        "y": max_rel(y0, y1),
        "loss": max_rel(l0, l1),
        "grad": max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))),
        "aux": max(max_rel(a0[k], a1[k]) for k in a0),
        "aux_keys_equal": sorted(a0) == sorted(a1),
        "seconds": round(time.time() - start, 1),
        "added_rows": int(a1["added_rows"]), "dropped_rows": int(a1["dropped_rows"]),
        "max_load": round(float(a1["max_load"]), 2),
    }
    if ep.overlap == "chunked":
        result["chunks"] = chunks_used(ep, routing, extra)
    tol = 2e-5
    result["ok"] = bool(
        result["aux_keys_equal"] and result["y"] < tol and result["loss"] < tol
        and result["grad"] < tol and result["aux"] < tol
    )
    return result


CHUNKED = {"overlap": "chunked", "num_chunks": 3}

FAST = [
    # (routing, dispatch, ep_size, skew, extra[, ep_options]); scan_and_capacity_checks adds
    # EP=4 ragged top-K.
    ("token_rounding", "all_gather", 1, False, {"tile": 16}),
    ("topk", "emulated_ragged_all_to_all", 2, False, {"score": "sigmoid", "selection_bias": True}),
    # The all-gather dispatch under the vma type check, with DeepSeek-V3's routing options.
    ("topk", "all_gather", 4, True, {"preset": "grouped_scaled_gated"}, {"check_vma": True}),
]

FAST_EXTRA = [
    # CI time: opt-in (--cases fast_extra, a slow test); each is another case's twin.
    # Plain top-K through the all-gather dispatch at EP=2, skewed, under the vma check:
    # FAST's EP=4 all-gather case runs the same dispatch and check (skewed, with grouped
    # top-K on top), as do "layouts"' explicit_mesh (EP=4, plain top-K, skewed) and the
    # schedule checks; EP=2 is FAST's ragged top-K case.
    ("topk", "all_gather", 2, True, {}, {"check_vma": True}),
    # Token rounding through the unchunked ragged dispatch at EP=8, skewed, rounding up:
    # FAST_CHUNKED runs this very case with overlap="chunked" (same routing, plan, EP size,
    # the same dispatch and combine around the experts), and FAST's ragged top-K case runs
    # the unchunked expert call and reverse exchange.
    ("token_rounding", "emulated_ragged_all_to_all", 8, True, {"tile": 16, "rounding": "up"}),
    # Token rounding through the all-gather dispatch at EP=4, skewed: "layouts"' scan_ep runs
    # the same (EP=4 of a (2, 4) mesh, skewed inputs, output, loss and gradients at 2e-5);
    # FAST's EP=1 token-rounding case checks the aux of that dispatch, rounding both ways.
    ("token_rounding", "all_gather", 4, True, {"tile": 16}),
    # gpt-oss's biases and clamped SwiGLU through the ragged dispatch: FAST_CHUNKED runs this
    # very case with overlap="chunked" (same routing, dispatch, EP size, biases); the
    # unchunked ragged path is FAST's ragged top-K case (EP=2) and "layouts"' capacity checks.
    ("token_rounding", "emulated_ragged_all_to_all", 2, False, {"preset": "biases_clamped", "tile": 16}),
]

FAST_CHUNKED = [
    # The chunked overlap (top-K and token rounding; one under the vma type check).
    ("topk", "emulated_ragged_all_to_all", 4, True, {}, CHUNKED),
    ("token_rounding", "emulated_ragged_all_to_all", 8, True, {"tile": 16, "rounding": "up"},
     {**CHUNKED, "num_chunks": 4, "check_vma": True}),
    # gpt-oss's expert biases and clamped SwiGLU through the chunked overlap.
    ("token_rounding", "emulated_ragged_all_to_all", 2, False, {"preset": "biases_clamped", "tile": 16},
     CHUNKED),
    # The all-gather dispatch in token chunks: token rounding (rows added and dropped,
    # the capacity bound per chunk), skewed, under the vma type check.
    ("token_rounding", "all_gather", 4, True, {"tile": 16}, {**CHUNKED, "check_vma": True}),
]


def full_cases():
    for routing, dispatch, ep_size, skew in itertools.product(
        ("topk", "token_rounding"), ("all_gather", "emulated_ragged_all_to_all"), (1, 2, 4, 8), (False, True)
    ):
        yield routing, dispatch, ep_size, skew, {}
        if routing == "token_rounding":
            yield routing, dispatch, ep_size, skew, {"tile": 16}
        if ep_size > 1:
            yield routing, dispatch, ep_size, skew, {}, CHUNKED
            if ep_size == 4:
                yield routing, dispatch, ep_size, skew, {}, {**CHUNKED, "check_vma": True}
    for score in ("topk_softmax", "sigmoid"):
        yield "token_rounding", "all_gather", 4, True, {"score": score, "renormalize": score == "sigmoid"}
    for rounding in ("up", "down", "balance"):
        yield "token_rounding", "emulated_ragged_all_to_all", 2, True, {"rounding": rounding, "tile": 16}


def error_checks():
    """Bad layouts on a real multi-device mesh give errors that name the problem."""
    devices = np.array(jax.devices()[:6])
    mesh = Mesh(devices.reshape(2, 3), ("data", "expert"))
    checks = []

    def expect(name, fn, fragment):
        try:
            fn()
        except ValueError as err:
            ok = fragment in str(err)
            checks.append({"check": name, "ok": ok, "error": str(err)})
        else:
            checks.append({"check": name, "ok": False, "error": None})

    ep = pm.nn.ExpertParallel(mesh, axis="expert")
    expect("experts_not_divisible", lambda: pm.nn.MoE(D, N, 8, K, rngs=nnx.Rngs(0), expert_parallel=ep),
           "num_experts=8 must be divisible by the size 3 of the expert mesh axis 'expert'")
    layer = pm.nn.MoE(D, N, 6, K, rngs=nnx.Rngs(0), backend="xla", expert_parallel=ep)
    expect("tokens_not_divisible", lambda: layer(jnp.zeros((10, D))),
           "T=10 must be divisible by the 6 token shards")
    expect("missing_axis", lambda: pm.nn.ExpertParallel(mesh, axis="experts"),
           "axis='experts' is not an axis of the mesh")
    # And the valid layout on the same mesh runs: under jit, as the README calls the layer
    # (1.5 s); the same call outside jit is `eager_check`, opt-in (11 s: op by op, each op of
    # the shard_map body compiles apart).
    y, _ = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((12, D)))
    checks.append({"check": "valid_3way", "ok": bool(y.shape == (12, D))})

    # The emulated collective reproduces the example of `jax.lax.ragged_all_to_all`'s docstring.
    from pallas_moe.nn.expert_parallel import emulated_ragged_all_to_all
    from jax.sharding import PartitionSpec as Spec

    mesh2 = Mesh(np.array(jax.devices()[:2]), ("x",))
    args = [
        [[1, 2, 2], [3, 4, 0]], [[0] * 4, [0] * 4], [[0, 1], [0, 1]],
        [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]],
    ]
    args = [jnp.asarray(a, jnp.int32).reshape(-1) for a in args]
    fn = jax.shard_map(
        lambda *a: emulated_ragged_all_to_all(*a, axis_name="x"),
        mesh=mesh2, in_specs=(Spec("x"),) * 6, out_specs=Spec("x"), check_vma=False,
    )
    result = np.asarray(fn(*args)).reshape(2, 4).tolist()
    checks.append({"check": "emulation_doc_example", "ok": result == [[1, 3, 0, 0], [2, 2, 4, 0]], "result": result})
    return checks


def eager_check():
    """`error_checks`' valid 3-way layout, called outside jit."""
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(2, 3), ("data", "expert"))
    layer = pm.nn.MoE(D, N, 6, K, rngs=nnx.Rngs(0), backend="xla",
                      expert_parallel=pm.nn.ExpertParallel(mesh, axis="expert"))
    y, _ = layer(jnp.ones((12, D)))
    return [{"check": "valid_3way_eager", "ok": bool(y.shape == (12, D))}]


def gpu_path_vma_checks():
    """The GPU-only code inside `shard_map(check_vma=True)`, traced (no lowering): the
    routing's Pallas kernels and the ragged dispatch's exchange with the real collective.

    On a GPU the router softmax is a Pallas kernel (`routing.formulas._on_gpu`), and a
    pallas_call's outputs must carry their varying mesh axes under check_vma: on two
    H200s the EP layer with check_vma=True failed at trace time until the routing kernels
    typed them (`pallas_moe._vma.pallas_call`); the ragged dispatch then failed in its
    exchange's VJP (`jax.lax.ragged_all_to_all` types its result by the receive buffer,
    which was an invariant zero buffer in the backward). Here `_on_gpu` is patched so that the
    EP layer's grad traces the GPU path, and each routing kernel is traced in a
    shard_map of its own. Tracing is where the vma check runs.
    """
    from jax.sharding import PartitionSpec as Spec

    from pallas_moe.nn.expert_parallel import ragged_exchange
    from pallas_moe.routing import formulas
    from pallas_moe.routing import kernels as routing_kernels
    from pallas_moe.routing.token_rounding import token_rounding_plan
    from pallas_moe.routing.topk import topk_pairs

    out = []
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))
    logits = jax.random.normal(jax.random.key(3), (2 * 64, E), jnp.float32)

    def record(name, trace):
        """Runs `trace()` (a `.trace(...)` call) and records whether it passed the check."""
        try:
            trace()
            out.append({"check": name, "ok": True})
        except Exception as err:  # noqa: BLE001 - the record says what failed
            out.append({"check": name, "ok": False, "error": f"{type(err).__name__}: {err}"[:400]})

    def in_shard_map(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=Spec("expert"), out_specs=Spec("expert"),
                                     check_vma=True))

    record("vma_softmax_kernel", lambda: in_shard_map(routing_kernels.softmax_rows).trace(logits))
    record("vma_topk_kernels", lambda: in_shard_map(lambda l: topk_pairs(l, K, impl="kernel").rows).trace(logits))
    record("vma_token_rounding_kernels", lambda: in_shard_map(
        lambda l: token_rounding_plan(l, K, tile=TILE, impl="kernel").token_ids).trace(logits))

    # The ragged dispatch's exchange with the real collective (GPU/TPU only at run time,
    # traced here): its VJP must give the operand's cotangent the operand's varying type.
    def exchange_loss(x):
        def body(a):
            sizes = jnp.full((2, 2), 4, jnp.int32)
            starts = jnp.tile(jnp.arange(2, dtype=jnp.int32) * 4, (2, 1))
            y = ragged_exchange(a, jnp.zeros((8, D), a.dtype), starts, starts.T, sizes, axis_name="expert",
                                collective=jax.lax.ragged_all_to_all)
            return jax.lax.psum(jnp.sum(jnp.square(y.astype(jnp.float32))), "expert")

        return jax.shard_map(body, mesh=mesh, in_specs=Spec("expert"), out_specs=Spec(), check_vma=True)(x)

    record("vma_ragged_exchange_grad", lambda: jax.jit(jax.grad(exchange_loss)).trace(jnp.ones((16, D), jnp.bfloat16)))

    ep_mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "expert"))
    on_gpu = formulas._on_gpu
    formulas._on_gpu = lambda: True
    try:
        for routing in ("topk", "token_rounding"):
            ep = pm.nn.ExpertParallel(ep_mesh, dispatch="all_gather", check_vma=True)
            layer = build(routing, False, ep)
            graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

            def loss(params, x):
                y, aux = nnx.merge(graphdef, params, rest)(x)
                return jnp.mean(jnp.square(y.astype(jnp.float32))) + aux["loss"]

            record(f"vma_ep_gpu_routing_{routing}",
                   lambda: jax.jit(jax.grad(loss, argnums=(0, 1))).trace(params, inputs(False)))
    finally:
        formulas._on_gpu = on_gpu
    return out


def scan_and_capacity_checks():
    """EP inside `nnx.scan` over a stack of layers; the ragged receive-capacity drop path."""
    checks = []
    devices = np.array(jax.devices()[:8])
    mesh = Mesh(devices.reshape(2, 4), ("data", "expert"))
    num_layers = 2

    def stack(ep):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create(rngs):
            return pm.nn.MoE(D, N, E, K, routing="token_rounding", tile=8, backend="xla",
                             rngs=rngs, expert_parallel=ep)
        return create(nnx.Rngs(0))

    def loss(layers, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        def body(layer, h):
            y, aux = layer(h)
            return h + y, aux

        h, aux = body(layers, x)
        return jnp.mean(h**2) + jnp.sum(aux["loss"]), h

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    x = inputs(True)
    (l0, h0), g0 = grad(stack(None), x)
    (l1, h1), g1 = grad(stack(pm.nn.ExpertParallel(mesh, dispatch="all_gather")), x)
    err = max(max_rel(h0, h1), max_rel(l0, l1),
              max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))))
    checks.append({"check": "scan_ep", "ok": err < 2e-5, "err": err})

    # Receive capacity of about the mean load: skewed routing overflows some receivers.
    ep = pm.nn.ExpertParallel(mesh, dispatch="emulated_ragged_all_to_all", capacity_factor=1.0)
    (l2, (y2, a2)), g2 = value_and_grad(build("topk", True, ep), x)
    (l3, (y3, a3)), _ = reference("topk", True, {})
    dropped = int(a2["capacity_dropped_rows"])
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(g2))
    checks.append({
        "check": "capacity_drop", "dropped": dropped, "y_err": max_rel(y3, y2),
        "ok": dropped > 0 and finite and bool(jnp.all(jnp.isfinite(y2))) and max_rel(y3, y2) > 1e-4,
    })
    ep = pm.nn.ExpertParallel(mesh, dispatch="emulated_ragged_all_to_all", capacity_factor=100.0)
    (_, (y4, a4)), _ = value_and_grad(build("topk", True, ep), x)
    checks.append({
        "check": "capacity_ample", "ok": int(a4["capacity_dropped_rows"]) == 0 and max_rel(y3, y4) < 2e-5,
    })

    # jax.make_mesh gives Explicit axes: inputs are resharded and [B, S, d] reshaped back.
    explicit = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    ep = pm.nn.ExpertParallel(explicit, dispatch="all_gather")
    (l5, (y5, a5)), g5 = value_and_grad(build("topk", True, ep), x)
    err = max(max_rel(y3, y5), max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g5), jax.tree.leaves(
        reference("topk", True, {})[1]))))
    checks.append({"check": "explicit_mesh", "ok": y5.shape == x.shape and err < 2e-5, "err": err})
    return checks


def schedule_checks():
    """The EP overlaps in the compiled forward's HLO (see `pallas_moe.nn.overlap_check`).

    XLA:CPU has synchronous collectives, so what is checked is the dependency graph: the
    shared MLP and the dispatch collectives do not depend on each other, and neither do
    chunk c's combine collectives and chunk c+1's down-proj. Two hand-built programs whose
    overlap is absent (the "shared" MLP reads the dispatched rows; chunk 1's down-proj reads
    chunk 0's combine) must fail the same checks.
    """
    from jax.sharding import PartitionSpec as Spec

    from pallas_moe.nn.expert_parallel import DISPATCH_SCOPE, SHARED_SCOPE, combine_scope
    from pallas_moe.nn.overlap_check import ep_overlap_report
    from pallas_moe.ops.row_chunks import down_proj_scope

    checks = []
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
    forward = nnx.jit(lambda layer, x: layer(x)[0])

    def report_of(ep):
        return ep_overlap_report(forward.lower(build("topk", True, ep), inputs(True)).compile().as_text())

    rep = report_of(pm.nn.ExpertParallel(mesh, dispatch="emulated_ragged_all_to_all", **CHUNKED))
    checks.append({
        "check": "schedule_chunked", "report": rep,
        "ok": rep["shared"]["independent"] and rep["num_chunks"] == 3 and len(rep["chunks"]) == 2
        and all(c["independent"] for c in rep["chunks"]),
    })
    rep = report_of(pm.nn.ExpertParallel(mesh, dispatch="all_gather"))
    checks.append({
        "check": "schedule_all_gather", "report": rep,
        "ok": rep["shared"]["independent"] and rep["num_chunks"] == 0,
    })
    rep = report_of(pm.nn.ExpertParallel(mesh, dispatch="all_gather", **CHUNKED))
    checks.append({
        "check": "schedule_all_gather_chunked", "report": rep,
        "ok": rep["shared"]["independent"] and rep["num_chunks"] == 3 and len(rep["chunks"]) == 2
        and all(c["independent"] for c in rep["chunks"]),
    })

    # Negative controls: the same scopes, with the overlap made impossible.
    mesh1 = Mesh(np.array(jax.devices()[:8]), ("expert",))
    w = jnp.ones((D, D))

    def no_shared_overlap(x):
        with jax.named_scope(DISPATCH_SCOPE):
            gathered = jax.lax.all_gather(x, "expert", tiled=True)  # [8*T_l, D]
        with jax.named_scope(SHARED_SCOPE):
            shared = jnp.tanh((x + gathered[: x.shape[0]]) @ w) @ w  # reads the dispatch
        return shared + gathered[: x.shape[0]]

    def no_chunk_overlap(x):
        with jax.named_scope(down_proj_scope(0)):
            y0 = jnp.tanh(x @ w)
        with jax.named_scope(combine_scope(0)):
            y0 = jax.lax.all_gather(y0, "expert", tiled=True)[: x.shape[0]]
        with jax.named_scope(down_proj_scope(1)):
            y1 = jnp.tanh((x + y0) @ w)  # waits for chunk 0's combine
        with jax.named_scope(combine_scope(1)):
            y1 = jax.lax.all_gather(y1, "expert", tiled=True)[: x.shape[0]]
        return y0 + y1

    for name, fn, part in (("negative_shared", no_shared_overlap, "shared"),
                           ("negative_chunks", no_chunk_overlap, "chunks")):
        mapped = jax.jit(jax.shard_map(fn, mesh=mesh1, in_specs=Spec("expert"), out_specs=Spec("expert")))
        rep = ep_overlap_report(mapped.lower(jnp.ones((64, D))).compile().as_text())
        found = rep["shared"] if part == "shared" else (rep["chunks"][0] if rep["chunks"] else None)
        checks.append({"check": name, "report": rep, "ok": found is not None and not found["independent"]})
    return checks


def signal_primitives_check():
    """What overlap="signal" would build on: JAX 0.11.2's Mosaic GPU lowers, for Hopper and
    inside shard_map on 8 devices of one process, a kernel that TMA-stores a block into a
    peer device's output (`plgpu.remote_ref`) and raises the peer's semaphore
    (`pl.semaphore_signal(..., device_id=peer)`, then `pl.semaphore_wait`), with the peers'
    addresses from XLA's collective metadata. Interpret mode has neither primitive, so only
    the lowering can be checked without GPUs (docs/ep_overlap.md, section 6)."""
    from jax.sharding import PartitionSpec as Spec

    from tests.remote_block_kernel import send_block

    rows, width = 128, 128
    mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))

    def step(y):
        peer = ((jax.lax.axis_index("expert") + 1) % 8).astype(jnp.int32).reshape(1)
        return send_block(y, peer)

    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=Spec("expert"), out_specs=Spec("expert"), check_vma=False))
    try:
        text = fn.trace(jnp.ones((8 * rows, width), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as err:  # noqa: BLE001 - the record says what failed
        return [{"check": "signal_primitives_lower", "ok": False, "error": f"{type(err).__name__}: {err}"[:500]}]
    return [{
        "check": "signal_primitives_lower",
        "ok": "uses_xla_collective_metadata = true" in text and 'xla_replica_ids = "0,1,2,3,4,5,6,7"' in text,
    }]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", choices=("fast", "fast_extra", "chunked", "layouts", "schedule", "full"),
                        default="fast")
    args = parser.parse_args(argv)
    assert len(jax.devices()) >= 8, jax.devices()
    # "fast", "chunked", "layouts" and "schedule" split the default checks into processes
    # (pytest-xdist runs them side by side); "fast_extra" is their opt-in rest.
    cases = {"fast": FAST, "fast_extra": FAST_EXTRA, "chunked": FAST_CHUNKED, "layouts": [],
             "schedule": [], "full": list(full_cases())}[args.cases]
    checks = {
        "fast": error_checks, "fast_extra": eager_check, "chunked": lambda: [],
        "layouts": lambda: scan_and_capacity_checks() + gpu_path_vma_checks(), "schedule": lambda: schedule_checks() + signal_primitives_check(),
    }.get(args.cases)
    checks = checks() if checks else (
        error_checks() + eager_check() + scan_and_capacity_checks() + gpu_path_vma_checks() + schedule_checks()
        + signal_primitives_check()
    )
    failed = 0
    for result in checks:
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    for case in cases:
        result = run_case(*case)
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
