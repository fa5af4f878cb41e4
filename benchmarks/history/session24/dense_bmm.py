"""The up-proj's dense batched-matmul bound at 7B (`forward.dense_bound_ms`'s first einsum),
run a few times: a target for Nsight Compute next to the up-proj's K loop."""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from benchmarks.forward import SHAPES  # noqa: E402

T, d, n, E, K = SHAPES["7b"]
m = T * K // E
ka, kb = jax.random.split(jax.random.key(7))
a = jax.random.normal(ka, (E, m, d), jnp.bfloat16)
b = jax.random.normal(kb, (E, d, 2 * n), jnp.bfloat16)
bmm = jax.jit(lambda a, b: jnp.einsum("emd,edn->emn", a, b))
for _ in range(4):
    jax.block_until_ready(bmm(a, b))
print("dense bmm", a.shape, b.shape)
