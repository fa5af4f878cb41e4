"""Builds `notebooks/routing.ipynb` (outputs stripped) from the cells below.

    .venv/bin/python notebooks/build_routing_notebook.py            # write the notebook
    .venv/bin/python notebooks/build_routing_notebook.py --execute  # also run it in place

Edit the cells here, not the .ipynb, so the notebook stays small and reviewable.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = pathlib.Path(__file__).resolve().parent
PATH = HERE / "routing.ipynb"

CELLS: list[tuple[str, str]] = [
    ("md", r"""
# Routing behaviour: token-choice top-K vs token rounding

Token rounding (TR, from SonicMoE) starts from plain token-choice (TC) top-K routing and then
rounds every expert's token count `f_e` to a multiple of the grouped-GEMM tile `M_tile`, so
the expert GEMMs run on whole tiles with no padding rows. Rounding *up* tops the expert up
with its best-scoring non-TC tokens (expert choice); rounding *down* drops its lowest-scored
TC tokens. Either way an expert moves by less than one tile, only in its last tile.

This notebook looks at that on synthetic router logits with a realistic skew (some experts are
more popular than others):

1. per-expert counts under top-K and under each rounding mode (`nearest`, `up`, `down`,
   `stochastic`, `balance`);
2. how far each mode deviates from token choice (dropped and added rows);
3. padding waste of plain top-K as the number of experts `E` grows at a fixed tile (what TR removes);
4. what happens when tokens per expert / tile falls below 2, the regime SonicMoE flags as unstable.

Everything uses the library's routing functions (`pallas_moe.routing`); sizes are small so
the notebook runs in well under a minute on a CPU.
"""),
    ("code", r"""
import functools
import sys
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt  # the kernel's inline backend: figures become cell outputs
import numpy as np

import pallas_moe as pm

MODES = pm.routing.ROUNDING_MODES  # ("nearest", "up", "down", "stochastic", "balance")
print("python", sys.executable)
print("jax", jax.__version__, "on", jax.default_backend())
t_start = time.perf_counter()
"""),
    ("md", r"""
## Router logits

`T` tokens, `E` experts, `K` experts per token. Logits are `x @ W` for Gaussian tokens and
router weights, plus a per-expert popularity offset so loads are uneven the way a trained
router's are. `skew` sets how uneven.
"""),
    ("code", r"""
def router_logits(num_tokens, num_experts, *, skew=0.5, seed=0, d=64):
    # f32[T, E]: Gaussian token-router products plus a per-expert popularity offset.
    kx, kw, kb = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (num_tokens, d))  # [T, d]
    w = jax.random.normal(kw, (d, num_experts)) / jnp.sqrt(d)  # [d, E]
    popularity = skew * jax.random.normal(kb, (num_experts,))  # [E]
    return x @ w + popularity[None, :]  # [T, E]


# The routing functions are jit-able with static k, tile and mode: compiling each variant
# once is much faster than running them op by op.
topk_plan = jax.jit(pm.routing.topk_plan, static_argnums=1)


@functools.partial(jax.jit, static_argnames=("k", "tile", "modes"))
def tr_plans(logits, key, *, k, tile, modes):
    # {mode: DispatchPlan} for every rounding mode, compiled as one program.
    return {m: pm.routing.token_rounding_plan(logits, k, tile=tile, rounding=m, key=key) for m in modes}


@functools.partial(jax.jit, static_argnames=("k", "tiles", "mode"))
def tr_tile_sweep(logits, key, *, k, tiles, mode):
    # [(selected, top-K selected)] for each tile in `tiles`, compiled as one program.
    out = []
    for tile in tiles:
        selected, _, tc_selected = pm.routing.token_rounding_assignment(
            logits, k, tile=tile, rounding=mode, key=key)
        out.append((selected, tc_selected))
    return out



T, E, K, TILE = 2048, 16, 2, 64
logits = router_logits(T, E)
tc = topk_plan(logits, K)
tc_counts = np.asarray(tc.group_sizes)  # [E]
print(f"T={T} E={E} K={K} tile={TILE}: mean tokens per expert T*K/E = {T * K / E:.0f} "
      f"= {T * K / E / TILE:.1f} tiles")
print("top-K counts per expert:", tc_counts.tolist())
"""),
    ("md", r"""
## 1. Per-expert counts: top-K vs each rounding mode

Bars are rows per expert; the dotted lines are tile multiples. Top-K counts land anywhere;
every TR mode lands exactly on a tile line. `up` never drops a TC token, `down` never adds
one, `nearest` picks the closer multiple per expert, `stochastic` rounds up with probability
`remainder / tile` (unbiased in expectation), and `balance` chooses per expert so the running
total stays within half a tile of the TC total.
"""),
    ("code", r"""
plans = tr_plans(logits, jax.random.key(0), k=K, tile=TILE, modes=MODES)
counts = {"top-K": tc_counts} | {m: np.asarray(plans[m].group_sizes) for m in MODES}

fig, ax = plt.subplots(figsize=(11, 4))
width = 0.8 / len(counts)
for i, (name, c) in enumerate(counts.items()):
    ax.bar(np.arange(E) + (i - len(counts) / 2 + 0.5) * width, c, width, label=name)
for m in range(0, int(max(c.max() for c in counts.values())) + TILE, TILE):
    ax.axhline(m, color="k", lw=0.6, ls=":")
ax.set(xlabel="expert", ylabel="rows", title=f"rows per expert (tile = {TILE})")
ax.legend(ncol=6, fontsize=8, loc="upper center")
plt.show()

for name, c in counts.items():
    print(f"{name:>10}: total rows {int(c.sum()):5d} (top-K: {T * K}), "
          f"all multiples of the tile: {bool(np.all(c % TILE == 0))}")
"""),
    ("md", r"""
## 2. Deviation from token choice

For each mode: the per-expert change `count - tc_count` (always strictly inside `(-tile, tile)`),
and the totals of top-K rows dropped and expert-choice rows added. `routing_stats` reports the
same numbers the training loop logs.
"""),
    ("code", r"""
fig, ax = plt.subplots(figsize=(11, 3.6))
rows = []
for i, mode in enumerate(MODES):
    dev = counts[mode] - tc_counts  # [E]
    ax.bar(np.arange(E) + (i - 2) * 0.16, dev, 0.16, label=mode)
    stats = pm.routing.routing_stats(plans[mode], jnp.asarray(tc_counts), TILE)
    rows.append((mode, int(stats["dropped_rows"]), int(stats["added_rows"]),
                 int(dev.sum()), int(np.abs(dev).max())))
ax.axhline(TILE, color="r", ls="--", lw=0.8)
ax.axhline(-TILE, color="r", ls="--", lw=0.8, label="± one tile")
ax.set(xlabel="expert", ylabel="count - top-K count", title="per-expert deviation from token choice")
ax.legend(ncol=6, fontsize=8)
plt.show()

print(f"{'mode':>10} {'dropped':>8} {'added':>6} {'net':>6} {'max |dev|':>9}   (tile {TILE}, top-K rows {T * K})")
for mode, dropped, added, net, worst in rows:
    print(f"{mode:>10} {dropped:8d} {added:6d} {net:+6d} {worst:9d}")
"""),
    ("md", r"""
Reading it: `up` only adds and `down` only drops, each by up to `E * tile` rows in total.
`nearest` does both, and its net change is near zero only on average. `balance` keeps the net
change within half a tile by construction. `stochastic` is unbiased in expectation but noisy
per step. No expert moves by a full tile in any mode.

## 3. Padding waste of top-K vs number of experts (fixed tile)

A grouped GEMM with `M_tile`-row tiles pads each expert's group up to the next tile multiple.
With `T` and `K` fixed, more experts mean fewer tokens per expert. The up-to-one-tile
remainder per expert is then a larger fraction of the work, so padding waste grows with `E`.
TR brings the waste to zero (unless an expert would need more than `T` rows). The dashed curve
is the expectation when remainders are uniform: about `E * tile / 2` padded rows.
"""),
    ("code", r"""
T_SWEEP, K_SWEEP, TILE_SWEEP = 4096, 4, 128
experts = [8, 16, 32, 64, 128, 256]


@functools.partial(jax.jit, static_argnames=("experts",))
def counts_by_num_experts(*, experts):
    # {E: (top-K rows per expert [E], TR-nearest rows per expert [E])}, one program.
    out = {}
    for num_e in experts:
        lg = router_logits(T_SWEEP, num_e, seed=1)  # [T, E]
        sel, _, tc_sel = pm.routing.token_rounding_assignment(
            lg, K_SWEEP, tile=TILE_SWEEP, rounding="nearest")
        out[num_e] = (jnp.sum(tc_sel, axis=0), jnp.sum(sel, axis=0))
    return out


waste_tc, waste_tr, ratios = [], [], []
for num_e, (tc_c, tr_c) in counts_by_num_experts(experts=tuple(experts)).items():
    for c, out in ((np.asarray(tc_c), waste_tc), (np.asarray(tr_c), waste_tr)):
        padded = -(-c // TILE_SWEEP) * TILE_SWEEP  # [E] rows after padding each group to whole tiles
        out.append(100 * (padded - c).sum() / max(padded.sum(), 1))
    ratios.append(T_SWEEP * K_SWEEP / num_e / TILE_SWEEP)

expected = [100 * (e * TILE_SWEEP / 2) / (T_SWEEP * K_SWEEP + e * TILE_SWEEP / 2) for e in experts]
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(experts, waste_tc, "o-", label="top-K (token choice)")
ax.plot(experts, expected, "k--", lw=0.8, label="uniform-remainder estimate")
ax.plot(experts, waste_tr, "s-", label="token rounding (nearest)")
ax.set_xscale("log", base=2)
ax.set(xlabel="experts E", ylabel="padded rows / all rows (%)",
       title=f"padding waste, T={T_SWEEP}, K={K_SWEEP}, tile={TILE_SWEEP}")
for e, w, r in zip(experts, waste_tc, ratios):
    ax.annotate(f"T*K/(E*tile) = {r:g}", (e, w), textcoords="offset points", xytext=(4, -12), fontsize=7)
ax.grid(alpha=0.3)
ax.legend()
plt.show()
"""),
    ("md", r"""
At 8 experts each expert holds 16 tiles of work and the last partial tile costs a few percent.
At 256 experts the mean is half a tile per expert, and most of each padded group is padding.
This is the high-sparsity regime where SonicMoE reports TR's largest speedups. It is also the
regime where rounding changes the routing the most, which the next section shows.

## 4. When tokens per expert / tile falls below 2

Fix `T`, `E` and `K`, and grow the tile so the mean tokens per expert per tile `T*K/(E*tile)`
goes from 8 down to 1/4. For each mode, the panels show:
- **deviation**: (dropped + added) / (T*K), the share of routing decisions that differ from top-K;
- **net rows**: total rows / (T*K), where 1 means the same amount of expert compute as top-K;
- **tokens left with no expert**: the share of tokens whose every top-K row was dropped;
- **experts emptied**: the share of experts with top-K tokens that TR rounds down to zero.
"""),
    ("code", r"""
T4, E4, K4 = 2048, 16, 2
lg4 = router_logits(T4, E4, seed=2)
tiles = [32, 64, 128, 256, 512, 1024]  # T*K/E = 256, so the ratio goes 8 ... 0.25
ratio4 = [T4 * K4 / E4 / t for t in tiles]
curves = {m: {"deviation": [], "net": [], "orphans": [], "emptied": []} for m in MODES}
for mode in MODES:
    sweep = tr_tile_sweep(lg4, jax.random.key(0), k=K4, tiles=tuple(tiles), mode=mode)
    for sel, tcs in sweep:
        sel, tcs = np.asarray(sel), np.asarray(tcs)  # [T, E]
        tc_cnt = tcs.sum(0)  # [E]
        dropped = np.sum(tcs & ~sel)
        added = np.sum(sel & ~tcs)
        cnt = sel.sum(0)  # [E]
        curves[mode]["deviation"].append((dropped + added) / (T4 * K4))
        curves[mode]["net"].append(cnt.sum() / (T4 * K4))
        curves[mode]["orphans"].append(np.mean(sel.sum(1) == 0))
        curves[mode]["emptied"].append(np.mean((cnt == 0) & (tc_cnt > 0)))

fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
titles = {"deviation": "(dropped + added) / TK", "net": "total rows / TK",
          "orphans": "tokens with no expert", "emptied": "experts emptied"}
for ax, (name, title) in zip(axes, titles.items()):
    for mode in MODES:
        ax.plot(ratio4, curves[mode][name], "o-", ms=3, label=mode)
    ax.axvline(2, color="k", ls=":", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.invert_xaxis()
    ax.set(title=title, xlabel="T*K / (E * tile)")
    ax.grid(alpha=0.3)
axes[0].legend(fontsize=8)
plt.show()

print("per mode: deviation / net rows / tokens with no expert / experts emptied")
print(f"{'ratio':>6} " + "".join(f"{m:>24}" for m in MODES))
for i, r in enumerate(ratio4):
    print(f"{r:6.2f} " + "".join(
        f"{curves[m]['deviation'][i]:6.2f}/{curves[m]['net'][i]:5.2f}/{curves[m]['orphans'][i]:5.2f}/"
        f"{curves[m]['emptied'][i]:5.2f}" for m in MODES))
"""),
    ("md", r"""
What the curves show (numbers from this seed; the shape is what matters):

- At 4 or more tiles per expert, every mode changes roughly a tenth of the routing decisions
  or less, and no token loses all its experts. `nearest`, `stochastic` and `balance` keep the
  total compute within a few percent of top-K. This is the regime where SonicMoE finds TR as
  good as TC in quality. The *mean* ratio hides the spread, though: with skewed popularity a
  rarely chosen expert holds well under half a tile. `nearest`, `down` and `stochastic` can
  round it to zero even at ratio 8 (the "experts emptied" panel does not start at 0).
- At 2 the changes grow: `up` adds about a quarter more rows, `down` drops about a fifth, and
  a growing share of experts rounds to zero.
- Below 2, the one-tile deviation is no longer small next to the counts themselves:
  - `down` and `nearest` empty most experts. Tokens whose top-K experts were all emptied get no
    expert at all: their MoE output is zero and only the residual carries them. Under `down`
    that is a tenth or more of the tokens at ratio 1 and a third at ratio 1/2.
  - `up` never empties an expert but inflates the compute, to several times the top-K rows at
    ratio 1/4, nearly all of them expert-choice additions.
  - `balance` and `stochastic` hold the *total* near top-K by emptying some experts and
    overfilling others. Their deviation reaches half of all routing decisions by ratio 1/2,
    and the layer is no longer close to a top-K MoE.
- In practice, choose the tile (or how many tokens are routed together) so that
  `T*K/(E*tile) >= 2`, and preferably well above it when the router is skewed. The
  training ablation in `train/RESULTS.md` runs at 4.
"""),
    ("code", r"""
print(f"notebook ran in {time.perf_counter() - t_start:.1f} s")
"""),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [
        new_markdown_cell(src.strip()) if kind == "md" else new_code_cell(src.strip())
        for kind, src in CELLS
    ]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:02d}"  # stable ids keep rebuilds diff-free
    return nb


def main(argv: list[str]) -> int:
    nb = build()
    if "--execute" in argv:
        from nbclient import NotebookClient

        NotebookClient(nb, kernel_name="python3", timeout=300,
                       resources={"metadata": {"path": str(HERE)}}).execute()
    nbformat.write(nb, PATH)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
