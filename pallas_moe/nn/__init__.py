"""Flax NNX layers: the `MoE` module, expert parallelism and checkpoint converters."""

from pallas_moe.nn import convert
from pallas_moe.nn.expert_parallel import DISPATCHES, ExpertParallel, expert_parallel_moe
from pallas_moe.nn.functional import RouterConfig
from pallas_moe.nn.moe import MoE, SelectionBias

__all__ = [
    "MoE", "SelectionBias", "ExpertParallel", "expert_parallel_moe", "DISPATCHES",
    "RouterConfig", "convert",
]
