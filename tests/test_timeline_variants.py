"""`benchmarks/timeline.py`'s code-level variants change what they claim in the lowered
kernel (checked by lowering for cuda on this CPU host; the GPU run times them)."""

import jax
import jax.numpy as jnp

from benchmarks import timeline
from pallas_moe.kernels.up_proj import UpProjConfig, up_proj
from tests.cuda_target import h100_target

T, D, N, E, K = 256, 128, 128, 4, 2
CONFIG = UpProjConfig(block_n=64, num_stages=3, num_consumers=2, gather="cp_async")


def _lowered_up_proj() -> str:
    sds = jax.ShapeDtypeStruct
    # A new function object each time: jit's trace cache must not reuse another variant.
    f = lambda x, tok, g, w: up_proj(x, tok, g, w, config=CONFIG)  # noqa: E731
    with h100_target():
        return jax.jit(f).trace(
            sds((T, D), jnp.bfloat16), sds((T * K,), jnp.int32), sds((E,), jnp.int32),
            sds((E, D, 2 * N), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()


def test_packed_bf16_conversions_replace_truncf():
    base = _lowered_up_proj()
    with timeline.packed_bf16_conversions():
        packed = _lowered_up_proj()
    assert "cvt.rn.bf16x2.f32" in packed and "cvt.rn.bf16x2.f32" not in base
    assert "truncf" in base and "truncf" not in packed
    assert _lowered_up_proj() == base  # the patch is undone on exit


def test_storel2_keeps_the_stores_and_folds_their_rows():
    base = _lowered_up_proj()
    with timeline.ablated("storel2"):
        folded = _lowered_up_proj()
    with timeline.ablated("nostore"):
        none = _lowered_up_proj()
    assert folded != base and none != base
    assert len(none) < len(base) < len(folded)  # no stores; the same stores plus the fold


def test_nowait_drops_the_read_only_waits():
    base = _lowered_up_proj()
    with timeline.ablated("nowait"):
        nowait = _lowered_up_proj()
    assert nowait != base and len(nowait) < len(base)
    assert _lowered_up_proj() == base  # the patch is undone on exit


def test_lsu_store_halves_keep_only_their_half():
    base = _lowered_up_proj()
    with timeline.ablated("lsuload"):
        load = _lowered_up_proj()
    with timeline.ablated("lsuwrite"):
        write = _lowered_up_proj()
    assert "ld.shared.v4.b32" in load and "st.global.v4.b32" in load
    assert "ld.shared.v4.b32" not in write and "st.global.v4.b32" in write
    assert "st.global.v4.b32" not in base and _lowered_up_proj() == base
