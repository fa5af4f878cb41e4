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
      # The SwiGLU's exp in full precision (the default is the hardware's ex2.approx):
      cfg = KernelConfig.for_shape(d, n, approx_math=False)
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
        # The backward recomputes A from H with the forward's formula only if both take
        # their exp the same way (`UpProjConfig.approx_math` or `DecodeConfig.approx_math`,
        # and `DHConfig.approx_math`). A config left None runs its `for_shape` defaults,
        # whose exp is the hardware approximation (True).
        fwd_approx = self.forward is None or (
            self.forward.up.approx_math if self.forward.decode is None
            else self.forward.decode.approx_math
        )
        bwd_approx = self.backward is None or self.backward.dh.approx_math
        if fwd_approx != bwd_approx:
            decode = self.forward is not None and self.forward.decode is not None
            fwd_name = "forward.decode.approx_math" if decode else "forward.up.approx_math"
            raise ValueError(
                f"{fwd_name}={fwd_approx} and backward.dh.approx_math={bwd_approx} must "
                "match (a config left None counts as True, its for_shape default): the "
                "backward recomputes the forward's activation from H."
            )

    @classmethod
    def for_shape(
        cls, d: int, n: int, *, gather: str = "cp_async", num_sms: int | None = None,
        decode: DecodeConfig | None = None, approx_math: bool = True,
        dh_da_dtype: str | None = None,
    ) -> "KernelConfig":
        """The default configs for model width `d` and expert width `n`, with the given row
        loader ("tma" or "cp_async") in every gathering kernel and `num_sms` persistent CTAs
        (default: the device's SM count). `decode`: run the forward as the decode megakernel
        with this config (`docs/decode.md`); the backward is unchanged. `approx_math`: the
        SwiGLU kernels (up-proj or decode megakernel, and dH) take their exp from the
        hardware's `ex2.approx` (True, default: 3-7% faster kernels on the H100, A differing
        from the exact formula's in the last bit of rare elements) or the full-precision
        `exp` (False); it overrides the `approx_math` of `decode` too. `dh_da_dtype`: dA'
        between the split dH's kernels where `BackwardConfig.for_shape` splits dH (d >=
        2048): None (default) keeps its choice, bf16; "float32" gives the fused kernel's dH
        bits (`BackwardConfig.dh_da_dtype`)."""
        if decode is not None:
            decode = dataclasses.replace(decode, approx_math=approx_math)
        forward = ForwardConfig.for_shape(d, n, gather=gather, num_sms=num_sms, decode=decode)
        backward = BackwardConfig.for_shape(
            d, n, gather=gather, num_sms=num_sms,
            **({} if dh_da_dtype is None else {"dh_da_dtype": dh_da_dtype}),
        )
        forward = dataclasses.replace(
            forward, up=dataclasses.replace(forward.up, approx_math=approx_math)
        )
        backward = dataclasses.replace(
            backward, dh=dataclasses.replace(backward.dh, approx_math=approx_math)
        )
        return cls(forward=forward, backward=backward)
