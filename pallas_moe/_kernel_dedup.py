"""One device compilation per distinct Mosaic GPU kernel, not one per call site.

Mosaic GPU (jax 0.11.2) serializes each kernel's MLIR module into its custom call together
with `kernel_hash = sha256(module)`, and the runtime compiles and loads a kernel once per
hash. But Pallas's lowering stamps every module with a `mosaic_gpu.dump_basename` attribute
that carries a process-wide counter (`moe_up_proj_0`, `moe_up_proj_3`, ...: the name of the
file it would be dumped to), so two calls of the same kernel at the same shapes, e.g. the
same MoE layer repeated 4 times in a model, hash differently and are compiled 4 times. That
attribute is the only byte that differs (checked on a two-layer step's lowering).

`install()` wraps Mosaic GPU's custom-call lowering rule to drop the attribute before the
module is hashed, so identical kernels share one hash and one compilation. It leaves the
attribute alone while any `MOSAIC_GPU_DUMP*` environment variable is set, so the dump
files keep their distinct names. Measured on the H100 (`benchmarks/RESULTS.md`, session
16): the 4-layer `gpu_7b_layer` model's first step compiled in 76 s instead of 136 s, the
kernels' results bitwise unchanged (`tests/test_gpu.py`).
"""

from __future__ import annotations

import functools
import os

from jax.experimental.mosaic.gpu import core as _mgpu_core

DUMP_BASENAME = "mosaic_gpu.dump_basename"


def _dumping() -> bool:
    return any(name.startswith("MOSAIC_GPU_DUMP") for name in os.environ)


def install() -> None:
    """Idempotent: wraps `jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule`, which
    Pallas's `pallas_call` / `mpmd_map` lowering looks up at every call."""
    rule = _mgpu_core._mosaic_gpu_lowering_rule
    if getattr(rule, "_drops_dump_basename", False):
        return

    @functools.wraps(rule)
    def lowering_rule(ctx, *args, module, **kwargs):
        attributes = module.operation.attributes
        if DUMP_BASENAME in attributes and not _dumping():
            del attributes[DUMP_BASENAME]
        return rule(ctx, *args, module=module, **kwargs)

    lowering_rule._drops_dump_basename = True
    _mgpu_core._mosaic_gpu_lowering_rule = lowering_rule
