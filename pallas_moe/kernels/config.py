"""`KernelConfig`: the block sizes of every kernel of one MoE layer, forward and backward."""

from __future__ import annotations

import dataclasses

from pallas_moe.kernels.decode import DecodeConfig
from pallas_moe.kernels.moe_backward import BackwardConfig
from pallas_moe.kernels.moe_forward import ForwardConfig


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Configs of the forward and backward kernels that `pm.moe_ffn` runs.

    Either may be None: that pass then uses its `for_shape(d, n)` defaults. Hashable, so it
    is a static argument of `moe_ffn`.

    Example:
      cfg = KernelConfig.for_shape(d, n, gather="cp_async")
      y = pm.moe_ffn(x, plan, w1, w2, backend="mosaic", config=cfg)
      # The forward as the decode megakernel (small batches):
      cfg = KernelConfig.for_shape(d, n, decode=DecodeConfig.for_shape(d, n))
    """

    forward: ForwardConfig | None = None
    backward: BackwardConfig | None = None

    def __post_init__(self):
        if self.forward is not None and not isinstance(self.forward, ForwardConfig):
            raise TypeError(f"forward must be a ForwardConfig or None, got {type(self.forward).__name__}.")
        if self.backward is not None and not isinstance(self.backward, BackwardConfig):
            raise TypeError(
                f"backward must be a BackwardConfig or None, got {type(self.backward).__name__}."
            )

    @classmethod
    def for_shape(
        cls, d: int, n: int, *, gather: str = "cp_async", num_sms: int | None = None,
        decode: DecodeConfig | None = None,
    ) -> "KernelConfig":
        """The default configs for model width `d` and expert width `n`, with the given row
        loader ("tma" or "cp_async") in every gathering kernel and `num_sms` persistent CTAs
        (default: the device's SM count). `decode`: run the forward as the decode megakernel
        with this config (`docs/decode.md`); the backward is unchanged."""
        return cls(
            forward=ForwardConfig.for_shape(d, n, gather=gather, num_sms=num_sms, decode=decode),
            backward=BackwardConfig.for_shape(d, n, gather=gather, num_sms=num_sms),
        )
