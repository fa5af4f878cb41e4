"""Flax NNX layers: the `MoE` module, expert parallelism and checkpoint converters.

Module::

    import jax, optax
    from flax import nnx
    import pallas_moe as pm

    layer = pm.nn.MoE(
        d_model=1024, d_expert=256, num_experts=64, top_k=8,
        routing="token_rounding", tile=128,              # or routing="topk"
        num_shared_experts=1, dtype=jax.numpy.bfloat16,  # bf16 compute, fp32 params
        rngs=nnx.Rngs(0),
    )
    y, aux = layer(x)                 # x [..., 1024] -> y [..., 1024]
    loss = task_loss(y) + aux["loss"]  # weighted load-balance + z-loss
    optimizer = nnx.Optimizer(layer, optax.adamw(1e-3), wrt=nnx.Param)

Aux-loss-free balancing: `MoE(..., score="sigmoid", selection_bias=True)` keeps a
`SelectionBias` variable (not an `nnx.Param`, so the optimizer never touches it); call
`layer.update_bias(aux)` once per step after the forward.

Expert parallelism::

    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    ep = pm.nn.ExpertParallel(mesh, axis="expert", dispatch="ragged_all_to_all")  # GPU/TPU
    layer = pm.nn.MoE(1024, 256, 64, 8, rngs=nnx.Rngs(0), expert_parallel=ep)
    y, aux = nnx.jit(lambda m, x: m(x))(layer, x)   # x [T, d]: T split over all 8 devices

Experts are split over the "expert" axis; every device routes its own token shard; the
same `pm.moe_ffn` kernels run each shard's local experts. Dispatch "all_gather" gathers
the tokens of the expert group and reduce-scatters the outputs (`~2*T_l*G*d` elements per
shard whatever the routing; runs everywhere, best at small EP or `K >= G`);
"ragged_all_to_all" sends only the routed rows (`~2*T_l*K*d*(G-1)/G` elements; best when
`K < G` and at scale; not available on XLA:CPU). Token rounding rounds each expert's
*global* count, so an EP layer routes exactly like the single-device layer over the
whole batch. With shared experts, their MLP overlaps the dispatch; with
`ExpertParallel(..., dispatch="ragged_all_to_all", overlap="chunked", num_chunks=C)` the
down-proj runs in C chunks and each chunk's combine overlaps the next chunk's down-proj
(`pallas_moe.nn.overlap_check` reads both from a compiled module). See
`pallas_moe.nn.expert_parallel` for details and docs/ep_overlap.md for the design.

Checkpoints: `pallas_moe.nn.convert` maps PyTorch layouts (per-expert `gate_proj/up_proj/
down_proj`, fused `[E, 2n, d]` / `[E, d, n]`) to ours (`[E, d, 2n]`, `[E, n, d]`) and back.

Hugging Face families (qwen3_moe, mixtral, olmoe, deepseek_v3, qwen2_moe, gpt_oss)::

    layer = pm.nn.MoE.from_hf_config(config_dict, rngs=nnx.Rngs(0))
    pallas_moe.nn.convert.load_hf_moe(layer, state_dict, family=config_dict["model_type"],
                                      prefix="model.layers.0.mlp.")

See `pallas_moe.nn.families` for each family's names and layouts.
"""

from pallas_moe.nn import convert, families, overlap_check
from pallas_moe.nn.expert_parallel import (
    DISPATCHES, OVERLAPS, ExpertParallel, expert_parallel_moe, ragged_exchange, use_fast_ragged_all_to_all,
)
from pallas_moe.nn.functional import RouterConfig
from pallas_moe.nn.moe import MoE, SelectionBias

__all__ = [
    "MoE", "SelectionBias", "ExpertParallel", "expert_parallel_moe", "DISPATCHES", "OVERLAPS",
    "ragged_exchange", "use_fast_ragged_all_to_all",
    "RouterConfig", "convert", "families", "overlap_check",
]
