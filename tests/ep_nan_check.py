"""A NaN in one shard's tokens under expert parallelism: a clear error or an aux flag, no hang.

Run in its own process (the device count is fixed when jax is imported); tests/
test_reliability.py runs it with a timeout:

    python -m tests.ep_nan_check

The layer is an `MoE` with its 8 experts sharded over 8 CPU devices; token 25 (held by
shard 3) is bad. Cases, one JSON line each ({"case", "ok", ...}):

* eager_x: an eager call raises `ValueError("x contains NaN ...")` before any collective.
* checkify_x: `check_finite=True` under `jit` + `checkify`: `err.throw()` names x.
* checkify_logits_in_shard_map: x and the router are finite but token 25's logits overflow
  to Inf, so only shard 3's check inside `shard_map` fails; `err.throw()` names the logits.
* aux_flag_all_gather / aux_flag_ragged: the default (no check inside the step): the step
  finishes, `aux["nonfinite_tokens"] == 1`, and every other token's output equals the
  single-device layer's.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import checkify  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import pallas_moe as pm  # noqa: E402

D, N, E, K, T = 16, 8, 8, 2, 64
BAD_TOKEN = 25  # tokens 24..31 live on shard 3 of 8


def build(dispatch="all_gather", ep=True, **kwargs):
    mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
    parallel = pm.nn.ExpertParallel(mesh, axis="expert", dispatch=dispatch) if ep else None
    return pm.nn.MoE(D, N, E, K, backend="xla", rngs=nnx.Rngs(0), expert_parallel=parallel, **kwargs)


def tokens():
    return jax.random.normal(jax.random.key(1), (T, D))


def nan_tokens():
    return tokens().at[BAD_TOKEN, 2].set(jnp.nan)


def checked_call(layer, x):
    graphdef, state = nnx.split(layer)

    def f(state, x):
        return nnx.merge(graphdef, state)(x)

    err, out = jax.jit(checkify.checkify(f))(state, x)
    return err, out


def case_eager_x():
    try:
        build()(nan_tokens())
    except ValueError as e:
        return {"ok": str(e).startswith("x contains NaN or Inf"), "error": str(e)}
    return {"ok": False, "error": None}


def case_checkify_x():
    err, _ = checked_call(build(check_finite=True), nan_tokens())
    try:
        err.throw()
    except checkify.JaxRuntimeError as e:
        return {"ok": str(e).startswith("x contains 1 NaN or Inf"), "error": str(e)}
    return {"ok": False, "error": None}


def case_checkify_logits_in_shard_map():
    layer = build(check_finite=True)
    layer.router[...] = layer.router[...].at[0, :].set(1e10)
    x = tokens().at[BAD_TOKEN, 0].set(1e30)  # finite, but 1e30 * 1e10 overflows f32
    err, _ = checked_call(layer, x)
    try:
        err.throw()
    except checkify.JaxRuntimeError as e:
        text = str(e)
        return {"ok": "logits contains" in text and "x contains" not in text, "error": text}
    return {"ok": False, "error": None}


def aux_flag(dispatch):
    x = nan_tokens()
    step = nnx.jit(lambda m, x: m(x))
    y, aux = step(build(dispatch), x)
    y_ref, aux_ref = step(build(ep=False), x)
    y, y_ref = np.asarray(y), np.asarray(y_ref)
    others = np.arange(T) != BAD_TOKEN
    finite_others = bool(np.isfinite(y[others]).all())
    close = bool(np.allclose(y[others], y_ref[others], rtol=1e-5, atol=1e-5))
    count, count_ref = int(aux["nonfinite_tokens"]), int(aux_ref["nonfinite_tokens"])
    return {
        "ok": count == 1 and count_ref == 1 and finite_others and close,
        "nonfinite_tokens": count, "single_device": count_ref,
        "other_tokens_finite": finite_others, "other_tokens_match_single_device": close,
    }


CASES = {
    "eager_x": case_eager_x,
    "checkify_x": case_checkify_x,
    "checkify_logits_in_shard_map": case_checkify_logits_in_shard_map,
    "aux_flag_all_gather": lambda: aux_flag("all_gather"),
    "aux_flag_ragged": lambda: aux_flag("emulated_ragged_all_to_all"),
}


def main() -> int:
    assert len(jax.devices()) >= 8, jax.devices()
    for name, case in CASES.items():
        start = time.perf_counter()
        result = case()
        print(json.dumps({"case": name, **result, "seconds": round(time.perf_counter() - start, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
