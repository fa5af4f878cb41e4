"""Data and expert parallelism for the training job, on one process or many.

With `devices=1` (the default) a run uses one device and none of this. Otherwise the run
builds a `(data, expert)` mesh over `devices` devices (0: every device of every process,
`jax.devices()`), with `expert` of size `expert_parallel`:

- every MoE layer gets `pm.nn.ExpertParallel(mesh, dispatch=..., overlap=...)`: experts
  are split over `expert`, tokens over both axes;
- each batch is split over all devices (batch dimension);
- expert weights (logical axis "expert" in their `out_sharding` metadata) are sharded over
  `expert`; every other parameter, the optimizer state and the RNG state are replicated.

Multi-process: start the same command on every host with `--coordinator host:port
--num-processes N --process-id i` (see the README); `initialize` calls
`jax.distributed.initialize` before any device is touched. Every process reads the same
data (the loader is deterministic) and keeps its own shards of each batch; only process 0
writes metrics, plots and summaries, and orbax writes checkpoints from all processes.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from train.configs import Config, ConfigError

BATCH_AXES = ("data", "expert")


def initialize(coordinator: str, num_processes: int, process_id: int, cpu_collectives: str = "gloo") -> None:
    """`jax.distributed.initialize` for a run over several processes (call before using jax).

    `cpu_collectives` selects the CPU collectives backend (gloo runs anywhere; it does not
    matter on GPU hosts, where NCCL is used).
    """
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} must be in [0, num_processes={num_processes})."
        )
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
    )


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def make_mesh(cfg: Config) -> Mesh | None:
    """The run's `(data, expert)` mesh, or None for a one-device run.

    Raises ConfigError if the devices, experts or batch do not divide as needed.
    """
    available = jax.devices()
    count = len(available) if cfg.devices == 0 else cfg.devices
    if count == 1 and cfg.expert_parallel == 1:
        return None
    if count > len(available):
        raise ConfigError(f"devices={cfg.devices} but only {len(available)} devices are available.")
    if count % cfg.expert_parallel:
        raise ConfigError(
            f"expert_parallel={cfg.expert_parallel} must divide the number of devices ({count})."
        )
    if cfg.batch_size % count:
        raise ConfigError(f"batch_size={cfg.batch_size} must be divisible by the number of devices ({count}).")
    devices = np.array(available[:count]).reshape(count // cfg.expert_parallel, cfg.expert_parallel)
    return Mesh(devices, BATCH_AXES)


def param_shardings(params, mesh: Mesh):
    """NamedShardings for a parameter state: dims with logical axis "expert" over `expert`."""
    specs = nnx.get_partition_spec(params)

    def to_mesh(spec):
        return NamedSharding(mesh, P(*("expert" if name == "expert" else None for name in spec)))

    return jax.tree.map(to_mesh, specs, is_leaf=lambda x: isinstance(x, P))


def replicated(tree, mesh: Mesh):
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def to_global(tree, shardings):
    """Host values that are the same on every process -> global `jax.Array`s.

    Each process transfers only the shards of its own devices. Typed PRNG keys go through
    their raw key data.
    """

    def put(x, sharding):
        if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = put(jax.random.key_data(x), sharding)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree.map(put, tree, shardings)
