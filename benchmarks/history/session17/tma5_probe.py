"""Prototype: one TMA that lands W1's gate columns [c0, c0+bn) and up columns n+[c0, c0+bn)
of K rows [r0, r0+64) side by side in a [64, 2*bn] (8, 64)-tiled, 128B-swizzled SMEM tile,
through inline_mgpu (a 5-D box Pallas cannot express), then one N=2bn wgmma."""
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.experimental.mosaic.gpu as mgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, nvvm
sys.path.insert(0, ".")
from pallas_moe.kernels import _common

K_BLK, BN = 64, 128
TF = _common.mma_transforms(jnp.bfloat16)


def scalar_arg(v):
    return plgpu.layout_cast(jnp.full((128,), v, jnp.int32), plgpu.Layout.WG_STRIDED((128,), vec_size=1))


def fused_weight_copy(w3, row0, col0, dst, bar):
    """w3: GMEM [R, 2, n] bf16 (W1 reshaped); dst: SMEM [64, 2*bn] tiled; bar: SMEM i32 [2]
    mbarrier (1 arrival: this copy's expect_tx)."""
    rows, cols = dst.shape[0], dst.shape[1] // 2

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_STRIDED((128,), vec_size=1),
                                  plgpu.Layout.WG_STRIDED((128,), vec_size=1),
                                  plgpu.RefType(transforms=TF), plgpu.RefType()))
    def _copy(ctx, src, r0, c0, dst_ref, bar_ref):
        utils = mgpu.utils
        index = ir.IndexType.get()
        i32 = ir.IntegerType.get_signless(32)

        def scalar(fa):
            from jaxlib.mlir.dialects import vector
            reg = fa.registers.flat[0]
            if isinstance(reg.type, ir.VectorType):
                reg = vector.extract(reg, dynamic_position=[],
                                     static_position=ir.DenseI64ArrayAttr.get([0]))
            return arith.index_cast(index, reg)

        row = scalar(r0)
        col = scalar(c0)
        kt, nt, kr, cc = ir.MemRefType(dst_ref.type).shape
        dst5 = utils.memref_unfold(dst_ref, 1, (2, nt // 2))  # [kt, half, ct, kr, cc]
        barrier = utils.BarrierRef(utils.memref_ptr(bar_ref), utils.c(0, i32), None, 1)
        ctx.async_copy(
            src_ref=src, dst_ref=dst5,
            gmem_slice=(utils.ds(row, rows), slice(None), utils.ds(col, cols)),
            gmem_transform=(mgpu.TransposeTransform((1, 0, 2)), mgpu.TileTransform((8, 64)),
                            mgpu.TransposeTransform((1, 0, 2, 3, 4))),
            swizzle=128, barrier=barrier, arrive=True,
        )

    _copy(w3, scalar_arg(row0), scalar_arg(col0), dst, bar)


def mbar_init(bar):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _init(ctx, ref):
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        nvvm.mbarrier_init(utils.memref_ptr(ref), utils.c(1, i32),
                           predicate=utils.single_thread_predicate(utils.ThreadSubset.BLOCK))
        from jax._src.lib.mlir.dialects import gpu
        gpu.barrier()
    _init(bar)


def mbar_wait(bar, parity):
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def _wait(ctx, ref):
        utils = mgpu.utils
        i32 = ir.IntegerType.get_signless(32)
        nvvm.mbarrier_try_wait_parity(utils.memref_ptr(ref), utils.c(parity, i32),
                                      arith.constant(i32, 10000000))
    _wait(bar)


def make(interpret, n):
    def body(ids_ref, a_ref, w3_ref, o_ref, a_s, b_s, bar, wbar):
        e = ids_ref[0]
        k0 = ids_ref[1]
        c0 = ids_ref[2]
        plgpu.copy_gmem_to_smem(a_ref, a_s, bar)
        if interpret:
            w = w3_ref
            for r in range(0, K_BLK, 8):
                for h in range(2):
                    plgpu.copy_gmem_to_smem(w.at[pl.ds(e * 1024 + k0 + r, 8), h, pl.ds(c0, BN)],
                                            b_s.at[pl.ds(r, 8), pl.ds(h * BN, BN)], bar)
        else:
            mbar_init(wbar)
            fused_weight_copy(w3_ref, e * 1024 + k0, c0, b_s, wbar)
        plgpu.barrier_wait(bar)
        if not interpret:
            mbar_wait(wbar, 0)
        def sc(acc):
            plgpu.wgmma(acc, a_s, b_s)
            plgpu.wgmma_wait(0)
            return acc[...]
        o_ref[...] = pl.run_scoped(sc, plgpu.ACC((64, 2 * BN), jnp.float32))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((64, 2 * BN), jnp.float32),
        scratch_types=[plgpu.SMEM((64, K_BLK), jnp.bfloat16, transforms=TF),
                       plgpu.SMEM((K_BLK, 2 * BN), jnp.bfloat16, transforms=TF),
                       plgpu.Barrier(num_arrivals=1 + (2 * K_BLK // 8 if interpret else 0)),
                       plgpu.SMEM((2,), jnp.int32)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=plgpu.InterpretGPUParams() if interpret else None)


E, D, N = 3, 1024, 512
a = jax.random.normal(jax.random.key(0), (64, K_BLK), jnp.bfloat16)
w = jax.random.normal(jax.random.key(1), (E, D, 2 * N), jnp.bfloat16)
w3 = w.reshape(E * D, 2, N)
e, k0, c0 = 2, 320, 256
ids = jnp.array([e, k0, c0], jnp.int32)
cols = np.r_[c0:c0 + BN, N + c0:N + c0 + BN]
ref = jnp.dot(a.astype(jnp.float32), w[e, k0:k0 + K_BLK][:, cols].astype(jnp.float32))
mode = sys.argv[1]
if mode == "interpret":
    out = make(True, N)(ids, a, w3)
    print("interpret max err", float(jnp.abs(out - ref).max()))
elif mode == "lower":
    sys.path.insert(0, ".")
    from tests.cuda_target import h100_target
    with h100_target():
        txt = jax.jit(make(False, N)).trace(ids, a, w3).lower(lowering_platforms=("cuda",)).as_text()
    print("lowered OK", len(txt))
else:
    jnp.zeros(1 << 26, jnp.float32).block_until_ready()
    out = make(False, N)(ids, a, w3)
    err = float(jnp.abs(out - ref).max())
    print("gpu max err", err, "rel", err / float(jnp.abs(ref).max()))
