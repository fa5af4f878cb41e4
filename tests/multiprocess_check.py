"""Expert parallelism across processes (`jax.distributed`) vs the single-device layer.

Started by `tests/test_multiprocess.py` as N processes on localhost, each with a few CPU
devices and gloo CPU collectives:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m tests.multiprocess_check --process-id 0 --num-processes 2 --port 12355 &
    ... --process-id 1 ...

Every process builds the same layer (same init) and the same inputs. The single-device
reference runs on each process's first local device; the EP layer runs on a mesh over all
processes' devices, with parameters and tokens as global `jax.Array`s. Outputs, aux and
the gradients of every parameter and of x are compared after gathering them to every
process. Prints one JSON line per case (with the process id); exits non-zero on mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cases", choices=("fast", "full"), default="fast")
    args = parser.parse_args(argv)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{args.port}", num_processes=args.num_processes,
        process_id=args.process_id,
    )
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pallas_moe as pm
    from tests.ep_check import build, inputs, loss_fn, max_rel

    value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    devices = jax.devices()  # every process's devices, process-major
    local = jax.local_devices()[0]
    num_devices = len(devices)

    def to_global(value, mesh, spec):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda idx: value[idx])

    def fetch(tree):
        """Every leaf of global arrays (spread over processes) as its full host value."""
        return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)

    failed = 0
    across = (1, num_devices)  # the expert axis spans the processes
    within = (args.num_processes, num_devices // args.num_processes)  # data axis across them
    cases = [  # (mesh shape (data, expert), routing, dispatch, ExpertParallel options)
        (across, "token_rounding", "emulated_ragged_all_to_all", {"overlap": "chunked", "num_chunks": 3}),
        (within, "topk", "all_gather", {}),
    ]
    if args.cases == "full":
        cases += [
            (across, "topk", "all_gather", {}),
            (across, "topk", "emulated_ragged_all_to_all", {}),
            (within, "token_rounding", "emulated_ragged_all_to_all", {"overlap": "chunked", "num_chunks": 2}),
        ]
    for shape, routing, dispatch, options in cases:
        skew = True
        extra = {"tile": 16} if routing == "token_rounding" else {}
        x = inputs(skew)  # [B, S, d], the same on every process
        # Reference: the single-device layer on this process's first device.
        ref_layer = build(routing, skew, **extra)
        ref_layer, x_ref = jax.device_put((ref_layer, x), local)
        (l0, (y0, a0)), g0 = jax.device_get(value_and_grad(ref_layer, x_ref))

        mesh = Mesh(np.array(devices).reshape(shape), ("data", "expert"))
        ep = pm.nn.ExpertParallel(mesh, dispatch=dispatch, **options)
        layer = build(routing, skew, ep, **extra)
        graphdef, state = nnx.split(layer)
        state = jax.tree.map(lambda a: to_global(a, mesh, P()), state)  # replicated parameters
        layer = nnx.merge(graphdef, state)
        x_global = to_global(x, mesh, P(("data", "expert")))  # batch split over all devices
        (l1, (y1, a1)), g1 = fetch(value_and_grad(layer, x_global))
        result = {
            "process": jax.process_index(), "devices": num_devices, "mesh": list(shape),
            "routing": routing, "dispatch": dispatch, **options,
            "y": max_rel(y0, y1), "loss": max_rel(l0, l1),
            "grad": max(max_rel(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))),
            "aux": max(max_rel(a0[k], a1[k]) for k in a0),
        }
        result["ok"] = all(result[k] < 2e-5 for k in ("y", "loss", "grad", "aux"))
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    jax.distributed.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
