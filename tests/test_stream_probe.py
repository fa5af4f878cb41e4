"""`benchmarks/stream_probe.py`: the weight-streaming ring runs in interpret mode and lowers
for cuda with one CTA per SM at the sizes the GPU run uses."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.stream_probe import stream, stream_up_phase, up_phase_box


def test_stream_runs_in_interpret_mode():
    w = jnp.ones((4 * 128, 256), jnp.bfloat16)
    out = stream(w, box=(64, 128), stages=3, num_ctas=4, interpret=True)
    assert out.shape == (4,)


@pytest.mark.parametrize("box, stages", [((64, 64), 8), ((64, 128), 6), ((128, 128), 6)])
def test_stream_lowers_for_cuda(box, stages):
    w = jax.ShapeDtypeStruct((132 * 128, 2048), jnp.bfloat16)
    jax.jit(lambda v: stream(v, box=box, stages=stages, num_ctas=132)).trace(w).lower(
        lowering_platforms=("cuda",))


def test_uneven_runs_are_refused():
    with pytest.raises(ValueError, match="boxes"):
        stream(jnp.ones((3 * 64, 128), jnp.bfloat16), box=(64, 64), stages=2, num_ctas=4,
               interpret=True)


@pytest.mark.parametrize("u, split", [(64, 1), (64, 4), (128, 2)])
@pytest.mark.parametrize("order", ["strips", "rows"])
def test_up_phase_boxes_cover_w1_once(u, split, order):
    """Both orders load every box of W1 exactly once, with the same boxes per CTA; strips
    keep a CTA in one expert's gate and up column block, down consecutive K rows."""
    d, n, experts = 2048, 768, 8
    ctas, steps = experts * n // u * split, d // 64 // split
    seen = {}
    for cta in range(ctas):
        for step in range(steps):
            for box in up_phase_box(cta, step, d=d, n=n, u=u, split=split, order=order):
                assert box not in seen, (box, cta, step, seen.get(box))
                seen[box] = cta
    assert len(seen) == experts * d // 64 * 2 * n // u
    if order == "strips":
        for cta in range(ctas):
            (r0, g0), (_, u0) = up_phase_box(cta, 0, d=d, n=n, u=u, split=split, order=order)
            (r1, g1), (_, u1) = up_phase_box(cta, steps - 1, d=d, n=n, u=u, split=split,
                                             order=order)
            assert (g0, u0) == (g1, u1) and u0 == g0 + n // u and r1 == r0 + steps - 1
            assert r0 // (d // 64) == r1 // (d // 64)  # one expert


def test_up_phase_runs_in_interpret_mode():
    w = jnp.ones((2 * 256, 256), jnp.bfloat16)
    out = stream_up_phase(w, d=256, n=128, u=64, split=2, stages=3, order="strips",
                          interpret=True)
    assert out.shape == (2 * 2 * 2,)


@pytest.mark.parametrize("u, split, stages", [(64, 1, 5), (128, 2, 4)])
def test_up_phase_lowers_for_cuda(u, split, stages):
    w = jax.ShapeDtypeStruct((8 * 2048, 1536), jnp.bfloat16)
    jax.jit(lambda v: stream_up_phase(v, d=2048, n=768, u=u, split=split, stages=stages,
                                      order="strips")).trace(w).lower(lowering_platforms=("cuda",))


def test_up_phase_refuses_a_bad_matrix():
    with pytest.raises(ValueError, match="experts"):
        stream_up_phase(jnp.ones((300, 256), jnp.bfloat16), d=256, n=128, u=64, split=1,
                        stages=2, order="rows", interpret=True)
