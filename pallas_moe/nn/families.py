"""Hugging Face MoE families: their config fields and their parameter names and layouts.

Each supported family (`FAMILIES`) is described once here, from its published modeling
code in `transformers` (`modeling_<family>.py`):

| family      | router                       | experts                           | shared expert            |
|-------------|------------------------------|-----------------------------------|--------------------------|
| qwen3_moe   | softmax, top-K, opt. renorm  | SwiGLU                            | -                        |
| mixtral     | softmax, top-K, renorm       | SwiGLU (`w1` gate, `w3` up, `w2`) | -                        |
| olmoe       | softmax, top-K, opt. renorm  | SwiGLU                            | -                        |
| deepseek_v3 | sigmoid + correction bias,   | SwiGLU                            | `n_shared_experts` wide  |
|             | grouped top-K, renorm, scale |                                   |                          |
| qwen2_moe   | softmax, top-K, opt. renorm  | SwiGLU                            | sigmoid-gated            |
| gpt_oss     | logits + bias, top-K,        | clamped SwiGLU, biases,           | -                        |
|             | softmax over the K           | gate/up interleaved               |                          |

Names are relative to the MoE block (the module under `model.layers.{i}.mlp.`, or
Mixtral's `block_sparse_moe.` in its original checkpoints); `load_hf_moe` takes the prefix.

Two expert layouts:

* "per_expert": one PyTorch `nn.Linear` per expert and projection, `weight [out, in]`:
  gate/up `[n, d]`, down `[d, n]` (the original checkpoints of every family but gpt-oss).
* "fused": one tensor per projection over all experts (transformers v5 and gpt-oss).
  `experts.gate_up_proj [E, 2n, d]` (gate rows first) and `experts.down_proj [E, d, n]`,
  except gpt-oss, which stores inputs first: `gate_up_proj [E, d, 2n]` with gate and up
  *interleaved* along the last axis (column 2i gate unit i, 2i+1 up unit i),
  `gate_up_proj_bias [E, 2n]` (interleaved alike), `down_proj [E, n, d]`, `down_proj_bias [E, d]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from pallas_moe.ops.activation import SwiGLU

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "qwen2_moe", "gpt_oss")
LAYOUTS = ("per_expert", "fused")
GPT_OSS_ALPHA = 1.702  # fixed in GptOssExperts; the config carries only `swiglu_limit`


@dataclasses.dataclass(frozen=True)
class FamilyNames:
    """Parameter names of one family's MoE block, relative to the block's prefix.

    Attributes:
      router: router weight `[E, d]` (an `nn.Linear(d, E)`).
      router_bias: router bias `[E]`, or None.
      selection_bias: score-correction bias `[E]` (moves selection only), or None.
      per_expert: (gate, up, down) weight names with an `{e}` field, PyTorch `[out, in]`
        layout; None when the family has no per-expert layout.
      fused_gate_up, fused_down: fused expert weight names.
      fused_inputs_first: True when the fused tensors are `[E, d, 2n]` / `[E, n, d]` with
        gate/up interleaved (gpt-oss); False for `[E, 2n, d]` (gate first) / `[E, d, n]`.
      fused_gate_up_bias, fused_down_bias: expert bias names `[E, 2n]` / `[E, d]`, or None.
      shared: (gate, up, down) weight names of the shared expert MLP (`[m, d]`, `[m, d]`,
        `[d, m]`), or None.
      shared_gate: the shared expert's gate weight `[1, d]`, or None.
    """

    router: str
    per_expert: tuple[str, str, str] | None
    fused_gate_up: str = "experts.gate_up_proj"
    fused_down: str = "experts.down_proj"
    fused_inputs_first: bool = False
    router_bias: str | None = None
    selection_bias: str | None = None
    fused_gate_up_bias: str | None = None
    fused_down_bias: str | None = None
    shared: tuple[str, str, str] | None = None
    shared_gate: str | None = None


_PROJ = ("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight")

FAMILY_NAMES: dict[str, FamilyNames] = {
    "qwen3_moe": FamilyNames(router="gate.weight", per_expert=_PROJ),
    "olmoe": FamilyNames(router="gate.weight", per_expert=_PROJ),
    "mixtral": FamilyNames(
        router="gate.weight",
        per_expert=("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
    ),
    "deepseek_v3": FamilyNames(
        router="gate.weight",
        selection_bias="gate.e_score_correction_bias",
        per_expert=_PROJ,
        shared=(
            "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
            "shared_experts.down_proj.weight",
        ),
    ),
    "qwen2_moe": FamilyNames(
        router="gate.weight",
        per_expert=_PROJ,
        shared=(
            "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
            "shared_expert.down_proj.weight",
        ),
        shared_gate="shared_expert_gate.weight",
    ),
    "gpt_oss": FamilyNames(
        router="router.weight",
        router_bias="router.bias",
        per_expert=None,
        fused_inputs_first=True,
        fused_gate_up_bias="experts.gate_up_proj_bias",
        fused_down_bias="experts.down_proj_bias",
    ),
}


def check_family(family) -> str:
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {list(FAMILIES)}, got {family!r}.")
    return family


def _as_dict(config) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return dict(config.to_dict())
    raise TypeError(f"config must be a dict (a config.json's contents), got {type(config).__name__}.")


def moe_kwargs_from_hf_config(config: Mapping[str, Any], family: str | None = None) -> dict[str, Any]:
    """`pm.nn.MoE` arguments of one MoE layer of a Hugging Face config.

    Args:
      config: the model's `config.json` as a dict (or a `transformers` config object).
      family: one of `FAMILIES`; default `config["model_type"]`. When both are given
        they must agree.

    Returns:
      A dict of `MoE` keyword arguments: d_model, d_expert, num_experts, top_k, score,
      renormalize, and whichever of selection_bias, num_groups, topk_groups,
      routed_scaling_factor, num_shared_experts, d_shared, shared_expert_gate,
      router_bias, expert_bias, activation, load_balance_weight, z_loss_weight the family
      sets. Missing optional fields take the `transformers` config class defaults.
    """
    config = _as_dict(config)
    model_type = config.get("model_type")
    if family is None:
        if model_type is None:
            raise ValueError(f"config has no 'model_type'; pass family= (one of {list(FAMILIES)}).")
        family = model_type
    check_family(family)
    if model_type is not None and model_type != family:
        raise ValueError(f"family={family!r} but config['model_type'] is {model_type!r}.")

    def field(name: str, default: Any = dataclasses.MISSING) -> Any:
        value = config.get(name)
        if value is not None:
            return value
        if default is dataclasses.MISSING:
            raise ValueError(f"{family} config needs the field {name!r} (missing or null).")
        return default

    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{family} config has hidden_act={act!r}; the experts support 'silu' only.")

    kwargs: dict[str, Any] = {"d_model": field("hidden_size")}
    if "router_aux_loss_coef" in config:
        kwargs["load_balance_weight"] = float(config["router_aux_loss_coef"])
    if family in ("qwen3_moe", "olmoe", "qwen2_moe"):
        kwargs.update(
            d_expert=field("moe_intermediate_size" if family != "olmoe" else "intermediate_size"),
            num_experts=field("num_experts"),
            top_k=field("num_experts_per_tok"),
            score="softmax_topk",
            renormalize=bool(field("norm_topk_prob", False)),
        )
        if family == "olmoe" and "router_z_loss_coef" in config:
            kwargs["z_loss_weight"] = float(config["router_z_loss_coef"])
        if family == "qwen2_moe":
            shared_width = field("shared_expert_intermediate_size")
            if shared_width:
                kwargs.update(num_shared_experts=1, d_shared=shared_width, shared_expert_gate=True)
    elif family == "mixtral":
        # softmax over all E, top-K, renormalize == softmax over the K chosen logits.
        kwargs.update(
            d_expert=field("intermediate_size"),
            num_experts=field("num_local_experts"),
            top_k=field("num_experts_per_tok"),
            score="topk_softmax",
        )
    elif family == "deepseek_v3":
        scoring = config.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"deepseek_v3 config has scoring_func={scoring!r}; DeepSeek-V3 routes with 'sigmoid'.")
        method = config.get("topk_method", "noaux_tc")
        if method != "noaux_tc":
            raise ValueError(f"deepseek_v3 config has topk_method={method!r}; only 'noaux_tc' is supported.")
        num_groups, topk_groups = field("n_group"), field("topk_group")
        kwargs.update(
            d_expert=field("moe_intermediate_size"),
            num_experts=field("n_routed_experts"),
            top_k=field("num_experts_per_tok"),
            score="sigmoid",
            renormalize=bool(field("norm_topk_prob", True)),
            selection_bias=True,
            routed_scaling_factor=float(field("routed_scaling_factor", 2.5)),
        )
        if num_groups > 1:  # one group is plain top-K
            kwargs.update(num_groups=num_groups, topk_groups=topk_groups)
        shared = field("n_shared_experts", 1)
        if shared:
            kwargs["num_shared_experts"] = shared  # width n_shared_experts * moe_intermediate_size
    else:  # gpt_oss
        kwargs.update(
            d_expert=field("intermediate_size"),
            num_experts=field("num_local_experts"),
            top_k=field("num_experts_per_tok"),
            score="topk_softmax",
            router_bias=True,
            expert_bias=True,
            activation=SwiGLU.clamped(alpha=GPT_OSS_ALPHA, limit=float(field("swiglu_limit", 7.0))),
        )
    return kwargs
