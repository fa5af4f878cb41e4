"""GPU-only checks of the real `mosaic` backend (run on a Hopper machine: `pytest -m gpu`).

Forward and gradients through `pm.moe_ffn(backend="mosaic")` against the `xla` backend on
fresh random data, for top-K and token-rounding plans, plus run-to-run bitwise determinism.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm
from pallas_moe.kernels import KernelConfig

on_hopper = jax.devices()[0].platform == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not on_hopper, reason="needs a Hopper GPU")]

ROUTERS = {
    "topk": lambda l: pm.routing.topk_plan(l, 4),
    "token_rounding": lambda l: pm.routing.token_rounding_plan(l, 4, tile=128, rounding="nearest"),
}


def rel_err(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("seed, approx_math", [(0, True), (1, True), (2, False)])
def test_mosaic_matches_xla(router, seed, approx_math):
    """The defaults (config None) take the SwiGLU kernels' exp from `ex2.approx`;
    `KernelConfig.for_shape(..., approx_math=False)` the full-precision exp: same bounds."""
    d, n = 512, 256
    config = None if approx_math else KernelConfig.for_shape(d, n, approx_math=False)
    _check_mosaic_matches_xla(router, seed, config, (4096, d, n, 16))


def test_mosaic_matches_xla_at_d_2048():
    """The defaults above the ping-pong up-proj's widths (the persistent split-M up-proj,
    128-row items, beside dH's 64-row tiles; at n = 768 the down-proj's split-M 128 x 256
    items, session 61)."""
    _check_mosaic_matches_xla("topk", 3, None, (4096, 2048, 768, 16))


def test_mosaic_matches_xla_with_wide_experts_at_d_1536():
    """The defaults at the ping-pong's widths with wide experts (on an H200, from n =
    SPLIT_M_UP_MIN_N on, the persistent split-M up-proj; elsewhere the ping-pong; the
    down-proj's split-M 128 x 256 items from n = SPLIT_M_DOWN_MIN_N on, session 61)."""
    _check_mosaic_matches_xla("topk", 4, None, (4096, 1536, 1024, 8))


def _check_mosaic_matches_xla(router, seed, config, dims):
    """Forward and gradients of `backend="mosaic"` against `xla` on fresh random data,
    then a bitwise repeat. dims: (T, d, n, E)."""
    num_tokens, d, n, num_experts = dims
    k = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(k[0], (num_tokens, num_experts)).at[:, :2].add(1.0)  # some skew
    x = jax.random.normal(k[1], (num_tokens, d), jnp.bfloat16)
    w1 = (jax.random.normal(k[2], (num_experts, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k[3], (num_experts, n, d)) * n**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(k[4], (num_tokens, d), jnp.float32)

    def step(backend):
        def loss(logits, x, w1, w2):
            out = pm.moe_ffn(x, ROUTERS[router](logits), w1, w2, backend=backend,
                             config=config if backend == "mosaic" else None)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))

    (_, out), grads = step("mosaic")(logits, x, w1, w2)
    (_, ref_out), ref_grads = step("xla")(logits, x, w1, w2)
    assert rel_err(out, ref_out) < 1e-2
    for name, g, r in zip(["logits", "x", "w_gate_up", "w_down"], grads, ref_grads):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
        assert rel_err(g, r) < 2e-2, name
    (_, again), grads_again = step("mosaic")(logits, x, w1, w2)
    assert bool(jnp.array_equal(out, again)), "the forward must be bitwise reproducible"
    for g, h in zip(grads, grads_again):
        assert bool(jnp.array_equal(g, h)), "gradients must be bitwise reproducible"


def _poison(nbytes):
    """Frees a NaN-filled buffer so fresh device outputs start dirty (unwritten rows show)."""
    junk = jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16)
    junk.block_until_ready()
    del junk


@pytest.mark.parametrize(
    "shape, cfg",
    [
        ((2048, 512, 256, 8, 4), dict(block_m=64, block_n=128, num_stages=3, num_consumers=2)),
        ((1024, 256, 128, 5, 2), dict(block_m=64, block_n=128, num_stages=4, num_consumers=1)),
    ],
)
@pytest.mark.parametrize("completion", ["mbarrier", "wait_group"])
def test_up_proj_cp_async_gather_matches_reference(shape, cfg, completion):
    """The cp.async row gather (compiled only) against the jnp reference, poisoned outputs,
    with either way of publishing a stage (`_common.GATHER_COMPLETIONS`), in the one-CTA-per-
    tile kernel (64-row tiles). Its 128-row split-M form is the persistent kernel's now
    (session 41); `test_up_proj_pingpong_equals_cooperative` checks those items."""
    from pallas_moe.kernels.up_proj import UpProjConfig, up_proj

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(T + d), 4)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[2], (T, E)).at[:, 0].add(2.0)  # skew: expert 0 is large
    plan = pm.routing.topk_plan(logits, K)
    config = UpProjConfig(gather="cp_async", gather_completion=completion, **cfg)
    f = jax.jit(lambda x, t, g, w: up_proj(x, t, g, w, config=config))
    _poison(plan.capacity * 3 * n * 2)
    h, a = f(x, plan.token_ids, plan.group_sizes, w1)
    # The reference per expert, H = X[tok] @ W1[e] (fp32 accumulate, bf16) and A = SwiGLU(H):
    # `up_proj_reference` gathers a [P, d, 2n] weight copy, which does not fit at these sizes.
    starts = [0, *jnp.cumsum(plan.group_sizes).tolist()]
    h_ref = jnp.concatenate([
        jnp.dot(x[plan.token_ids[starts[e]:starts[e + 1]]], w1[e],
                preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        for e in range(E)
    ])
    g, u = h_ref[:, :n].astype(jnp.float32), h_ref[:, n:].astype(jnp.float32)
    a_ref = (g * jax.nn.sigmoid(g) * u).astype(jnp.bfloat16)
    rows = int(plan.num_rows)
    assert rel_err(h[:rows], h_ref[:rows]) < 1e-2
    assert rel_err(a[:rows], a_ref[:rows]) < 2e-2
    h2, a2 = f(x, plan.token_ids, plan.group_sizes, w1)
    assert bool(jnp.array_equal(h, h2)) and bool(jnp.array_equal(a[:rows], a2[:rows]))


@pytest.mark.parametrize(
    "shape, stages, completion, with_bias",
    [((2048, 512, 256, 8, 4), 5, "wait_group", False),
     ((2048, 512, 256, 8, 4), 4, "mbarrier", True),
     ((3000, 1536, 512, 16, 8), 5, "mbarrier", False),
     ((1024, 256, 128, 5, 2), 3, "wait_group", True),
     ((3000, 4096, 512, 16, 8), 5, "wait_group", False)],
)
def test_up_proj_pingpong_equals_cooperative(shape, stages, completion, with_bias):
    """The persistent ping-pong up-proj (`UpProjConfig.pingpong_ctas`) against the jnp
    reference and bit for bit against the cooperative kernel, poisoned outputs, skewed
    routing; inference mode writes the same A; 8 CTAs make every CTA walk many items; one
    N = 256 wgmma per K step (`fused_gate_up`, on W1 interleaved per block_n,
    `gate_up_blocks=128`, the only layout it reads) changes no bit, with 132 CTAs and with
    8 in inference mode;
    split-M tiles with the fused wgmma on interleaved W1 give the same bits too."""
    from pallas_moe.kernels.up_proj import UpProjConfig, interleave_gate_up, up_proj

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(T + d + n), 5)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[2], (T, E)).at[:, 0].add(2.0)  # skew: expert 0 is large
    plan = pm.routing.topk_plan(logits, K)
    bias = (0.5 * jax.random.normal(ks[3], (E, 2 * n))).astype(jnp.bfloat16) if with_bias else None
    coop = UpProjConfig(block_n=128, num_stages=3, num_consumers=2 if n % 256 == 0 else 1,
                        gather="cp_async")
    rows = int(plan.num_rows)
    want_h, want_a = jax.jit(lambda x, t, g, w: up_proj(x, t, g, w, config=coop, bias=bias))(
        x, plan.token_ids, plan.group_sizes, w1)
    starts = [0, *jnp.cumsum(plan.group_sizes).tolist()]
    h_ref = jnp.concatenate([
        (jnp.dot(x[plan.token_ids[starts[e]:starts[e + 1]]], w1[e],
                 preferred_element_type=jnp.float32)
         + (0.0 if bias is None else bias[e].astype(jnp.float32))).astype(jnp.bfloat16)
        for e in range(E)
    ])
    assert rel_err(want_h[:rows], h_ref[:rows]) < 1e-2
    w1_interleaved = interleave_gate_up(w1, 128)
    for ctas, inference, fused in ((132, False, False), (8, False, False), (132, True, False),
                                   (8, True, True), (132, False, True)):
        config = UpProjConfig(block_n=128, num_stages=stages, num_consumers=2, gather="cp_async",
                              gather_completion=completion, pingpong_ctas=ctas,
                              fused_gate_up=fused)
        f = jax.jit(lambda x, t, g, w, c=config, i=inference, b=128 if fused else 0: up_proj(
            x, t, g, w, config=c, bias=bias, inference=i, gate_up_blocks=b))
        _poison(plan.capacity * 3 * n * 2)
        h, a = f(x, plan.token_ids, plan.group_sizes, w1_interleaved if fused else w1)
        assert bool(jnp.array_equal(a[:rows], want_a[:rows])), (ctas, inference, fused)
        if not inference:
            assert bool(jnp.array_equal(h[:rows], want_h[:rows])), (ctas, fused)
    # Split-M tiles (128 rows, the weight stage shared) as persistent CTAs (`pingpong_ctas`
    # with block_m=128): both consumers take every item; W1's halves with two wgmmas, or one
    # N = 256 wgmma per consumer on interleaved W1; 8 CTAs walk many items; inference writes
    # the same A.
    split_m = UpProjConfig(block_m=128, block_n=128, num_stages=4, num_consumers=2,
                           gather="cp_async", gather_completion=completion)
    for ctas, st, inference, fused in ((132, 4, False, False), (132, 4, False, True),
                                       (8, 3, True, True)):
        config = dataclasses.replace(split_m, num_stages=st, pingpong_ctas=ctas,
                                     fused_gate_up=fused)
        _poison(plan.capacity * 3 * n * 2)
        h, a = jax.jit(lambda x, t, g, w, c=config, i=inference, b=128 if fused else 0: up_proj(
            x, t, g, w, config=c, bias=bias, inference=i, gate_up_blocks=b))(
            x, plan.token_ids, plan.group_sizes, w1_interleaved if fused else w1)
        assert bool(jnp.array_equal(a[:rows], want_a[:rows])), ("persistent split-M", ctas)
        if not inference:
            assert bool(jnp.array_equal(h[:rows], want_h[:rows])), ("persistent split-M", ctas)


def _assert_up_proj_configs_write_the_same_bits(shape, seed, reference, cases):
    """The up-proj under `reference` (an `UpProjConfig`) against the jnp reference, then every
    `(name, config, inference)` of `cases` bitwise against it (A; H unless inference): an
    expert bias, skewed routing with an empty expert (expert 3), poisoned outputs, fresh
    random data of `shape` (T, d, n, E, K)."""
    from pallas_moe.kernels.up_proj import up_proj

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[2], (T, E)).at[:, 0].add(2.0).at[:, 3].add(-1e4)
    plan = pm.routing.topk_plan(logits, K)
    assert int(plan.group_sizes[3]) == 0
    bias = (0.5 * jax.random.normal(ks[3], (E, 2 * n))).astype(jnp.bfloat16)
    rows = int(plan.num_rows)

    def run(config, inference=False):
        _poison(plan.capacity * 3 * n * 2)
        return jax.jit(lambda x, t, g, w: up_proj(x, t, g, w, config=config, bias=bias,
                                                  inference=inference))(
            x, plan.token_ids, plan.group_sizes, w1)

    want_h, want_a = run(reference)
    starts = [0, *jnp.cumsum(plan.group_sizes).tolist()]
    h_ref = jnp.concatenate([
        (jnp.dot(x[plan.token_ids[starts[e]:starts[e + 1]]], w1[e],
                 preferred_element_type=jnp.float32)
         + bias[e].astype(jnp.float32)).astype(jnp.bfloat16)
        for e in range(E)
    ])
    assert rel_err(want_h[:rows], h_ref[:rows]) < 1e-2
    for name, config, inference in cases:
        h, a = run(config, inference)
        assert bool(jnp.array_equal(a[:rows], want_a[:rows])), name
        if not inference:
            assert bool(jnp.array_equal(h[:rows], want_h[:rows])), name


def test_up_proj_192_row_split_m_equals_cooperative():
    """At gpt-oss's widths (d = n = 2880: 128 does not divide n) the default up-proj is
    split-M items of 192 rows and 64 columns that three consumers share (session 49), on
    clusters of two CTAs (session 50). It
    writes the bits of the cooperative kernel (one consumer of 64 columns, the default
    before session 48) and of 128-row split-M items: 132 and 8 CTAs (each walks many
    items), inference mode's A, items whose second or third consumer has no rows."""
    from pallas_moe.kernels.moe_forward import ForwardConfig, split_m_up_config
    from pallas_moe.kernels.up_proj import UpProjConfig

    shape = (3000, 2880, 2880, 16, 4)
    default = ForwardConfig.for_shape(2880, 2880).up
    assert (default.block_m, default.block_n, default.num_consumers) == (192, 64, 3), default
    coop = UpProjConfig(block_n=64, num_stages=4, num_consumers=1, gather="cp_async")
    split_128 = dataclasses.replace(split_m_up_config(132, 2880, rows=128), gather="cp_async")
    _assert_up_proj_configs_write_the_same_bits(shape, sum(shape[:3]), coop, [
        ("default", default, False),
        ("8 CTAs", dataclasses.replace(default, pingpong_ctas=8), False),
        ("inference", default, True), ("128 rows", split_128, False)])


@pytest.mark.parametrize("shape", [(6000, 4096, 512, 16, 4), (3000, 2880, 2880, 16, 4)],
                         ids=["30b_widths", "gpt_oss_widths"])
def test_up_proj_cluster_split_m_writes_the_default_bits(shape):
    """Split-M items on clusters of two CTAs (`cluster_m=2`: each K step's weight tiles
    multicast to both CTAs, a slot refilled once both CTAs' consumers released it; the
    default at these widths since session 50) write the bits of the same items on single
    CTAs: 132 and 8 CTAs (4 clusters walk many items), inference's A, cluster items whose
    second CTA has few or no rows."""
    from pallas_moe.kernels.moe_forward import ForwardConfig

    T, d, n, E, K = shape
    cluster = ForwardConfig.for_shape(d, n).up
    assert cluster.pingpong_ctas and cluster.block_m > 64 and cluster.cluster_m == 2, cluster
    single = dataclasses.replace(cluster, cluster_m=1)
    _assert_up_proj_configs_write_the_same_bits(shape, T + d + n + 2, single, [
        ("132 CTAs", cluster, False),
        ("8 CTAs", dataclasses.replace(cluster, pingpong_ctas=8), False),
        ("inference", cluster, True)])


@pytest.mark.parametrize("shape,h100_lag", [
    ((6000, 4096, 512, 16, 4), 1), ((4000, 2048, 768, 16, 4), 1), ((4000, 1536, 256, 16, 4), 1),
    ((3000, 2880, 2880, 16, 4), 0)],
    ids=["30b_widths", "qwen3_widths", "7b_widths", "gpt_oss_widths"])
def test_up_proj_wgmma_lag_0_writes_the_default_bits(shape, h100_lag):
    """Each width's default up-proj (split-M on clusters at 30B and gpt-oss's, split-M at
    Qwen3-30B-A3B's, the ping-pong at 7B's) with each slot released one K step later or
    earlier than its default (`wgmma_lag` 1 or 0, session 51; lag 0 is the H100's default
    for gpt-oss's 192-row items since session 54, an H200 keeps 1) writes the default's
    bits: 132 and 8 CTAs, inference's A."""
    from pallas_moe.kernels.moe_forward import ForwardConfig, default_device_kind

    T, d, n, E, K = shape
    default = ForwardConfig.for_shape(d, n).up
    default_lag = 1 if "H200" in default_device_kind() else h100_lag
    assert default.pingpong_ctas and default.wgmma_lag == default_lag, default
    other = dataclasses.replace(default, wgmma_lag=1 - default_lag)
    _assert_up_proj_configs_write_the_same_bits(shape, T + d + n + 5, default, [
        ("132 CTAs", other, False),
        ("8 CTAs", dataclasses.replace(other, pingpong_ctas=8), False),
        ("inference", other, True)])


@pytest.mark.parametrize("num_tokens, d", [(1, 2048), (8, 2048), (64, 2048), (128, 2048),
                                           (2048, 2048), (24576, 1536)])
def test_aggregate_writes_the_bits_of_its_previous_form(num_tokens, d):
    """The aggregation as session 66 made it (rows loaded in groups, `rows_in_flight`; at
    decode sizes one token per CTA, `resident_ctas`) writes the bits of its previous form
    (one row at a time, 4 tokens per CTA), weighted (the forward) and unweighted (dX), and
    matches the jnp reference: Qwen3-30B-A3B widths at T = 1 to 2048 and the 7B training
    shape (24576 tokens, d = 1536), E = 128, K = 8, poisoned outputs, fresh random data."""
    from pallas_moe.kernels.aggregate import aggregate, token_blocks
    from pallas_moe.kernels.moe_forward import ForwardConfig
    from pallas_moe.kernels.reference import aggregate_reference

    E, K = 128, 8
    ks = jax.random.split(jax.random.key(num_tokens + 66), 2)
    plan = pm.routing.topk_plan(jax.random.normal(ks[0], (num_tokens, E)), K)
    y = jax.random.normal(ks[1], (plan.capacity, d), jnp.bfloat16)
    new = ForwardConfig.for_shape(d, 768).aggregate
    old = dataclasses.replace(new, resident_ctas=0, rows_in_flight=1)
    assert new.resident_ctas > 0 and new.rows_in_flight > 1
    if num_tokens <= 2048:  # fewer tokens per CTA than configured (2048 tokens: two)
        assert token_blocks(num_tokens, new.block_t, d // new.block_d,
                            new.resident_ctas)[0] < new.block_t
    for scores in (plan.scores, None):
        outs = []
        for config in (new, old):
            _poison(num_tokens * d * 2 * 4)
            outs.append(np.asarray(jax.jit(lambda y, r, o, s, c=config: aggregate(
                y, r, o, s, config=c))(y, plan.rows_by_token, plan.token_row_offsets, scores),
                np.float32))
        assert np.array_equal(outs[0], outs[1]), (num_tokens, scores is None)
        want = aggregate_reference(y, plan.rows_by_token, plan.token_row_offsets, scores)
        assert rel_err(outs[0], want) < 1e-2, (num_tokens, scores is None)


def _assert_grouped_gemm_variants_write_the_default_bits(shape, variants):
    """The down-proj (with an expert bias) and dX~ under each width's default config and
    under `variants(default)`: every variant bitwise the default, the default against numpy
    on the two largest experts; skewed routing with an empty expert, poisoned outputs."""
    from pallas_moe.kernels.down_proj import down_proj
    from pallas_moe.kernels.dx import dx_rows
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(T + d + n + 3), 6)
    logits = jax.random.normal(ks[0], (T, E)).at[:, 0].add(2.0).at[:, 3].add(-1e4)
    plan = pm.routing.topk_plan(logits, K)
    assert int(plan.group_sizes[3]) == 0
    P, rows = plan.capacity, int(plan.num_rows)
    a = jax.random.normal(ks[1], (P, n), jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    b2 = (0.5 * jax.random.normal(ks[3], (E, d))).astype(jnp.bfloat16)
    dh = jax.random.normal(ks[4], (P, 2 * n), jnp.bfloat16)
    w1 = (jax.random.normal(ks[5], (E, d, 2 * n)) * (2 * n)**-0.5).astype(jnp.bfloat16)
    lo = np.concatenate([[0], np.cumsum(np.asarray(plan.group_sizes))])
    for name, default, run, ref in (
            ("down", ForwardConfig.for_shape(d, n).down,
             lambda c: down_proj(a, plan.group_sizes, w2, config=c, bias=b2),
             lambda e: np.asarray(a[lo[e]:lo[e + 1]], np.float32) @ np.asarray(w2[e], np.float32)
             + np.asarray(b2[e], np.float32)),
            ("dx", BackwardConfig.for_shape(d, n).dx,
             lambda c: dx_rows(dh, plan.group_sizes, w1, capacity=P, config=c),
             lambda e: np.asarray(dh[lo[e]:lo[e + 1]], np.float32)
             @ np.asarray(w1[e], np.float32).T)):
        outs = []
        for config in (default, *variants(default)):
            _poison(P * d * 2)
            outs.append(np.asarray(run(config), np.float32)[:rows])
        for i, out in enumerate(outs[1:]):
            assert np.array_equal(outs[0], out), (name, i)
        for e in (0, 1):  # the two largest experts against numpy
            assert rel_err(outs[0][lo[e]:lo[e + 1]], ref(e)) < 1e-2, (name, e)


@pytest.mark.parametrize("shape", [(32768, 128), (16384, 512), (1000, 60), (1000, 4)])
def test_router_softmax_is_one_program(shape):
    """On the GPU `routing.formulas.softmax` is the Pallas kernel `kernels.softmax_rows`:
    close to `jax.nn.softmax`, and bitwise the same alone, inside a top-K plan's program
    (its scores are gathered probabilities) and beside consumers XLA would fuse."""
    from pallas_moe.routing import formulas

    T, E = shape
    logits = jax.random.normal(jax.random.key(T + E), (T, E)) * 3
    probs = jax.jit(formulas.softmax)(logits)
    assert float(jnp.max(jnp.abs(probs - jax.nn.softmax(logits, axis=-1)))) <= 1e-6
    fused = jax.jit(lambda l: (formulas.softmax(l) * 2.0, jnp.where(l > 0, formulas.softmax(l), -1.0)))(logits)
    assert bool(jnp.array_equal(fused[0], probs * 2.0)) and bool(jnp.array_equal(fused[1], jnp.where(logits > 0, probs, -1.0)))
    if E >= 8:
        plan = jax.jit(lambda l: pm.routing.topk_plan(l, 4, impl="dense"))(logits)
        rows = jnp.arange(plan.capacity) < plan.num_rows
        want = jnp.where(rows, probs[plan.token_ids, plan.expert_ids.clip(0, E - 1)], 0.0)
        assert bool(jnp.array_equal(plan.scores, want)), "the plan's scores are the probabilities"


@pytest.mark.parametrize("shape", [(32768, 128, 8), (16384, 512, 10), (1000, 60, 4), (7, 8, 8)])
@pytest.mark.parametrize("score", ["softmax_topk", "sigmoid", "topk_softmax"])
def test_routing_kernel_equals_reference(shape, score):
    T, E, K = shape
    logits = jax.random.normal(jax.random.key(T * E + K), (T, E))
    logits = logits.at[: T // 3].set(jnp.round(logits[: T // 3] * 2) / 2)  # ties
    bias = jax.random.normal(jax.random.key(1), (E,)) * 0.1 if score == "sigmoid" else None
    ref = pm.routing.topk_plan(logits, K, score=score, bias=bias, impl="dense")
    got = jax.jit(lambda l: pm.routing.topk_plan(l, K, score=score, bias=bias, impl="kernel"))(logits)
    for field in ("token_ids", "group_sizes", "rows_by_token", "token_row_offsets", "is_token_choice"):
        assert bool(jnp.array_equal(getattr(got, field), getattr(ref, field))), field
    assert float(jnp.max(jnp.abs(got.scores - ref.scores))) <= 1e-6


@pytest.mark.parametrize("shape", [(1, 128, 8), (7, 8, 8), (32, 128, 8), (32, 256, 16), (5, 60, 4)])
@pytest.mark.parametrize("score", ["softmax_topk", "sigmoid", "topk_softmax"])
def test_small_batch_routing_kernel_equals_reference(shape, score):
    """`routing.kernels.topk_small` (one program, session 40; the default up to
    `SMALL_BATCH_DEFAULT` tokens, up to 32 through `small_batch_routing`) compiled: the dense plan, every field and the gradient to the
    logits bitwise."""
    from pallas_moe.routing import kernels

    T, E, K = shape
    logits = jax.random.normal(jax.random.key(T * E + K + 1), (T, E))
    logits = logits.at[: T // 3].set(jnp.round(logits[: T // 3] * 2) / 2)  # ties
    bias = jax.random.normal(jax.random.key(1), (E,)) * 0.1 if score == "sigmoid" else None
    cot = jax.random.normal(jax.random.key(2), (T * K,))

    def plan_and_grad(impl):
        def f(l):
            plan = pm.routing.topk_plan(l, K, score=score, bias=bias, renormalize=score == "sigmoid",
                                        impl=impl)
            return jnp.sum(plan.scores * cot), plan
        return jax.jit(jax.value_and_grad(f, has_aux=True))

    (_, ref), ref_grad = plan_and_grad("dense")(logits)
    with kernels.small_batch_routing():
        fn = plan_and_grad("kernel")
        assert "moe_topk_small" in str(jax.make_jaxpr(fn)(logits))
        (_, got), grad = fn(logits)
    for field in ("token_ids", "scores", "group_sizes", "rows_by_token", "token_row_offsets",
                  "is_token_choice"):
        assert bool(jnp.array_equal(getattr(got, field), getattr(ref, field))), field
    assert bool(jnp.array_equal(grad, ref_grad)), "gradient to the logits"


@pytest.mark.parametrize("shape", [(32768, 128, 8), (16384, 512, 10), (1000, 60, 4)])
@pytest.mark.parametrize("rounding, score", [
    ("nearest", "softmax_topk"), ("up", "sigmoid"), ("down", "topk_softmax"),
    ("balance", "softmax_topk"), ("stochastic", "sigmoid"),
])
def test_token_rounding_kernel_equals_reference(shape, rounding, score):
    """The fast token-rounding plan (routing kernel + two-level selection) is the dense one, bitwise."""
    T, E, K = shape
    logits = jax.random.normal(jax.random.key(T * E + K), (T, E))
    logits = logits.at[: T // 3].set(jnp.round(logits[: T // 3] * 2) / 2)  # ties
    bias = jax.random.normal(jax.random.key(1), (E,)) * 0.1 if score == "sigmoid" else None
    options = dict(tile=128, rounding=rounding, key=jax.random.key(2), score=score, bias=bias,
                   renormalize=rounding == "balance")
    ref = jax.jit(lambda l: pm.routing.token_rounding_plan(l, K, impl="dense", **options))(logits)
    got = jax.jit(lambda l: pm.routing.token_rounding_plan(l, K, impl="kernel", **options))(logits)
    for field in ("token_ids", "scores", "group_sizes", "rows_by_token", "token_row_offsets",
                  "is_token_choice"):
        assert bool(jnp.array_equal(getattr(got, field), getattr(ref, field))), field


@pytest.mark.parametrize("shape", [(128, 2048, 127), (512, 2032, 127), (128, 16384, 127), (5, 7, 3)])
def test_select_largest_kernel_matches_reference(shape):
    """The token-rounding selection kernel on fresh keys (heavy ties, full-range keys,
    non-candidates), poisoned output, against a numpy ranking; both tie rules."""
    import numpy as np

    from pallas_moe.routing import kernels

    R, L, M = shape
    rng = np.random.default_rng(R * L + M)
    keys = rng.integers(-3, 3, size=(R, L)).astype(np.int32)
    wide = rng.random(size=(R, L)) < 0.5
    keys[wide] = rng.integers(-2**31, 2**31 - 1, size=int(wide.sum()), dtype=np.int64).astype(np.int32)
    keys[rng.random(size=(R, L)) < 0.2] = -(2**31)
    count = np.minimum(rng.integers(0, M + 1, size=R), min(L, M)).astype(np.int32)
    high = rng.random(size=R) < 0.5
    f = jax.jit(lambda k, c, h: kernels.select_largest(k, c, h, max_count=M))
    _poison(R * M * 4 * 4)
    got = np.asarray(f(jnp.asarray(keys), jnp.asarray(count), jnp.asarray(high)))
    idx = np.arange(L)
    for r in range(R):
        order = np.lexsort((-idx if high[r] else idx, -keys[r].astype(np.int64)))[: count[r]]
        want = np.concatenate([np.sort(order), np.full(M - count[r], L)])
        assert np.array_equal(got[r], want), r
    again = np.asarray(f(jnp.asarray(keys), jnp.asarray(count), jnp.asarray(high)))
    assert np.array_equal(got, again)


@pytest.mark.parametrize("shape", [(32768, 128, 8), (16384, 512, 10), (4096, 128, 8), (1000, 60, 4)])
@pytest.mark.parametrize("rounding, score", [
    ("nearest", "softmax_topk"), ("up", "sigmoid"), ("down", "topk_softmax"), ("stochastic", "softmax_topk"),
    ("balance", "sigmoid"),
])
def test_selection_kernel_plan_equals_previous_fast_path_and_dense(shape, rounding, score):
    """The kernel path with the selection kernel against the same path with the `lax.top_k`
    selection and against dense: plans and jitted gradients to the logits bitwise."""
    from pallas_moe.routing.token_rounding import token_rounding_plan_fast

    T, E, K = shape
    logits = jax.random.normal(jax.random.key(T + E + K + 7), (T, E)).at[:, : E // 4].add(1.0)  # skew
    logits = logits.at[: T // 3].set(jnp.round(logits[: T // 3] * 2) / 2)  # ties
    bias = jax.random.normal(jax.random.key(3), (E,)) * 0.1 if score == "sigmoid" else None
    options = dict(tile=128, rounding=rounding, key=jax.random.key(4), score=score, bias=bias,
                   renormalize=rounding in ("up", "balance"))
    weights = jnp.arange(T * K + E * 128, dtype=jnp.float32) % 7 - 3.0
    builds = {
        "dense": lambda l: pm.routing.token_rounding_plan(l, K, impl="dense", **options),
        "kernel": lambda l: pm.routing.token_rounding_plan(l, K, impl="kernel", **options),
        "top_k": lambda l: token_rounding_plan_fast(l, K, impl="kernel", round_by_kernels=False, **options)[0],
    }
    results = {}
    for name, build in builds.items():
        grad_fn = jax.grad(lambda l, b=build: jnp.sum(b(l).scores * weights))
        results[name] = (jax.jit(build)(logits), jax.jit(grad_fn)(logits))
    want, want_grad = results["dense"]
    for name in ("kernel", "top_k"):
        got, got_grad = results[name]
        for field in ("token_ids", "scores", "group_sizes", "rows_by_token", "token_row_offsets",
                      "is_token_choice"):
            assert bool(jnp.array_equal(getattr(got, field), getattr(want, field))), (name, field)
        assert bool(jnp.array_equal(got_grad, want_grad)), (name, "gradient to the logits")


@pytest.mark.parametrize("rounding", ["nearest", "balance"])
def test_module_routes_token_rounding_on_the_fast_path(rounding):
    """`nn.functional.route` (what `pm.nn.MoE` calls) on the GPU: impl "auto" (the kernels)
    against "dense": plans, counts and jitted gradients (scores and aux loss) bitwise."""
    from pallas_moe.nn import functional as F

    T, E, K = 24576, 128, 8
    cfg = F.RouterConfig(num_experts=E, top_k=K, routing="token_rounding", tile=128, rounding=rounding)
    logits = jax.random.normal(jax.random.key(11), (T, E)).at[:, :8].add(1.5)
    weights = jnp.arange(cfg.capacity(T), dtype=jnp.float32) % 7 - 3.0

    def loss(logits, impl):
        plan, counts = F.route(logits, cfg, impl=impl)
        aux = F.finish_aux(F.router_sums(logits, counts), cfg)
        return jnp.sum(plan.scores * weights) + aux["loss"], (plan, counts)

    run = jax.jit(jax.grad(loss, has_aux=True), static_argnames="impl")
    want_grad, (want, want_counts) = run(logits, impl="dense")
    got_grad, (got, got_counts) = run(logits, impl="auto")
    for field in ("token_ids", "scores", "group_sizes", "rows_by_token", "token_row_offsets", "is_token_choice"):
        assert bool(jnp.array_equal(getattr(got, field), getattr(want, field))), field
    for name in ("counts", "tc_counts", "kept_tc_counts"):
        assert bool(jnp.array_equal(got_counts[name], want_counts[name])), name
    assert bool(jnp.array_equal(got_grad, want_grad)), "gradient to the logits"


@pytest.mark.parametrize("shape", [(4096, 1536, 256, 32, 8), (2048, 4096, 512, 16, 4), (1000, 512, 256, 8, 2)])
def test_backward_cp_async_matches_reference(shape):
    """dH and both weight gradients with the cp.async row gather, against the jnp backward
    (dH publishes a stage by the lagged wait_group only since session 64, the weight
    gradients by mbarrier only since session 63)."""
    from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward
    from pallas_moe.ops.minimal_backward import moe_ffn_backward

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(d + n), 6)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    plan = pm.routing.topk_plan(jax.random.normal(ks[3], (T, E)).at[:, 1].add(1.5), K)
    h = jax.random.normal(ks[4], (plan.capacity, 2 * n), jnp.bfloat16)
    go = jax.random.normal(ks[5], (T, d), jnp.bfloat16)
    config = BackwardConfig.for_shape(d, n, gather="cp_async")
    f = jax.jit(lambda *a: moe_backward(*a, config=config))
    _poison(plan.capacity * (5 * n + d) * 2)
    got = f(x, h, plan, w1, w2, go)
    ref = jax.jit(moe_ffn_backward)(x, h, plan, w1, w2, go)
    for name, g, r in zip(("dx", "d_scores", "dw_gate_up", "dw_down"), got, ref):
        assert rel_err(g, r) < 2e-2, name
    again = f(x, h, plan, w1, w2, go)
    for g, a in zip(got, again):
        assert bool(jnp.array_equal(g, a)), "bitwise repeat"


def test_backward_with_empty_experts_on_gpu():
    """Experts no token picks: their weight-gradient CTAs have no K steps (the producer
    lowers its registers without work, `_common.role_registers`), their dW1/dW2 are exactly
    zero, the rest matches the jnp backward, bitwise from run to run, poisoned outputs."""
    from pallas_moe.kernels.moe_backward import moe_backward
    from pallas_moe.ops.minimal_backward import moe_ffn_backward

    T, d, n, E, K = 2048, 512, 256, 16, 4
    empty = [3, 7, 11]
    ks = jax.random.split(jax.random.key(23), 6)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[1], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[2], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    logits = jax.random.normal(ks[3], (T, E)).at[:, jnp.array(empty)].set(-1e4)  # never picked
    plan = pm.routing.topk_plan(logits, K)
    assert all(int(plan.group_sizes[e]) == 0 for e in empty)
    h = jax.random.normal(ks[4], (plan.capacity, 2 * n), jnp.bfloat16)
    go = jax.random.normal(ks[5], (T, d), jnp.bfloat16)
    f = jax.jit(lambda *a: moe_backward(*a))
    _poison(plan.capacity * (5 * n + d) * 2 + E * 3 * n * d * 2)
    got = f(x, h, plan, w1, w2, go)
    ref = jax.jit(moe_ffn_backward)(x, h, plan, w1, w2, go)
    for name, g, r in zip(("dx", "d_scores", "dw_gate_up", "dw_down"), got, ref):
        assert rel_err(g, r) < 2e-2, name
    for dw in got[2:]:
        assert not bool(jnp.any(dw[jnp.array(empty)] != 0)), "empty experts get zero gradients"
    again = f(x, h, plan, w1, w2, go)
    for g, a in zip(got, again):
        assert bool(jnp.array_equal(g, a)), "bitwise repeat"


@pytest.mark.parametrize("shape", [(4096, 1536, 256, 32, 8), (3000, 4096, 512, 16, 4)], ids=["7b", "30b"])
def test_staged_output_slabs_equal_the_whole_tile_on_gpu(shape):
    """The H200's ping-pong down-proj and dX~ (each consumer stages its output one 64-column
    slab at a time; dX~ with the 6th stage that frees, since session 37) bit for bit the
    whole-tile configs (the H100's defaults, the H200's before), on poisoned outputs at the
    production blocks, skewed routing with an empty expert, and against per-expert dots."""
    import functools

    from pallas_moe.kernels.down_proj import down_proj
    from pallas_moe.kernels.dx import dx_rows
    from pallas_moe.kernels.moe_backward import BackwardConfig
    from pallas_moe.kernels.moe_forward import ForwardConfig

    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(d + 37), 5)
    logits = jax.random.normal(ks[0], (T, E)).at[:, 0].add(2.0).at[:, 3].set(-1e4)
    plan = pm.routing.topk_plan(logits, K)
    assert int(plan.group_sizes[3]) == 0
    a = jax.random.normal(ks[1], (plan.capacity, n), jnp.bfloat16)
    dh = jax.random.normal(ks[2], (plan.capacity, 2 * n), jnp.bfloat16)
    w1 = (jax.random.normal(ks[3], (E, d, 2 * n)) * (2 * n) ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[4], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    rows = int(plan.num_rows)
    kinds = {"H200": "NVIDIA H200", "whole tile": "NVIDIA H100 80GB HBM3"}
    downs = {k: ForwardConfig.for_shape(d, n, device_kind=v).down for k, v in kinds.items()}
    dxs = {k: BackwardConfig.for_shape(d, n, device_kind=v).dx for k, v in kinds.items()}
    assert downs["H200"].out_slabs == 1 and downs["whole tile"].out_slabs == 0
    if dxs["H200"].pingpong:
        assert (dxs["H200"].num_stages, dxs["H200"].out_slabs) == (6, 1)
    starts = [0, *jnp.cumsum(plan.group_sizes).tolist()]

    def per_expert(lhs, w):  # lhs [P, k] @ w[e] [k, d] per expert's rows, f32 accumulate
        return jnp.concatenate([
            jnp.dot(lhs[starts[e]:starts[e + 1]], w[e], preferred_element_type=jnp.float32)
            for e in range(E)]).astype(jnp.bfloat16)

    for name, configs, run, ref in (
        ("down", downs, lambda c: functools.partial(down_proj, config=c), per_expert(a, w2)),
        ("dx", dxs, lambda c: functools.partial(dx_rows, capacity=plan.capacity, config=c),
         per_expert(dh, jnp.swapaxes(w1, 1, 2))),
    ):
        lhs = a if name == "down" else dh
        w = w2 if name == "down" else w1
        outs = {}
        for key, config in configs.items():
            _poison(plan.capacity * d * 2)
            outs[key] = np.asarray(jax.jit(run(config))(lhs, plan.group_sizes, w)[:rows])
        assert np.all(np.isfinite(outs["H200"].astype(np.float32))), name
        np.testing.assert_array_equal(outs["H200"].view(np.uint16), outs["whole tile"].view(np.uint16))
        assert rel_err(outs["H200"], ref[:rows]) < 1e-2, name


@pytest.mark.parametrize("skew", [False, True])
def test_chunked_row_ffn_equals_moe_ffn_bitwise(skew):
    """The chunked EP overlap's expert FFN (`chunked_row_ffn`: one up-proj, one down-proj call
    per wave-aligned chunk over the whole A and plan) gives each row the bits `moe_ffn` gives
    its token, when every token owns one row of weight 1 (what an EP shard receives), for 1,
    2 and 4 chunks; fresh outputs start poisoned, so an unwritten row shows."""
    from pallas_moe.ops.row_chunks import RowChunking, chunked_row_ffn, grouped_rows
    from pallas_moe.routing.plan import plan_from_assignment

    T, d, n, E = 16384, 1536, 256, 16  # ~11 waves of the down-proj's work items on 132 SMs
    ks = jax.random.split(jax.random.key(7), 5)
    logits = jax.random.normal(ks[0], (T, E)).at[:, :4].add(1.5 if skew else 0.0)
    routed = jax.random.uniform(ks[1], (T,)) > 0.1  # some tokens unrouted: padding rows
    selected = (jax.nn.one_hot(jnp.argmax(logits, 1), E) > 0) & routed[:, None]
    plan = plan_from_assignment(selected, jnp.ones((T, E), jnp.float32), selected, capacity=T)
    x = jax.random.normal(ks[2], (T, d), jnp.bfloat16)
    w1 = (jax.random.normal(ks[3], (E, d, 2 * n)) * d**-0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(ks[4], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    rows = int(plan.num_rows)
    token_of_row = plan.token_ids[:rows]
    whole = jax.jit(lambda x: pm.moe_ffn(x, plan, w1, w2, backend="mosaic"))(x)[token_of_row]
    for num_chunks in (1, 2, 4):
        chunking = RowChunking.for_shape("mosaic", d, n, plan.capacity, num_chunks)
        bounds = chunking.bounds(plan.group_sizes)
        assert num_chunks == 1 or int(bounds[1]) > 0  # rows really split
        _poison(num_chunks * chunking.rows * d * 2)
        y = jax.jit(lambda x: chunked_row_ffn(x, plan, w1, w2, num_chunks=num_chunks, backend="mosaic"))(x)
        got = grouped_rows(y, bounds, rows)
        assert bool(jnp.array_equal(got, whole)), f"{num_chunks} chunks"


def _dh_problem(shape, seed, empty_expert=None):
    """dH's operands `(dO, H, token_ids, group_sizes, scores, W2)` on fresh random data,
    skewed routing (experts 0 and 1 preferred), optionally an expert no token picks; and
    the plan's real row count."""
    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(ks[0], (T, E)).at[:, :2].add(1.5)
    if empty_expert is not None:
        logits = logits.at[:, empty_expert].add(-1e4)
    plan = pm.routing.topk_plan(logits, K)
    if empty_expert is not None:
        assert int(plan.group_sizes[empty_expert]) == 0
    do = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
    h = jax.random.normal(ks[2], (plan.capacity, 2 * n), jnp.bfloat16)
    w2 = (jax.random.normal(ks[3], (E, n, d)) * n**-0.5).astype(jnp.bfloat16)
    return (do, h, plan.token_ids, plan.group_sizes, plan.scores, w2), int(plan.num_rows)


def _assert_dh_configs_write_the_same_bits(shape, seed, configs, empty_expert=None):
    """dH under each `DHConfig` of `configs` on one problem (`_dh_problem`), outputs poisoned
    before each run: every written row of dH and A', and dS, finite and bitwise the same
    for all configs."""
    from pallas_moe.kernels.dh import dh_kernel

    n = shape[2]
    args, rows = _dh_problem(shape, seed, empty_expert)
    outs = []
    for cfg in configs:
        f = jax.jit(lambda *a, cfg=cfg: dh_kernel(*a, config=cfg))
        _poison(args[1].shape[0] * 3 * n * 2)
        dh, ap, ds = f(*args)
        outs.append((np.asarray(dh[:rows]), np.asarray(ap[:rows]), np.asarray(ds)))
    for name, per_config in zip(("dH", "A'", "dS"), zip(*outs)):  # one output, every config
        first = per_config[0]
        assert np.all(np.isfinite(first.astype(np.float32))), f"{name} under {configs[0]}"
        for cfg, other in zip(configs[1:], per_config[1:]):
            assert np.array_equal(first, other), f"{name} under {cfg}"


def dh_same_bits_configs(d, n):
    """The dH configs that must write the default's bits at widths (d, n): the default
    (`BackwardConfig.for_shape`: the device's SM count of CTAs, the cp.async dO gather
    published by `wait_group`, the only way since session 64; H by cp.async), 7 CTAs and
    one CTA (each walks many items), the TMA dO gather, and H loaded by TMA boxes. (Not
    `epilogue_cols=0`: its dS sums the whole block's columns at once, another rounding than
    the sum of 64-column chunks; the CPU tests compare its dH and A'.)"""
    import dataclasses

    from pallas_moe.kernels.moe_backward import BackwardConfig

    base = BackwardConfig.for_shape(d, n).dh
    assert (base.gather, base.h_loader) == ("cp_async", "cp_async"), base
    few = dataclasses.replace(base, persistent_ctas=7)
    return (base, few, dataclasses.replace(base, persistent_ctas=1),
            dataclasses.replace(base, gather="tma"), dataclasses.replace(few, h_loader="tma"))


@pytest.mark.parametrize(
    "shape", [(6000, 1536, 256, 32, 8), (3000, 4096, 512, 16, 4), (4000, 2048, 768, 32, 8),
              (3000, 2880, 2880, 16, 4)],
    ids=["7b_widths", "30b_widths", "qwen3_widths", "gpt_oss_widths"],
)
def test_dh_configs_write_the_same_bits(shape):
    """dH writes the same bits under every config of `dh_same_bits_configs`: the SM count of
    CTAs against 7 and one (every CTA walks many items; the Qwen3 widths have 3 column
    blocks per row tile), both dO row loaders, and both H loaders (cp.async rows past a
    tile zero-filled, never read past the array; TMA boxes row-exact); at gpt-oss's widths
    (n = 2880: three consumers of 64 columns since session 48) also one consumer, the
    default before; skewed routing with an empty expert (partial tiles of every size),
    poisoned outputs, fresh random data.
    (Until session 42 the oracle was the one-CTA-per-tile kernel, removed.)"""
    import dataclasses

    T, d, n, E, K = shape
    configs = dh_same_bits_configs(d, n)
    if configs[0].num_consumers == 3:
        configs += (dataclasses.replace(configs[0], num_consumers=1),)
    _assert_dh_configs_write_the_same_bits(shape, T + d + n, configs, empty_expert=3)


@pytest.mark.parametrize(
    "shape", [(3000, 4096, 512, 16, 4), (6000, 1536, 256, 32, 8), (4000, 2048, 768, 32, 8)],
    ids=["30b_widths", "7b_widths", "qwen3_widths"])
def test_dh_split_writes_the_fused_kernels_bits(shape):
    """dH split in two with dA' in f32 (`dh_split`: the gathered bf16 grouped GEMM writing
    dA' in f32, then the dSwiGLU row pass; `for_shape`'s split at d >= 2048 rounds dA' to
    bf16 since session 63, `dh_da_dtype="float32"` keeps f32) writes the fused
    kernel's dH and A' bit for bit on every real row, dS within 1e-5 of it (another
    summation order) and 0 on padding, under the GEMM's default (the SM count of CTAs,
    cp.async rows published by `wait_group`), 7 CTAs, `mbarrier` publishing and the TMA row
    loader; skewed routing with an empty expert, poisoned outputs, fresh random data, and
    bitwise on repeat."""
    from pallas_moe.kernels.dh import dh_kernel, dh_split
    from pallas_moe.kernels.moe_backward import BackwardConfig, dh_split_gemm_config

    T, d, n, E, K = shape
    args, rows = _dh_problem(shape, T + d + n + 9, empty_expert=3)
    cfg = BackwardConfig.for_shape(d, n)
    nbytes = args[1].shape[0] * (3 * n * 2 + n * 4)
    _poison(nbytes)
    fused = [np.asarray(o) for o in jax.jit(lambda *a: dh_kernel(*a, config=cfg.dh))(*args)]
    base = cfg.dh_gemm or dh_split_gemm_config(cfg.dh.persistent_ctas)
    assert (d >= 2048) == (cfg.dh_gemm is not None)
    for gemm in (base, dataclasses.replace(base, num_sms=7),
                 dataclasses.replace(base, gather_completion="mbarrier"),
                 dataclasses.replace(base, gather="tma")):
        f = jax.jit(lambda *a, gemm=gemm: dh_split(*a, gemm=gemm))
        _poison(nbytes)
        got = [np.asarray(o) for o in f(*args)]
        for name, g, w in (("dH", got[0], fused[0]), ("A'", got[1], fused[1])):
            assert np.all(np.isfinite(g[:rows].astype(np.float32))), (name, gemm)
            assert np.array_equal(g[:rows], w[:rows]), (name, gemm)
        assert rel_err(got[2], fused[2]) < 1e-5, gemm
        assert not np.any(got[2][rows:]), gemm
        again = [np.asarray(o) for o in f(*args)]
        assert all(np.array_equal(a[:rows], g[:rows]) for a, g in zip(again, got)), gemm


@pytest.mark.parametrize(
    "shape", [(3000, 4096, 512, 16, 4), (6000, 1536, 256, 32, 8), (4000, 2048, 768, 32, 8)],
    ids=["30b_widths", "7b_widths", "qwen3_widths"])
def test_dh_split_with_bf16_da_rounds_only_da(shape):
    """dH split with dA' in bf16 (`BackwardConfig.dh_da_dtype`, `for_shape`'s at d >= 2048
    since session 63): the GEMM writes its f32 accumulator rounded to bf16, so dH and dS are
    the row pass's on the f32 split's dA' rounded, bit for bit, and A' is the f32 split's;
    dH within the fused kernel's tolerance of it; skewed routing with an empty expert,
    poisoned outputs, fresh random data, bitwise on repeat."""
    from pallas_moe.kernels.dh import dh_split, dswiglu_rows
    from pallas_moe.kernels.grouped_gemm import grouped_matmul
    from pallas_moe.kernels.moe_backward import BackwardConfig, dh_split_gemm_config

    T, d, n, E, K = shape
    args, rows = _dh_problem(shape, T + d + n + 11, empty_expert=3)
    grad_out, h, token_ids, group_sizes, scores, w2 = args
    cfg = BackwardConfig.for_shape(d, n)
    gemm = cfg.dh_gemm or dh_split_gemm_config(cfg.dh.persistent_ctas)
    nbytes = h.shape[0] * (3 * n * 2 + n * 4)
    f = jax.jit(lambda *a: dh_split(*a, gemm=gemm, da_dtype=jnp.bfloat16))
    _poison(nbytes)
    got = [np.asarray(o) for o in f(*args)]
    f32 = [np.asarray(o) for o in jax.jit(lambda *a: dh_split(*a, gemm=gemm))(*args)]
    da = jax.jit(lambda g, gs, w, t: grouped_matmul(
        g, gs, w, transpose_w=True, config=gemm, capacity=h.shape[0], out_dtype=jnp.float32,
        token_ids=t))(grad_out, group_sizes, w2, token_ids)
    want = [np.asarray(o) for o in jax.jit(lambda da, h, s: dswiglu_rows(
        da.astype(jnp.bfloat16), h, s, jnp.array([rows], jnp.int32),
        out_rows=got[0].shape[0]))(da, h, scores)]
    assert np.all(np.isfinite(got[0][:rows].astype(np.float32)))
    assert np.array_equal(got[0][:rows], want[0][:rows])
    assert np.array_equal(got[1][:rows], f32[1][:rows])
    assert np.array_equal(got[2], want[2])
    assert rel_err(got[0][:rows].astype(np.float32), f32[0][:rows].astype(np.float32)) < 1e-2
    again = [np.asarray(o) for o in f(*args)]
    assert all(np.array_equal(a[:rows], g[:rows]) for a, g in zip(again, got))


@pytest.mark.parametrize(
    "shape", [(3000, 4096, 512, 16, 4), (6000, 1536, 256, 32, 8), (3000, 2880, 2880, 16, 4)],
    ids=["30b_widths", "7b_widths", "gpt_oss_widths"])
def test_wgmma_lag_0_writes_the_default_bits(shape):
    """The down-proj (with an expert bias) and dX~ at the other `wgmma_lag` than their
    default (lag 0: each slot released as soon as its own K step's wgmmas are done, session
    51; the H100's down-proj runs lag 0 at gpt-oss's widths since session 54, dX~ since session
    64) write the bits
    of each width's default: 132 and 8 CTAs, skewed routing with an empty expert, poisoned
    outputs, fresh random data. Interpret mode runs wgmma synchronously, so only this test
    can see a slot released before the wgmmas reading it finished. (dH and the weight
    gradients lost `wgmma_lag` in session 64.)"""
    import dataclasses

    _assert_grouped_gemm_variants_write_the_default_bits(shape, lambda c: (
        dataclasses.replace(c, wgmma_lag=1 - c.wgmma_lag),
        dataclasses.replace(c, wgmma_lag=1 - c.wgmma_lag, num_sms=8)))


def _weight_grad_problem(shape, seed):
    """(plan, X, dO, dH, A') of a weight-gradient check at `shape` (T, d, n, E, K): skewed
    routing with an empty expert (3), fresh random bf16 data, NaN in the contiguous
    operands' padding rows past P (rounded up to 64)."""
    T, d, n, E, K = shape
    ks = jax.random.split(jax.random.key(seed), 5)
    logits = jax.random.normal(ks[0], (T, E)).at[:, :2].add(1.5).at[:, 3].add(-1e4)
    plan = pm.routing.topk_plan(logits, K)
    assert int(plan.group_sizes[3]) == 0
    P = plan.capacity
    p64 = -(-P // 64) * 64
    pad = lambda a: jnp.concatenate(  # noqa: E731  padding rows past P: NaN
        [a, jnp.full((p64 - P, a.shape[1]), jnp.nan, a.dtype)])
    x = jax.random.normal(ks[1], (T, d), jnp.bfloat16)
    go = jax.random.normal(ks[2], (T, d), jnp.bfloat16)
    dh = pad(jax.random.normal(ks[3], (P, 2 * n), jnp.bfloat16))
    ap = pad(jax.random.normal(ks[4], (P, n), jnp.bfloat16))
    return plan, x, go, dh, ap


def _assert_weight_grad_matches_numpy(out, lhs, rhs, plan, gathered):
    """`out` (f32 [E, M, N]) against numpy's `L[rows e]^T R[rows e]` for the two largest
    experts and the last one, the gathered side indexed through the plan's token ids."""
    rows = np.asarray(plan.token_ids)
    lo = np.concatenate([[0], np.cumsum(np.asarray(plan.group_sizes))])
    lf = np.asarray(lhs, np.float32)
    rf = np.asarray(rhs, np.float32)
    for e in (0, 1, plan.num_experts - 1):
        r = slice(lo[e], lo[e + 1])
        lr = lf[rows[r]] if gathered == "lhs" else lf[r]
        rr = rf[r] if gathered == "lhs" else rf[rows[r]]
        assert rel_err(out[e], lr.T @ rr) < 1e-2, (gathered, e)


def _persistent_weight_grad_cases():
    from tests.test_kernels_bwd import PERSISTENT_WEIGHT_GRAD_GPU_CASES

    return [pytest.param(*v, id=k) for k, v in PERSISTENT_WEIGHT_GRAD_GPU_CASES.items()]


@pytest.mark.parametrize("shape, num_ctas", _persistent_weight_grad_cases())
def test_weight_grad_persistent_equals_one_cta_per_item(shape, num_ctas):
    """Both weight gradients as persistent CTAs (`WeightGradConfig.persistent_ctas`) write
    the bits of the one-CTA-per-item kernel (the default where the persistent form does
    not fit) and match the jnp reference, in each form of
    `test_kernels_bwd.persistent_weight_grad_forms` (separate output buffers per consumer,
    or 128-wide chunks where those do not fit; the default with one output buffer per
    consumer, `output_chunks=1`; at gpt-oss's widths the consumer count before): skewed
    routing with an empty expert, NaN in the contiguous operand's padding rows, poisoned
    outputs, fresh random data; 7 CTAs make every CTA walk many items of different K-block
    counts; at d = 2880 a dW1 tile is three 64-row chunks taking turns in one buffer. The
    CPU test `test_persistent_weight_grad_gpu_test_forms_trace_for_cuda` traces every form."""
    from pallas_moe.kernels.weight_grad import weight_grad
    from tests.test_kernels_bwd import persistent_weight_grad_forms

    T, d, n, E, K = shape
    plan, x, go, dh, ap = _weight_grad_problem(shape, T + d)
    for gathered, lhs, rhs in (("lhs", x, dh), ("rhs", ap, go)):
        outs = []
        for c in persistent_weight_grad_forms(d, n, num_ctas, gathered):
            f = jax.jit(lambda l, r, t, g, c=c: weight_grad(
                l, r, t, g, gathered=gathered, out_dtype=jnp.bfloat16, config=c))
            _poison(E * lhs.shape[1] * rhs.shape[1] * 2)
            outs.append(np.asarray(f(lhs, rhs, plan.token_ids, plan.group_sizes), np.float32))
        assert np.array_equal(outs[0], outs[1]), gathered
        assert np.array_equal(outs[0], outs[2]), (gathered, "output_chunks=1")
        assert all(np.array_equal(outs[0], o) for o in outs[3:]), (gathered, "consumers")
        assert np.all(np.isfinite(outs[1])) and not np.any(outs[1][3]), gathered
        _assert_weight_grad_matches_numpy(outs[1], lhs, rhs, plan, gathered)


def test_shared_kernel_compilations_are_bitwise_neutral(monkeypatch):
    """`pallas_moe._kernel_dedup` lets identical kernels share one compilation (here the
    two layers' up-proj, down-proj, dH, ... kernels): a two-layer step traced with it is
    bitwise the step traced with Mosaic GPU's own rule (one compilation per call site),
    forward and every gradient, on fresh data."""
    from jax.experimental.mosaic.gpu import core as mgpu_core

    T, d, n, E, K = 4096, 1536, 256, 32, 8
    ks = jax.random.split(jax.random.key(16), 7)
    x = jax.random.normal(ks[0], (T, d), jnp.bfloat16)
    logits = jax.random.normal(ks[1], (T, E), jnp.float32)
    w = [(jax.random.normal(k, shape, jnp.float32) * shape[1] ** -0.5).astype(jnp.bfloat16)
         for k, shape in zip(ks[2:6], [(E, d, 2 * n), (E, n, d)] * 2)]
    cot = jax.random.normal(ks[6], (T, d), jnp.bfloat16)

    def two_layers(x, a1, a2, b1, b2):
        plan = pm.routing.topk_plan(logits, K)
        y = pm.moe_ffn(x, plan, a1, a2, backend="mosaic")
        return pm.moe_ffn(y, plan, b1, b2, backend="mosaic")

    def step(*args):
        out, pullback = jax.vjp(two_layers, *args)
        return out, pullback(cot)

    rule = mgpu_core._mosaic_gpu_lowering_rule
    assert getattr(rule, "_drops_dump_basename", False)
    shared = jax.jit(lambda *a: step(*a))(x, *w)
    monkeypatch.setattr(mgpu_core, "_mosaic_gpu_lowering_rule", rule.__wrapped__)
    separate = jax.jit(lambda *a: step(*a))(x, *w)
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(separate)):
        assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32))))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
