"""dH with its dH / A' stores straight from registers (issue 9, session 57).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/history/session57/dh_regstore.py 7b,30b [rounds] [variants]

Session 56: the TMA stores of dH and A' (and the consumers' wait until they have read the
SMEM slabs, which the producer needs back for the next item's K steps) cost 21% of dH at 7B
(`no_store` 1.275x). Session 57's stagger probe (`dh_stagger.py`) found no cross-SM
collision: each CTA waits for its own stores. `DHConfig(store="registers")` removes the
wait: the consumers write each dSwiGLU chunk's dH gate, dH up and A' from registers with
predicated 4-byte `st.global` (`_common.store_rows_from_registers`; rows past the tile's are
not written, as with the TMA ladder), so the slabs only carry H in (they overlay 2 W2 slots
instead of 3: the producer loads 3 of the next item's steps during the epilogue instead of
2), are free once read, and the stores drain through the LSU while the next K loop runs.
dS keeps its SMEM copy. The same values, so dH and A' must be bitwise the default's (checked
on poisoned outputs; dS too).

Variants (beside `dh_ablation.py`'s, `default` first):
  registers  `DHConfig(store="registers")`
  pp         `DHConfig.pingpong()` (session 57): SonicMoE's dH shape, 128 x 128 items taken
             whole by two consumers in turn, the dSwiGLU in 32-column pieces, TMA stores
  pp_reg     the same with register stores
  pp64       the same with 64-column pieces (expected to spill, as the removed 64-row
             ping-pong did)
dH and A' of each are checked bitwise against the default; dS against XLA's.
"""

from __future__ import annotations

import sys

sys.path.insert(0, "benchmarks/history/session55")
import dh_ablation  # noqa: E402

from pallas_moe.kernels.dh import PINGPONG_FIELDS  # noqa: E402

PINGPONG = PINGPONG_FIELDS  # `DHConfig.pingpong()` on the default's gather settings
VARIANTS = {
    "registers": dict(store="registers"),
    "pp": PINGPONG,  # the ping-pong schedule, TMA stores, 32-column dSwiGLU pieces
    "pp_reg": dict(PINGPONG, store="registers"),  # ... register stores
    "pp64": dict(PINGPONG, epilogue_cols=64),  # ... 64-column pieces (the removed kernel's)
}
for _name, _fields in VARIANTS.items():
    dh_ablation.PATCHES[_name] = []
    dh_ablation.OVERRIDES[_name] = _fields

if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.argv[3:] = ["default,registers,pp,pp_reg"]
    dh_ablation.main()
