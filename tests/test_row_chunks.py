"""`chunked_row_ffn` (the down-proj side of the chunked EP overlap) against float64 numpy,
its gradients against autodiff of an independent dense formula, and the chunk bookkeeping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_moe as pm

from pallas_moe.ops.row_chunks import (
    RowChunking, auto_num_chunks, chunk_group_sizes, chunk_layout, chunked_row_ffn, grouped_rows,
)
from pallas_moe.routing.plan import plan_from_assignment


def one_row_plan(num_tokens, num_experts, seed, capacity):
    """Each token routed to at most one expert (about 1 in 8 to none): padding rows exist."""
    rng = np.random.default_rng(seed)
    expert = rng.integers(0, num_experts, num_tokens)
    routed = rng.random(num_tokens) > 0.125
    selected = (np.arange(num_experts)[None, :] == expert[:, None]) & routed[:, None]
    weights = rng.random((num_tokens, num_experts)).astype(np.float32)
    plan = plan_from_assignment(jnp.asarray(selected), jnp.asarray(weights), jnp.asarray(selected), capacity)
    return plan, selected


def reference_rows(x, plan, w1, w2):
    """float64 Y[g] = swiglu(x[tok[g]] @ W1[e]) @ W2[e] for the plan's real rows."""
    x, w1, w2 = (np.asarray(a, np.float64) for a in (x, w1, w2))
    sizes = np.asarray(plan.group_sizes)
    tok = np.asarray(plan.token_ids)
    n = w2.shape[1]
    rows = []
    for e, size in enumerate(sizes):
        start = int(sizes[:e].sum())
        for g in range(start, start + int(size)):
            h = x[tok[g]] @ w1[e]
            a = h[:n] / (1 + np.exp(-h[:n])) * h[n:]
            rows.append(a @ w2[e])
    return np.stack(rows)  # [num_rows, d]


def test_chunk_layout_and_group_sizes():
    assert chunk_layout(1000, 4, 128) == (256, 4)
    assert chunk_layout(1100, 4, 128) == (384, 3)  # 9 blocks in chunks of 3: no empty chunk
    assert chunk_layout(100, 8, 128) == (128, 1)
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        chunk_layout(100, 0, 128)
    sizes = jnp.array([5, 0, 13, 2], jnp.int32)  # rows [0,5) [5,5) [5,18) [18,20)
    row_bounds = [0, 8, 8, 16, 20]  # an empty chunk too
    got = np.asarray(chunk_group_sizes(sizes, jnp.array(row_bounds, jnp.int32)))
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want = [[max(0, min(bounds[e + 1], row_bounds[c + 1]) - max(bounds[e], row_bounds[c])) for e in range(4)]
            for c in range(4)]
    np.testing.assert_array_equal(got, want)
    assert got.sum() == 20


def test_auto_num_chunks_grows_with_the_work():
    # benchmarks/chunked_down_proj.py's shards: 7b-ep8 (19 GFLOP) one chunk, 30b-ep8 (137) two.
    assert auto_num_chunks(24576, 1536, 256) == 1
    assert auto_num_chunks(32768, 4096, 512) == 2  # 137 GFLOP: 2 chunks measured +0.9%, 4 +6.4%
    assert auto_num_chunks(0, 4096, 512) == 1
    assert [auto_num_chunks(rows, 1024, 1024) for rows in (10000, 40000, 70000, 10**6)] == [1, 2, 3, 4]


@pytest.mark.parametrize("num_chunks", [6, 1])
def test_chunked_rows_xla_forward_and_grads(num_chunks):
    num_tokens, d, n, num_experts = 90, 16, 8, 4
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (num_tokens, d))
    w1 = jax.random.normal(keys[1], (num_experts, d, 2 * n)) / d**0.5
    w2 = jax.random.normal(keys[2], (num_experts, n, d)) / n**0.5
    plan, _ = one_row_plan(num_tokens, num_experts, seed=1, capacity=96)
    chunking = RowChunking.for_shape("xla", d, n, 96, num_chunks)
    assert chunking.num_chunks == num_chunks
    y = chunked_row_ffn(x, plan, w1, w2, num_chunks=num_chunks, backend="xla")
    assert y.shape == (num_chunks, chunking.rows, d)
    rows = int(plan.num_rows)
    bounds = chunking.bounds(plan.group_sizes)
    assert int(bounds[-1]) == rows and (num_chunks == 1 or np.count_nonzero(np.diff(bounds)) == num_chunks)
    np.testing.assert_allclose(
        np.asarray(grouped_rows(y, bounds, rows)), reference_rows(x, plan, w1, w2), rtol=2e-5, atol=2e-5
    )

    # Gradients vs autodiff of a dense per-row formula (no tiles, no custom VJP), laid out
    # in the same chunks.
    probe = jax.random.normal(keys[3], y.shape)
    offset = jnp.arange(chunking.rows)[None, :]
    grouped = bounds[:-1, None] + offset  # [C, S] grouped row of each chunk row
    valid = (offset < (bounds[1:] - bounds[:-1])[:, None])[..., None]

    def dense(x, w1, w2):
        at = jnp.minimum(grouped, 95)
        ids, experts = plan.token_ids[at], jnp.minimum(plan.expert_ids[at], num_experts - 1)
        h = jnp.einsum("csd,csdf->csf", x[ids], w1[experts], precision="highest")
        a = jax.nn.silu(h[..., :n]) * h[..., n:]
        return jnp.einsum("csn,csnd->csd", a, w2[experts], precision="highest")

    def loss(fn):
        return lambda *args: jnp.sum(jnp.where(valid, fn(*args), 0.0) * probe)

    chunked = lambda x, w1, w2: chunked_row_ffn(x, plan, w1, w2, num_chunks=num_chunks, backend="xla")
    g_chunked = jax.grad(loss(chunked), argnums=(0, 1, 2))(x, w1, w2)
    g_dense = jax.grad(loss(dense), argnums=(0, 1, 2))(x, w1, w2)
    for a, b in zip(g_chunked, g_dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_chunked_rows_bad_num_chunks_and_bounds():
    x = jnp.zeros((8, 16))
    plan, _ = one_row_plan(8, 2, seed=0, capacity=8)
    w1, w2 = jnp.zeros((2, 16, 16)), jnp.zeros((2, 8, 16))
    with pytest.raises(ValueError, match="num_chunks must be positive"):
        chunked_row_ffn(x, plan, w1, w2, num_chunks=0, backend="xla")
    with pytest.raises(ValueError, match=r"row_bounds must be i32\[2\]"):
        chunked_row_ffn(x, plan, w1, w2, num_chunks=1, backend="xla", row_bounds=jnp.zeros((3,), jnp.int32))


def _kernel_inputs(num_tokens=240, d=64, n=64, num_experts=2, capacity=256):
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (num_tokens, d)).astype(jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (num_experts, d, 2 * n)) / d**0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (num_experts, n, d)) / n**0.5).astype(jnp.bfloat16)
    plan, _ = one_row_plan(num_tokens, num_experts, seed=1, capacity=capacity)
    return x, plan, w1, w2


def test_chunked_rows_kernels_interpret():
    """One up-proj kernel, then one down-proj kernel per chunk (Mosaic GPU interpret mode):
    3 row tiles x 2 column blocks are 2 waves of the 4 interpret CTAs, one per chunk."""
    x, plan, w1, w2 = _kernel_inputs(d=256)
    y = jax.jit(lambda x, w1, w2: chunked_row_ffn(x, plan, w1, w2, num_chunks=2, backend="interpret"))(x, w1, w2)
    chunking = RowChunking.for_shape("interpret", 256, 64, plan.capacity, 2)
    assert y.shape == (2, chunking.rows, 256) and y.dtype == jnp.bfloat16
    rows = int(plan.num_rows)
    bounds = chunking.bounds(plan.group_sizes)
    assert 0 < int(bounds[1]) < rows  # both chunks hold rows
    assert int(bounds[1]) == 128  # two 128-row tiles' rows, then the last tile
    got = np.asarray(grouped_rows(y, bounds, rows), np.float32)
    # bf16 H, A and Y roundings against a float64 reference of the bf16 inputs.
    np.testing.assert_allclose(got, reference_rows(x.astype(jnp.float32), plan, w1, w2), rtol=5e-2, atol=5e-2)


def test_chunked_rows_kernels_lower_for_cuda():
    """The mosaic path (forward and backward) lowers for Hopper with 128-row chunks."""
    x, plan, w1, w2 = _kernel_inputs(num_tokens=1000, d=128, n=128, num_experts=4, capacity=1024)

    def forward(x, w1, w2):
        return chunked_row_ffn(x, plan, w1, w2, num_chunks=4, backend="mosaic")

    def lower(fn):
        from tests.cuda_target import h100_target

        with h100_target():  # the AOT target `backend="mosaic"`'s device check reads
            return jax.jit(fn).trace(x, w1, w2).lower(lowering_platforms=("cuda",)).as_text()

    kernel_calls = lambda text: text.count("stablehlo.custom_call @mosaic_gpu_v2")
    assert kernel_calls(lower(forward)) == 1 + 4  # one up-proj, one down-proj per chunk
    loss = lambda *args: jnp.sum(forward(*args).astype(jnp.float32))
    assert kernel_calls(lower(jax.grad(loss, argnums=(0, 1, 2)))) > 1  # up-proj + backward kernels


# CI time (an opt-in extra): its parts are each tested in CI: the chunked kernels
# (test_chunked_rows_kernels_interpret), expert biases and the clamped SwiGLU on the kernels
# (test_moe_ffn_kernels), biased chunks (the EP check)
@pytest.mark.slow
def test_chunked_rows_with_expert_biases_and_clamped_swiglu_kernels_match_xla():
    """The chunked overlap's expert FFN with gpt-oss's options: interpret kernels vs xla,
    forward and the gradients of x, both weights and both biases."""
    x, plan, w1, w2 = _kernel_inputs()
    kb = jax.random.split(jax.random.key(9), 2)
    b1 = (0.5 * jax.random.normal(kb[0], (w1.shape[0], w1.shape[2]))).astype(jnp.bfloat16)
    b2 = (0.5 * jax.random.normal(kb[1], (w2.shape[0], w2.shape[2]))).astype(jnp.bfloat16)
    act = pm.ops.activation.SwiGLU.clamped(alpha=1.702, limit=0.75)
    rows = int(plan.num_rows)

    def run(backend):
        def loss(x, w1, w2, b1, b2):
            y = chunked_row_ffn(x, plan, w1, w2, num_chunks=2, backend=backend,
                                b_gate_up=b1, b_down=b2, activation=act)
            bounds = RowChunking.for_shape(backend, 64, 64, plan.capacity, 2).bounds(plan.group_sizes)
            y = grouped_rows(y, bounds, rows).astype(jnp.float32)
            return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y

        return jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)(x, w1, w2, b1, b2)

    (_, y), grads = run("interpret")
    (_, y_ref), ref_grads = run("xla")
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                             / np.linalg.norm(np.asarray(b, np.float64)))
    assert rel(y, y_ref) < 1e-2
    for name, g, r in zip(["x", "w_gate_up", "w_down", "b_gate_up", "b_down"], grads, ref_grads):
        assert rel(g, r) < 2e-2, name
