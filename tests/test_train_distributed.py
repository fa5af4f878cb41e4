"""train/distributed.py and the parallelism config fields: clear errors for bad layouts,
and the parameter shardings (expert weights over the expert axis, the rest replicated)."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from train import distributed
from train.configs import ConfigError, get_config, with_overrides
from train.trainer import build_model


def test_config_errors_name_the_field():
    tiny = get_config("tiny")
    with pytest.raises(ConfigError, match="expert_parallel=3 must divide num_experts=8"):
        with_overrides(tiny, expert_parallel=3)
    with pytest.raises(ConfigError, match="unknown config field 'comm_sms'"):  # removed in session 36
        with_overrides(tiny, overlap="chunked", comm_sms=8)
    with pytest.raises(ConfigError, match="dispatch must be one of"):
        with_overrides(tiny, dispatch="alltoall")
    with pytest.raises(ConfigError, match="overlap must be one of"):
        with_overrides(tiny, overlap="signal")
    with pytest.raises(ConfigError, match="devices must be >= 0"):
        with_overrides(tiny, devices=-1)


def test_make_mesh_errors_and_single_device():
    tiny = get_config("tiny")
    assert distributed.make_mesh(tiny) is None  # devices=1: a plain one-device run
    available = len(jax.devices())
    with pytest.raises(ConfigError, match=f"only {available} devices are available"):
        distributed.make_mesh(with_overrides(tiny, devices=available + 1))
    with pytest.raises(ConfigError, match="expert_parallel=2 must divide the number of devices"):
        distributed.make_mesh(with_overrides(tiny, devices=1, expert_parallel=2))


def test_param_shardings_split_only_expert_weights():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), distributed.BATCH_AXES)
    _, params, _ = nnx.split(build_model(get_config("tiny")), nnx.Param, ...)
    shardings = distributed.param_shardings(params, mesh)
    specs = {jax.tree_util.keystr(path): s.spec for path, s in jax.tree_util.tree_leaves_with_path(shardings)}
    moe = [k for k in specs if "w_gate_up" in k or "w_down" in k]
    assert moe and all(specs[k] == P("expert", None, None) for k in moe)
    assert all(spec == P() or all(a is None for a in spec) for k, spec in specs.items() if k not in moe)
