"""`benchmarks/stream_probe.py`: the weight-streaming ring runs in interpret mode and lowers
for cuda with one CTA per SM at the sizes the GPU run uses."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks.stream_probe import stream


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
