"""md5 of the default forward and backward jaxprs (H100 configs) at five widths, to prove a
removal leaves the defaults' traced kernels unchanged. Run from a checkout's root:
PYTHONPATH=. python benchmarks/history/session64/jaxpr_hash.py (bf16, H100 configs only)."""
import hashlib

import jax
import jax.numpy as jnp

import pallas_moe as pm
from pallas_moe.kernels.moe_backward import BackwardConfig, moe_backward
from pallas_moe.kernels.moe_forward import ForwardConfig, moe_forward
from pallas_moe.kernels.schedules import plan_schedules

H100 = "NVIDIA H100 80GB HBM3"
SHAPES = [(4096, 1536, 256, 32, 8), (4096, 4096, 512, 32, 8), (4096, 2048, 768, 32, 8),
          (2048, 2880, 2880, 16, 4), (4096, 1536, 1024, 32, 8)]


def hashes(T, d, n, E, K):
    fc = ForwardConfig.for_shape(d, n, num_sms=132, device_kind=H100)
    bc = BackwardConfig.for_shape(d, n, num_sms=132, device_kind=H100)
    sds = jax.ShapeDtypeStruct
    args = (sds((T, d), jnp.bfloat16), sds((T, E), jnp.float32), sds((E, d, 2 * n), jnp.bfloat16),
            sds((E, n, d), jnp.bfloat16))

    def fwd(x, logits, w1, w2):
        plan = pm.routing.topk_plan(logits, K)
        return moe_forward(x, plan, w1, w2, config=fc, schedules=plan_schedules(plan, fc, bc))

    def bwd(x, logits, w1, w2):
        plan = pm.routing.topk_plan(logits, K)
        h = jnp.zeros((plan.capacity, 2 * n), jnp.bfloat16)
        return moe_backward(x, h, plan, w1, w2, x, config=bc,
                            schedules=plan_schedules(plan, fc, bc))

    return [hashlib.md5(str(jax.make_jaxpr(f)(*args)).encode()).hexdigest()[:12]
            for f in (fwd, bwd)]


if __name__ == "__main__":
    for shape in SHAPES:
        print(shape, *hashes(*shape), flush=True)
