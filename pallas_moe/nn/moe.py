"""`pallas_moe.nn.MoE`: a Flax NNX Mixture-of-Experts layer (SwiGLU experts).

    layer = pm.nn.MoE(d_model, d_expert, num_experts, top_k, *, routing="topk", rngs=nnx.Rngs(0))
    y, aux = layer(x)          # x [..., d_model] -> y [..., d_model]; aux: losses and stats
    loss = task_loss + aux["loss"]
    layer.update_bias(aux)     # aux-loss-free balancing (selection_bias=True), outside the optimizer

Parameters (logical axis names in `out_sharding` metadata):

| name                  | shape        | logical axes               |
|-----------------------|--------------|----------------------------|
| router                | [d, E]       | ("embed", None)            |
| w_gate_up             | [E, d, 2n]   | ("expert", "embed", "mlp") |
| w_down                | [E, n, d]    | ("expert", "mlp", "embed") |
| shared_gate_up (opt.) | [d, 2m]      | ("embed", "mlp")           |
| shared_down (opt.)    | [m, d]       | ("mlp", "embed")           |
| shared_gate (opt.)    | [d, 1]       | ("embed", None)            |
| router_bias (opt.)    | [E]          | (None,)                    |
| b_gate_up (opt.)      | [E, 2n]      | ("expert", "mlp")          |
| b_down (opt.)         | [E, d]       | ("expert", "embed")        |
| selection_bias (opt.) | [E]          | (None,)  a `SelectionBias`, not an `nnx.Param` |

Hugging Face checkpoints: `MoE.from_hf_config(config)` builds the layer of a family's
config (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, Qwen2-MoE, gpt-oss) and
`pallas_moe.nn.convert.load_hf_moe(layer, state_dict, family=...)` loads its weights.

The router and the bias stay replicated over experts: every token shard routes over all E.
Map logical names to mesh axes with `nnx.logical_axis_rules(...)` or `sharding_rules=`;
parameters are sharded eagerly only when a mesh is set (`jax.set_mesh`) and every logical
name resolves to one of its axes (Flax's eager sharding); otherwise the names are metadata
for `nnx.get_partition_spec`.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd

from pallas_moe import _checks
from pallas_moe.nn import functional as F
from pallas_moe.nn.expert_parallel import ExpertParallel, expert_parallel_moe
from pallas_moe.numerics import Numerics, check_activation_dtype, check_numerics
from pallas_moe.ops.activation import SwiGLU, check_activation
from pallas_moe.ops.moe_ffn import BACKENDS, moe_ffn
from pallas_moe.routing.aux import update_selection_bias

Initializer = Callable[..., jax.Array]

ROUTER_AXES = ("embed", None)
GATE_UP_AXES = ("expert", "embed", "mlp")
DOWN_AXES = ("expert", "mlp", "embed")
SHARED_GATE_UP_AXES = ("embed", "mlp")
SHARED_DOWN_AXES = ("mlp", "embed")
SHARED_GATE_AXES = ("embed", None)
BIAS_AXES = (None,)
GATE_UP_BIAS_AXES = ("expert", "mlp")
DOWN_BIAS_AXES = ("expert", "embed")


class Fp8Experts(nnx.Variable):
    """A layer's routed experts in e4m3 (`pm.quant.QuantizedExperts`), set by
    `MoE.quantize_fp8`. Not an `nnx.Param`: optimizers and `nnx.state(model, nnx.Param)`
    leave it alone."""


class SelectionBias(nnx.Variable):
    """Aux-loss-free selection bias f32[E] (DeepSeek-V3).

    Deliberately not an `nnx.Param`: `nnx.Optimizer(model, tx, wrt=nnx.Param)` and
    `nnx.grad` over `nnx.Param` never touch it. Update it with `MoE.update_bias(aux)`
    (`pm.routing.update_selection_bias`) once per step, outside the optimizer.
    """


def expert_init(in_axis: int = -2, out_axis: int = -1) -> Initializer:
    """Fan-in scaled truncated normal per expert for `[E, fan_in, fan_out]` weights."""
    return nnx.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=(0,)
    )


def _eager_shardable(axes: tuple, sharding_rules) -> bool:
    """Whether Flax can shard a parameter with these logical axes right now."""
    if not nnx.using_eager_sharding():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    spec = core_spmd.apply_rules(jax.sharding.PartitionSpec(*axes), sharding_rules)
    names = [a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))]
    return all(name in mesh.axis_names for name in names)


def _variable(cls, value: jax.Array, axes: tuple, sharding_rules) -> nnx.Variable:
    metadata: dict[str, Any] = {"out_sharding": axes}
    if sharding_rules is not None:
        metadata["sharding_rules"] = sharding_rules
    return cls(value, eager_sharding=_eager_shardable(axes, sharding_rules), **metadata)


def _is_explicit(mesh) -> bool:
    return mesh is not None and not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types


def _reshape_like(y: jax.Array, x: jax.Array) -> jax.Array:
    """y [T, d] -> x's shape [..., d]; under an explicit-sharding mesh y takes x's sharding."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    if _is_explicit(getattr(sharding, "mesh", None)):
        return y.reshape(x.shape, out_sharding=sharding)
    return y.reshape(x.shape)


class MoE(nnx.Module):
    """Mixture-of-Experts layer with SwiGLU experts, optional shared experts and EP.

    `y = sum_k s_k * (act(x W1[e_k] + b1[e_k]) W2[e_k] + b2[e_k]) + g(x) * shared(x)`, with
    `act = silu(gate) * up` by default, the biases optional, `g(x) = sigmoid(x w_g)` with a
    gated shared expert (else 1), and the routed part computed by `pm.moe_ffn` over a
    `DispatchPlan` from top-K or token-rounding routing.

    Args:
      d_model: d, model width.
      d_expert: n, hidden width of one expert.
      num_experts: E.
      top_k: K, experts per token (1 <= K <= E).
      routing: "topk" or "token_rounding" (counts rounded to multiples of `tile`).
      rngs: `nnx.Rngs` for parameter init (and for `rounding="stochastic"`, a "routing"
        stream, falling back to "default").
      score: router score order, "softmax_topk" | "topk_softmax" | "sigmoid".
      renormalize: rescale each token's K weights to sum to 1.
      tile: token-rounding tile (and the tile of the padding-waste stats).
      rounding: token-rounding mode, "nearest" | "up" | "down" | "stochastic" | "balance".
      load_balance_weight, z_loss_weight: weights of the aux losses in `aux["loss"]`.
      selection_bias: keep an aux-loss-free selection bias (needs score="sigmoid").
      bias_update_rate: default rate of `update_bias`.
      num_shared_experts: number of shared (always-on) experts, fused into one dense SwiGLU
        MLP of width `d_shared` (default `num_shared_experts * d_expert`).
      d_shared: width of the shared MLP.
      shared_expert_gate: scale the shared MLP's output by `sigmoid(x @ shared_gate)`, a
        learned [d, 1] gate computed in fp32 (Qwen2-MoE). Needs num_shared_experts >= 1.
      num_groups, topk_groups: grouped top-K (DeepSeek-V3 `n_group` / `topk_group`): each
        token picks its K experts from its best `topk_groups` of `num_groups` expert groups,
        a group scored by the sum of its top-2 (biased) scores. routing="topk" only.
      routed_scaling_factor: multiplies every routed weight (DeepSeek-V3; default 1).
      router_bias: learn a bias [E] added to the router logits (gpt-oss).
      expert_bias: learn expert biases `b_gate_up` [E, 2n] and `b_down` [E, d] (gpt-oss).
      activation: the experts' `pm.ops.SwiGLU` spec: `SwiGLU()` (default) or
        `SwiGLU.clamped(alpha=1.702, limit=7.0)` (gpt-oss).
      backend: `pm.moe_ffn` backend, "auto" | "mosaic" | "interpret" | "xla".
      dtype: compute dtype. Parameters are cast to it before `moe_ffn` and the shared MLP;
        None promotes the input and parameter dtypes. Router logits are always fp32.
      param_dtype: parameter storage dtype (default fp32).
      router_init, kernel_init: initializers for the router [d, E] and for the expert
        weights [E, fan_in, fan_out] (default fan-in truncated normal per expert); the
        shared MLP uses `shared_init` (default lecun normal).
      sharding_rules: logical-to-mesh axis rules stored with every parameter.
      expert_parallel: an `ExpertParallel` to shard experts over a mesh axis (see
        `pallas_moe.nn.expert_parallel`); None runs on one device (or under plain jit
        sharding).
      check_finite: NaN/Inf checks of x, the router, the selection bias and the router
        logits, in that order (so a NaN in x is reported as x). None (default): eager
        calls raise a `ValueError`; under `jit` nothing is checked and nothing is paid (read
        `aux["nonfinite_tokens"]` after the step instead). True: also under `jit`, through
        `jax.experimental.checkify` (wrap the jitted step in `checkify.checkify` and call
        `err.throw()`); no host callback, so it works under expert parallelism. False: never.
      numerics: `pm.Numerics` switches (default `Numerics()`): the aggregation order of
        `moe_ffn` (the bf16 modes need dtype=bfloat16), SwiGLU fusion in the kernels, and
        the router's dtype (`router_dtype`). See `pallas_moe.numerics`.
      kernel_config: a `pallas_moe.kernels.KernelConfig` for `moe_ffn`'s kernels (block
        sizes, row loader, `approx_math`), or None for `KernelConfig.for_shape` defaults.
        Not with backend="xla" (no kernels) nor with expert_parallel (the shards use the
        defaults); with backend="auto" it is ignored where `moe_ffn` picks "xla".

    Call: `y, aux = layer(x, key=None)`; x [..., d_model] float; y has x's leading shape and
    the compute dtype; `key` overrides the stream for stochastic rounding. `aux` is a dict
    (see `functional.finish_aux`): "loss" (the weighted aux total to add to the task loss),
    "load_balance_loss", "z_loss", "counts", "tc_counts", "dropped_rows", "added_rows",
    "padding_rows", "padding_fraction", "tc_padding_rows", "tc_padding_fraction", "max_load",
    "capacity_dropped_rows", and "nonfinite_tokens" (i32[], tokens whose router logits hold
    NaN/Inf: a cheap on-device flag a trainer can read after the step).
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        top_k: int,
        *,
        routing: str = "topk",
        rngs: nnx.Rngs,
        score: str = "softmax_topk",
        renormalize: bool = False,
        tile: int = 128,
        rounding: str = "nearest",
        load_balance_weight: float = 1e-2,
        z_loss_weight: float = 1e-3,
        selection_bias: bool = False,
        bias_update_rate: float = 1e-3,
        num_shared_experts: int = 0,
        d_shared: int | None = None,
        backend: str = "auto",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        router_init: Initializer | None = None,
        kernel_init: Initializer | None = None,
        shared_init: Initializer | None = None,
        sharding_rules: Any = None,
        expert_parallel: ExpertParallel | None = None,
        shared_expert_gate: bool = False,
        num_groups: int | None = None,
        topk_groups: int | None = None,
        routed_scaling_factor: float = 1.0,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: SwiGLU = SwiGLU(),
        check_finite: bool | None = None,
        numerics: Numerics | None = None,
        kernel_config: Any = None,
    ):
        d_model = _checks.check_positive_int("d_model", d_model)
        d_expert = _checks.check_positive_int("d_expert", d_expert)
        self.config = F.RouterConfig(
            num_experts=num_experts, top_k=top_k, routing=routing, score=score,
            renormalize=bool(renormalize), tile=tile, rounding=rounding,
            load_balance_weight=load_balance_weight, z_loss_weight=z_loss_weight,
            num_groups=num_groups, topk_groups=topk_groups,
            routed_scaling_factor=routed_scaling_factor,
        )
        self.activation = check_activation(activation)
        if shared_expert_gate and not num_shared_experts:
            raise ValueError("shared_expert_gate=True needs a shared expert; set num_shared_experts >= 1.")
        if selection_bias and score != "sigmoid":
            raise ValueError(
                f"selection_bias=True needs score='sigmoid' (the bias shifts sigmoid scores), "
                f"got score={score!r}."
            )
        if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be a non-negative int, got {num_shared_experts!r}.")
        if d_shared is not None:
            d_shared = _checks.check_positive_int("d_shared", d_shared)
            if num_shared_experts == 0:
                raise ValueError("d_shared is set but num_shared_experts=0; set num_shared_experts >= 1.")
        _checks.check_choice("backend", backend, BACKENDS)
        _checks.check_finite_number("bias_update_rate", bias_update_rate, minimum=0.0)
        if check_finite not in (None, True, False):
            raise ValueError(f"check_finite must be None, True or False, got {check_finite!r}.")
        if expert_parallel is not None:
            if not isinstance(expert_parallel, ExpertParallel):
                raise TypeError(
                    f"expert_parallel must be a pallas_moe.nn.ExpertParallel, got {type(expert_parallel).__name__}."
                )
            expert_parallel.check_experts(num_experts)

        if kernel_config is not None:
            from pallas_moe.kernels.config import KernelConfig  # Pallas only when asked for

            if not isinstance(kernel_config, KernelConfig):
                raise TypeError(
                    "kernel_config must be a pallas_moe.kernels.KernelConfig or None, got "
                    f"{type(kernel_config).__name__}."
                )
            if backend == "xla":
                raise ValueError("kernel_config sets kernel block sizes; backend='xla' runs no kernels.")
            if expert_parallel is not None:
                raise ValueError(
                    "kernel_config applies to the one-device layer; under expert_parallel each "
                    "shard's kernels take their KernelConfig.for_shape defaults. Pass one or the other."
                )
        self.kernel_config = kernel_config
        self.d_model, self.d_expert = d_model, d_expert
        self.num_experts, self.top_k = num_experts, top_k
        self.backend = backend
        self.dtype, self.param_dtype = dtype, param_dtype
        self.bias_update_rate = float(bias_update_rate)
        self.expert_parallel = expert_parallel
        self.check_finite = check_finite
        self.numerics = check_numerics(numerics)
        if dtype is not None:
            check_activation_dtype(self.numerics, dtype)

        router_init = router_init or nnx.initializers.normal(stddev=d_model**-0.5)
        gate_up_init = kernel_init or expert_init()
        down_init = kernel_init or expert_init()
        shared_init = shared_init or nnx.initializers.lecun_normal()
        key = rngs.params
        self.router = _variable(
            nnx.Param, router_init(key(), (d_model, num_experts), param_dtype), ROUTER_AXES, sharding_rules
        )  # [d, E]
        self.w_gate_up = _variable(
            nnx.Param, gate_up_init(key(), (num_experts, d_model, 2 * d_expert), param_dtype),
            GATE_UP_AXES, sharding_rules,
        )  # [E, d, 2n]
        self.w_down = _variable(
            nnx.Param, down_init(key(), (num_experts, d_expert, d_model), param_dtype), DOWN_AXES, sharding_rules
        )  # [E, n, d]
        if num_shared_experts:
            m = d_shared or num_shared_experts * d_expert
            self.shared_gate_up = _variable(
                nnx.Param, shared_init(key(), (d_model, 2 * m), param_dtype), SHARED_GATE_UP_AXES, sharding_rules
            )  # [d, 2m]
            self.shared_down = _variable(
                nnx.Param, shared_init(key(), (m, d_model), param_dtype), SHARED_DOWN_AXES, sharding_rules
            )  # [m, d]
        else:
            self.shared_gate_up = nnx.data(None)
            self.shared_down = nnx.data(None)
        if shared_expert_gate:
            self.shared_gate = _variable(
                nnx.Param, shared_init(key(), (d_model, 1), param_dtype), SHARED_GATE_AXES, sharding_rules
            )  # [d, 1]
        else:
            self.shared_gate = nnx.data(None)
        if router_bias:
            self.router_bias = _variable(
                nnx.Param, jnp.zeros((num_experts,), param_dtype), BIAS_AXES, sharding_rules
            )  # [E]
        else:
            self.router_bias = nnx.data(None)
        if expert_bias:
            self.b_gate_up = _variable(
                nnx.Param, jnp.zeros((num_experts, 2 * d_expert), param_dtype), GATE_UP_BIAS_AXES, sharding_rules
            )  # [E, 2n]
            self.b_down = _variable(
                nnx.Param, jnp.zeros((num_experts, d_model), param_dtype), DOWN_BIAS_AXES, sharding_rules
            )  # [E, d]
        else:
            self.b_gate_up = nnx.data(None)
            self.b_down = nnx.data(None)
        if selection_bias:
            self.selection_bias = _variable(
                SelectionBias, jnp.zeros((num_experts,), jnp.float32), BIAS_AXES, sharding_rules
            )  # [E]
        else:
            self.selection_bias = nnx.data(None)
        self.fp8_experts = nnx.data(None)  # set by quantize_fp8
        if self.config.routing == "token_rounding" and rounding == "stochastic":
            self.routing_rngs = rngs["routing"].fork()
        else:
            self.routing_rngs = nnx.data(None)

    @classmethod
    def from_hf_config(cls, config, *, rngs: nnx.Rngs, family: str | None = None, **kwargs) -> "MoE":
        """The MoE layer of a Hugging Face config (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3,
        Qwen2-MoE, gpt-oss); load its weights with `pallas_moe.nn.convert.load_hf_moe`.

        Args:
          config: the model's `config.json` as a dict (or a `transformers` config).
          rngs: `nnx.Rngs` for the (to be overwritten) initial parameters.
          family: the family; default `config["model_type"]`.
          **kwargs: module options the config does not set (routing, tile, backend, dtype,
            param_dtype, expert_parallel, sharding_rules, ...), and the aux-loss weights
            (which default to the config's `router_aux_loss_coef` / `router_z_loss_coef`).
            What defines the block's math (widths, counts, router and activation options)
            comes from the config only.

        See `pallas_moe.nn.families.moe_kwargs_from_hf_config` for the field mapping.
        """
        from pallas_moe.nn.families import moe_kwargs_from_hf_config

        mapped = moe_kwargs_from_hf_config(config, family)
        clash = sorted((set(mapped) & set(kwargs)) - {"load_balance_weight", "z_loss_weight"})
        if clash:
            raise ValueError(f"{clash} come from the config; pass them there, not as keyword arguments.")
        return cls(rngs=rngs, **{**mapped, **kwargs})

    def compute_dtype(self, x: jax.Array):
        """The dtype experts run in: `dtype`, else the promotion of x's and the params' dtype."""
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        return jnp.promote_types(x.dtype, self.param_dtype)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> tuple[jax.Array, dict]:
        """Applies the layer.

        Args:
          x: [..., d_model] floating tokens.
          key: PRNG key for rounding="stochastic" (default: the module's routing stream).

        Returns:
          (y [..., d_model] in the compute dtype, aux dict; see the class docstring).
        """
        _checks.check_floating("x", x)
        if x.ndim < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be [..., d_model={self.d_model}], got shape {tuple(x.shape)}.")
        # A NumPy array becomes a jax one with jax's dtype (float64 -> float32 unless x64 is
        # on), so its dtype promotes with the parameters as a jax array's would.
        x = jnp.asarray(x)
        dtype = self.compute_dtype(x)
        xt = x.reshape(-1, self.d_model).astype(dtype)  # [T, d]
        if self.config.routing == "token_rounding" and self.config.rounding == "stochastic" and key is None:
            key = self.routing_rngs()
        bias = None if self.selection_bias is None else self.selection_bias[...]  # [E]
        router = self.router[...]  # [d, E], used in fp32
        router_bias = None if self.router_bias is None else self.router_bias[...]  # [E], fp32 use
        w_gate_up = self.w_gate_up[...].astype(dtype)  # [E, d, 2n]
        w_down = self.w_down[...].astype(dtype)  # [E, n, d]
        ffn_options = {"activation": self.activation}
        if self.b_gate_up is not None:
            ffn_options["b_gate_up"] = self.b_gate_up[...].astype(dtype)  # [E, 2n]
            ffn_options["b_down"] = self.b_down[...].astype(dtype)  # [E, d]
        # Inputs first: a NaN in x would otherwise surface as NaN router logits.
        _checks.check_finite("x", xt, self.check_finite)
        _checks.check_finite("router", router, self.check_finite)

        shared = None  # (gate_up [d, 2m], down [m, d], gate [d, 1] or None)
        if self.shared_gate_up is not None:
            shared = (
                self.shared_gate_up[...].astype(dtype),
                self.shared_down[...].astype(dtype),
                None if self.shared_gate is None else self.shared_gate[...],
            )
        if self.expert_parallel is None:
            logits = F.router_logits(
                xt, router, router_bias, dtype=self.numerics.router_dtype
            )  # f32[T, E]
            plan, counts = F.route(
                logits, self.config, bias=bias, key=key, check_finite=self.check_finite
            )
            if self.fp8_experts is None:
                y = moe_ffn(
                    xt, plan, w_gate_up, w_down, backend=self.backend, numerics=self.numerics,
                    config=self.kernel_config, **ffn_options,
                )  # [T, d]
            else:
                from pallas_moe.quant.ffn import moe_ffn_fp8  # Pallas only when used

                y = moe_ffn_fp8(
                    xt.astype(jnp.bfloat16), plan, self.fp8_experts.get_value(),
                    backend=self.backend, aggregation=self.numerics.aggregation,
                ).astype(dtype)  # [T, d]
            aux = F.finish_aux(F.router_sums(logits, counts), self.config)
            if shared is not None:
                y = y + F.shared_mlp(xt, *shared)  # [T, d]
        else:
            # The shared MLP runs inside the EP shard_map, overlapping the dispatch.
            y, aux = expert_parallel_moe(
                xt, router, w_gate_up, w_down, self.config, self.expert_parallel,
                bias=bias, key=key, backend=self.backend, router_bias=router_bias,
                check_finite=self.check_finite, shared=shared, numerics=self.numerics,
                **ffn_options,
            )  # [T, d]
        return _reshape_like(y, x), aux

    def quantize_fp8(
        self, *, smooth_up: jax.Array | None = None, smooth_down: jax.Array | None = None
    ) -> None:
        """Switches the routed experts to fp8 (e4m3) inference, `pm.quant.moe_ffn_fp8`.

        Quantizes today's `w_gate_up` [E, d, 2n] and `w_down` [E, n, d] per expert and output
        channel (`pm.quant.quantize_experts`) and keeps them in `self.fp8_experts`; from then
        on the layer's routed part runs the fp8 forward on bf16 tokens (the router, the
        shared MLP and the aux outputs are unchanged; y is cast to the compute dtype).
        Inference only: differentiating a quantized layer raises a TypeError. The e4m3 copy
        does not follow later changes of the weights: quantize again after changing them, or
        call `dequantize_fp8()` to go back to `moe_ffn`.

        Args:
          smooth_up: f32 [E, d] SmoothQuant scales of the up-proj input, with their inverse
            already folded into `w_gate_up` (`pm.quant.calibrate_smoothing`), or None.
          smooth_down: f32 [E, n] scales of the down-proj input, or None.
        """
        if self.activation != SwiGLU():
            raise ValueError(
                f"quantize_fp8: the fp8 forward computes SwiGLU(); this layer's activation is "
                f"{self.activation!r}."
            )
        if self.b_gate_up is not None:
            raise ValueError("quantize_fp8: the fp8 forward has no expert biases; this layer has expert_bias=True.")
        if self.expert_parallel is not None:
            raise ValueError("quantize_fp8: the fp8 forward runs on one device; this layer has expert_parallel set.")
        from pallas_moe.quant.ffn import quantize_experts  # Pallas only when used

        experts = quantize_experts(
            self.w_gate_up[...], self.w_down[...], smooth_up=smooth_up, smooth_down=smooth_down
        )
        self.fp8_experts = Fp8Experts(experts)

    def dequantize_fp8(self) -> None:
        """Drops the e4m3 experts of `quantize_fp8`: the layer runs `moe_ffn` again."""
        self.fp8_experts = nnx.data(None)

    @property
    def quantized(self) -> "pallas_moe.quant.QuantizedExperts | None":
        """The e4m3 experts `quantize_fp8` made, or None."""
        return None if self.fp8_experts is None else self.fp8_experts.get_value()

    def update_bias(self, aux: dict, rate: float | None = None) -> None:
        """Aux-loss-free balancing step: `bias += rate * sign(mean(tc_counts) - tc_counts)`.

        Call once per step after the forward, outside the optimizer (under `nnx.jit` if the
        train step is jitted). `aux` is this layer's aux (for a scanned stack, the stacked
        aux of all layers: each layer's bias moves with its own counts). `rate` (default:
        `bias_update_rate`) must be a finite number >= 0; NaN or Inf raises a `ValueError`.
        """
        if self.selection_bias is None:
            raise ValueError("update_bias needs a layer built with selection_bias=True.")
        rate = _checks.check_finite_number("rate", self.bias_update_rate if rate is None else rate, minimum=0.0)
        counts = aux["tc_counts"]  # [E], or [L, E] for a stack of layers
        update = jnp.vectorize(
            lambda b, c: update_selection_bias(b, c, rate), signature="(e),(e)->(e)"
        )
        self.selection_bias[...] = update(self.selection_bias[...], counts)
