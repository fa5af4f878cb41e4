"""Named training configurations (frozen dataclasses) and their validation.

A `Config` is everything one run needs: the model shape, the MoE routing, the optimizer
schedule, the data windows and the bookkeeping cadence. Named configs live in `CONFIGS`;
command-line overrides go through `with_overrides`, and every config is checked by
`validate`, which raises `ConfigError` naming the offending field.

    tiny          CPU, a few minutes on 2 cores: d=128, 2 layers, E=8, K=2, seq 128.
    small         a bigger run, float32 on the xla backend (CPU or GPU): d=256, 4 layers,
                  E=16, K=2, seq 256.
    gpu_7b_layer  GPU: SonicMoE's 7B MoE layer shape (d=1536, n=256, E=128, K=8) in a
                  4-layer model, bf16 compute, T = 24576 tokens per step; backend "auto"
                  (the Mosaic GPU kernels on Hopper).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from pallas_moe.nn.expert_parallel import DISPATCHES, OVERLAPS

ROUTINGS = ("topk", "token_rounding")
ROUNDINGS = ("nearest", "up", "down", "stochastic", "balance")
DTYPES = ("float32", "bfloat16")
BACKENDS = ("auto", "mosaic", "interpret", "xla")
POSITIONS = ("rope", "learned")


class ConfigError(ValueError):
    """A bad configuration value; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Config:
    name: str = "custom"
    # Model.
    vocab_size: int = 256  # byte-level tokens
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_expert: int = 256  # n, the SwiGLU width of one expert
    num_experts: int = 8  # E
    top_k: int = 2  # K
    positions: str = "rope"  # "rope" or "learned"
    rope_base: float = 10_000.0
    tie_embeddings: bool = True
    dtype: str = "float32"  # compute dtype; parameters are always float32
    backend: str = "auto"  # pm.moe_ffn backend: "auto" = mosaic kernels on Hopper, xla elsewhere
    # Routing.
    routing: str = "topk"  # "topk" or "token_rounding"
    rounding: str = "nearest"  # token rounding mode
    tile: int = 128  # GEMM tile height M_tile (token rounding and padding statistics)
    load_balance_weight: float = 1e-2  # load-balancing loss weight
    z_loss_weight: float = 1e-3  # router z-loss weight
    # Data.
    seq_len: int = 128
    batch_size: int = 16  # sequences per step; tokens per step = batch_size * seq_len
    val_percent: float = 5.0  # percent of stdlib files held out for validation (by path hash)
    max_train_bytes: int = 0  # 0 = the whole training split
    # Optimizer: AdamW with linear warmup then cosine decay to lr * final_lr_fraction.
    steps: int = 600
    lr: float = 3e-3
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    # Parallelism (train/distributed.py); devices=1 is a plain one-device run.
    devices: int = 1  # devices of the (data, expert) mesh; 0 = every device of every process
    expert_parallel: int = 1  # size of the mesh's expert axis (experts split over it)
    dispatch: str = "all_gather"  # pm.nn.ExpertParallel dispatch
    overlap: str = "none"  # pm.nn.ExpertParallel overlap: "none" or "chunked"
    num_chunks: int = 2  # chunks of overlap="chunked"
    # Bookkeeping.
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    checkpoint_every: int = 200  # also at the last step; 0 = never checkpoint
    keep_checkpoints: int = 2
    out: str = ""  # "" = runs/<name>

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def out_dir(self) -> str:
        return self.out or f"runs/{self.name}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CONFIGS: dict[str, Config] = {
    "tiny": Config(name="tiny"),
    "small": Config(
        name="small",
        d_model=256,
        num_layers=4,
        num_heads=4,
        d_expert=256,
        num_experts=16,
        top_k=2,
        seq_len=256,
        batch_size=32,
        tile=128,  # T*K/E = 8192*2/16 = 1024 rows per expert = 8 tiles
        # float32 on the pure-jnp path, on CPU or GPU (the RESULTS.md runs); the Mosaic
        # kernels are exercised by gpu_7b_layer (bf16).
        backend="xla",
        steps=3000,
        lr=2e-3,
        warmup_steps=200,
        eval_every=250,
        checkpoint_every=1000,
    ),
    "gpu_7b_layer": Config(
        name="gpu_7b_layer",
        d_model=1536,
        num_layers=4,
        num_heads=12,
        d_expert=256,
        num_experts=128,
        top_k=8,
        seq_len=1024,
        batch_size=24,  # T = 24576 tokens per step, SonicMoE's 7B benchmark shape
        tile=128,  # T*K/E = 1536 rows per expert = 12 tiles
        dtype="bfloat16",
        steps=2000,
        lr=1e-3,
        warmup_steps=200,
        eval_every=250,
        eval_batches=4,
        checkpoint_every=500,
    ),
}


def get_config(name: str) -> Config:
    if name not in CONFIGS:
        raise ConfigError(f"config must be one of {sorted(CONFIGS)}, got {name!r}.")
    return CONFIGS[name]


def with_overrides(config: Config, **overrides: Any) -> Config:
    """Returns `config` with the non-None overrides applied, validated.

    Changing `steps` alone scales `warmup_steps` with it (same warmup fraction).
    """
    fields = {f.name: f for f in dataclasses.fields(Config)}
    changes = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in fields:
            raise ConfigError(f"unknown config field {key!r}; fields are {sorted(fields)}.")
        changes[key] = value
    if "steps" in changes and "warmup_steps" not in changes and isinstance(changes["steps"], int):
        # Keep the warmup the same fraction of the run when only the length changes.
        changes["warmup_steps"] = config.warmup_steps * changes["steps"] // config.steps
    return validate(dataclasses.replace(config, **changes))


def _positive_int(c: Config, field: str) -> None:
    value = getattr(c, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field} must be an int, got {value!r} ({type(value).__name__}).")
    if value <= 0:
        raise ConfigError(f"{field} must be positive, got {value}.")


def _finite_number(c: Config, field: str) -> float:
    value = getattr(c, field)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field} must be a number, got {value!r}.")
    if not math.isfinite(value):
        raise ConfigError(f"{field} must be finite, got {value}.")
    return value


def _non_negative(c: Config, field: str) -> None:
    if _finite_number(c, field) < 0:
        raise ConfigError(f"{field} must be >= 0, got {getattr(c, field)}.")


def _check_backend_dtype(c: Config) -> None:
    """The kernel backends take bf16 and widths that are multiples of 64 (checked up front
    here, instead of failing inside the first step)."""
    if c.backend not in ("mosaic", "interpret"):
        return
    from pallas_moe.ops.moe_ffn import KERNEL_DTYPE, KERNEL_WIDTH_MULTIPLE

    kernel_dtype = np.dtype(KERNEL_DTYPE).name
    if c.dtype != kernel_dtype:
        raise ConfigError(
            f"dtype must be {kernel_dtype!r} with backend={c.backend!r} (the Mosaic GPU kernels "
            f"take {kernel_dtype}), got dtype={c.dtype!r}; use backend='xla' or 'auto' for {c.dtype}."
        )
    for field in ("d_model", "d_expert"):
        if getattr(c, field) % KERNEL_WIDTH_MULTIPLE:
            raise ConfigError(
                f"{field}={getattr(c, field)} must be a multiple of {KERNEL_WIDTH_MULTIPLE} with "
                f"backend={c.backend!r} (the kernels' tile width); use backend='xla' or 'auto'."
            )


def _choice(c: Config, field: str, choices: tuple[str, ...]) -> None:
    value = getattr(c, field)
    if value not in choices:
        raise ConfigError(f"{field} must be one of {list(choices)}, got {value!r}.")


def validate(c: Config) -> Config:
    """Checks every field; raises `ConfigError` naming the first bad one. Returns `c`."""
    for field in (
        "vocab_size", "d_model", "num_layers", "num_heads", "d_expert", "num_experts", "top_k",
        "tile", "seq_len", "batch_size", "steps", "log_every", "eval_every", "eval_batches",
        "keep_checkpoints",
    ):
        _positive_int(c, field)
    for field in ("load_balance_weight", "z_loss_weight", "weight_decay", "grad_clip", "final_lr_fraction"):
        _non_negative(c, field)  # finite too: grad_clip=nan would silently turn clipping off
    for field in ("expert_parallel", "num_chunks"):
        _positive_int(c, field)
    for field in ("warmup_steps", "max_train_bytes", "seed", "checkpoint_every", "devices"):
        _non_negative(c, field)
        if not isinstance(getattr(c, field), int):
            raise ConfigError(f"{field} must be an int, got {getattr(c, field)!r}.")
    _choice(c, "routing", ROUTINGS)
    _choice(c, "rounding", ROUNDINGS)
    _choice(c, "dtype", DTYPES)
    _choice(c, "backend", BACKENDS)
    _choice(c, "positions", POSITIONS)
    _choice(c, "dispatch", DISPATCHES)
    _choice(c, "overlap", OVERLAPS)
    if c.num_experts % c.expert_parallel:
        raise ConfigError(
            f"expert_parallel={c.expert_parallel} must divide num_experts={c.num_experts}."
        )
    if c.vocab_size != 256:
        raise ConfigError(f"vocab_size must be 256 (byte-level tokens), got {c.vocab_size}.")
    if c.d_model % c.num_heads:
        raise ConfigError(
            f"d_model={c.d_model} must be divisible by num_heads={c.num_heads}."
        )
    if c.positions == "rope" and (c.d_model // c.num_heads) % 2:
        raise ConfigError(
            f"num_heads: head dim d_model/num_heads={c.d_model // c.num_heads} must be even for RoPE."
        )
    if c.top_k > c.num_experts:
        raise ConfigError(f"top_k={c.top_k} must be <= num_experts={c.num_experts}.")
    if _finite_number(c, "lr") <= 0:
        raise ConfigError(f"lr must be a positive number, got {c.lr!r}.")
    if _finite_number(c, "rope_base") <= 1:
        raise ConfigError(
            f"rope_base must be > 1 (RoPE frequencies are rope_base ** (-i / half)), got {c.rope_base}."
        )

    if c.warmup_steps >= c.steps:
        raise ConfigError(f"warmup_steps={c.warmup_steps} must be < steps={c.steps}.")
    if not 0 <= c.final_lr_fraction <= 1:
        raise ConfigError(f"final_lr_fraction must be in [0, 1], got {c.final_lr_fraction}.")
    for field in ("b1", "b2", "val_percent"):
        _finite_number(c, field)
    if not 0 <= c.b1 < 1:
        raise ConfigError(f"b1 must be in [0, 1), got {c.b1}.")
    if not 0 <= c.b2 < 1:
        raise ConfigError(f"b2 must be in [0, 1), got {c.b2}.")
    if not 0 < c.val_percent < 100:
        raise ConfigError(f"val_percent must be in (0, 100), got {c.val_percent}.")
    _check_backend_dtype(c)
    return c
