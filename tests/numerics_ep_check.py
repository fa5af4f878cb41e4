"""Which numerics settings are bitwise across expert-parallel sizes (8 CPU devices).

Run in its own process (the device count is fixed when jax is imported):

    python -m tests.numerics_ep_check            # what tests/test_numerics.py runs
    python -m tests.numerics_ep_check --full     # every mode x routing x dispatch x EP size

For each case it builds the same bf16 `MoE` (xla backend) on one device and with
`ExpertParallel` over G devices, and reports whether the output and every gradient
(input, router, both expert weights) are bitwise the single-device ones. One JSON line per
case; `bitwise_y` / `bitwise_grads` are the facts, `grad_rel` the size of any difference.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pallas_moe as pm  # noqa: E402

D, N, E, K, T, TILE = 32, 16, 8, 2, 64, 8


def build(routing, aggregation, ep=None):
    return pm.nn.MoE(
        D, N, E, K, routing=routing, tile=TILE, backend="xla", dtype=jnp.bfloat16,
        rngs=nnx.Rngs(0), expert_parallel=ep, numerics=pm.Numerics(aggregation=aggregation),
    )


def loss_fn(layer, x):
    y, aux = layer(x)
    probe = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y.astype(jnp.float32) * probe) + aux["loss"], y


value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all(a.view(np.uint8) == b.view(np.uint8)))


def max_rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))


INPUT = jax.random.normal(jax.random.key(1), (T, D), jnp.float32)
_single_device = {}


def single_device(routing, aggregation):
    if (routing, aggregation) not in _single_device:
        _single_device[routing, aggregation] = value_and_grad(build(routing, aggregation), INPUT)
    return _single_device[routing, aggregation]


def run_case(routing, aggregation, dispatch, ep_size):
    x = INPUT
    (_, y0), g0 = single_device(routing, aggregation)
    mesh = Mesh(np.array(jax.devices()[:ep_size]), ("expert",))
    ep = pm.nn.ExpertParallel(mesh, axis="expert", dispatch=dispatch)
    (_, y1), g1 = value_and_grad(build(routing, aggregation, ep), x)
    leaves0, leaves1 = jax.tree.leaves(g0), jax.tree.leaves(g1)
    layer0, layer1 = g0[0], g1[0]
    return {
        "routing": routing, "aggregation": aggregation, "dispatch": dispatch, "ep": ep_size,
        "bitwise_y": bits_equal(y0, y1),
        "bitwise_grads": all(bits_equal(a, b) for a, b in zip(leaves0, leaves1)),
        "bitwise_weight_grads": all(
            bits_equal(layer0[name][...], layer1[name][...]) for name in ("w_gate_up", "w_down")
        ),
        "bitwise_router_grad": bits_equal(layer0["router"][...], layer1["router"][...]),
        "bitwise_x_grad": bits_equal(g0[1], g1[1]),
        "y_rel": max_rel(y0, y1),
        "grad_rel": max(max_rel(a, b) for a, b in zip(leaves0, leaves1)),
    }


FAST = [
    # The ragged dispatch's forward is bitwise in every mode; the all-gather's is not in fp32.
    ("topk", "fp32", "emulated_ragged_all_to_all", 4),
    ("topk", "bf16_per_expert", "emulated_ragged_all_to_all", 4),
    ("topk", "bf16_scores", "emulated_ragged_all_to_all", 2),
    ("token_rounding", "bf16_per_expert", "emulated_ragged_all_to_all", 4),
    ("topk", "fp32", "all_gather", 2),
]


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--full", action="store_true")
    args = parser.parse_args(argv)
    cases = FAST
    if args.full:
        cases = list(itertools.product(
            ("topk", "token_rounding"), ("fp32", "bf16_per_expert", "bf16_scores"),
            ("all_gather", "emulated_ragged_all_to_all"), (1, 2, 4, 8),
        ))
    for case in cases:
        print(json.dumps(run_case(*case)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
