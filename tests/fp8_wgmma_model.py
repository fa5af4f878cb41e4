"""A numpy model of how the H100's fp8 wgmma accumulates, and of promotion.

Hopper's fp8 tensor cores do not add in f32. What one `wgmma ... .e4m3.e4m3` instruction with
k = 32 does to each f32 accumulator element `c` and its 32 products `p_i = a_i * w_i` (this
model reproduces bit for bit the 14 H100 outputs logged by the first GPU run,
`benchmarks/history/session4/test_quant_fp8_first.txt`, `test_fp8_wgmma_model_matches_h100`,
and all 164864 sampled outputs of the GPU test's four fp8 GEMMs, promoted and not, recorded
in session 7, `test_fp8_wgmma_model_matches_the_session7_h100_outputs`):

  1. Each product is exact (two 4-bit significands). Its exponent, for the alignment, is the
     sum of the operands' exponents `E(a_i) + E(w_i)` (the product's significand is in
     [1, 4), so it may be one binade higher); the accumulator's is its own `E(c)`; zeros
     take no part.
  2. `emax` = the largest of these exponents. Every term (c and the p_i) is truncated toward
     zero to a multiple of `2^(emax - 13)`: 13 fraction bits below the largest term, the
     "about 14 bits" DeepSeek-V3 (section 3.3.2) reports.
  3. The truncated terms are summed exactly and the sum is truncated toward zero to 13
     fraction bits below its own leading bit (14 significant bits; the `frac_out = 13` of
     the validated "hopper" preset of mmaemu, after Khattak and Mikaitis' H100 model).
     While the accumulator dominates this changes nothing (step 2 already cut it there), so
     unpromoted sums hardly show it (the model without it: 99.91% of the unpromoted
     outputs); where an interval's products set emax, their sum can be several binades
     larger and loses its bits below `|sum| * 2^-13`: without step 3 the model missed 1.6%
     (down) and 2.5% (gated up) of the promoted outputs by a few quanta (session 7).

So each instruction loses up to 33 quanta of `2^(emax - 13)`, and once the accumulator has
grown past the products, emax is the accumulator's exponent: every later product loses its
bits below `|c| * 2^-13`. Over the 7B down-proj's K = 1536 (48 instructions) that moved 2.3%
of the bf16 outputs by more than `rtol 2^-7` (the model: 2.3%).

Promotion (DeepSeek-V3, DeepGEMM): every `promote` products (a multiple of 128, one K block
of the kernel), the partial accumulator is added into a separate f32 total with a CUDA-core
f32 add (round to nearest) and restarted from zero, so emax only tracks one interval's partial
sums. It cannot remove step 2's truncation of the products themselves (relative to the
largest product of each instruction) nor step 3's of each sum: what is left is about 40% of
the error at K = 1536 (on `test_fp8_wgmma_model_promotion_shrinks_the_error`'s outputs, 1.0%
outside `rtol 2^-7` promoting every 128, 0.3% promoting after every instruction, 2.4% never),
so the GPU tests compare the kernel elementwise with this model and with the
exact sums only norm-wise (docs/quant.md, "Accuracy").
"""

from __future__ import annotations

import numpy as np

WGMMA_K = 32  # products per fp8 wgmma instruction
FRACTION_BITS = 13  # kept below the largest term's exponent


def _exponent(x: np.ndarray) -> np.ndarray:
    """floor(log2 |x|) of nonzero x (a very small number for zeros: they never set emax);
    frexp is exact everywhere, log2 need not be at powers of two."""
    return np.where(x != 0, np.frexp(x)[1] - 1.0, -1e9)


def _truncate_to_fraction_bits(x: np.ndarray) -> np.ndarray:
    """x truncated toward zero to FRACTION_BITS fraction bits below its own leading bit."""
    quantum = np.exp2(_exponent(x) - FRACTION_BITS)
    return np.where(x != 0, np.trunc(x / np.where(x != 0, quantum, 1.0)) * quantum, 0.0)


def h100_fp8_dot(a: np.ndarray, w: np.ndarray, promote: int = 0) -> np.ndarray:
    """`a @ w.T` as the H100's fp8 wgmma sums it (module docstring), with promotion.

    Args:
      a: [R, K] e4m3 values as float64 (K a multiple of 32).
      w: [N, K] e4m3 values as float64 (the K-major weight tile).
      promote: products between promotions into the f32 total (a multiple of 32); 0 = never.

    Returns:
      float64 [R, N] holding the f32 accumulator the kernel's epilogue reads.
    """
    rows, k_dim = a.shape
    if k_dim % WGMMA_K or (promote and promote % WGMMA_K):
        raise ValueError(f"K={k_dim} and promote={promote} must be multiples of {WGMMA_K}.")
    exp_a, exp_w = _exponent(a), _exponent(w)
    total = np.zeros((rows, w.shape[0]))
    acc = np.zeros_like(total)
    for k0 in range(0, k_dim, WGMMA_K):
        ks = slice(k0, k0 + WGMMA_K)
        products = a[:, None, ks] * w[None, :, ks]  # exact
        product_exp = np.max(np.where(products != 0, exp_a[:, None, ks] + exp_w[None, :, ks],
                                      -1e9), axis=2)
        emax = np.maximum(product_exp, np.where(acc != 0, _exponent(acc), -1e9))
        quantum = np.exp2(emax - FRACTION_BITS)
        summed = (np.trunc(products / quantum[..., None]) * quantum[..., None]).sum(axis=2)
        acc = _truncate_to_fraction_bits(summed + np.trunc(acc / quantum) * quantum)
        if promote and (k0 + WGMMA_K) % promote == 0:
            total = (total + acc).astype(np.float32).astype(np.float64)
            acc = np.zeros_like(acc)
    return (total + acc).astype(np.float32).astype(np.float64)


# ---- A rigorous elementwise bound on what any such accumulation can give
#
# The GPU test checks the promoted down-proj elementwise against this bound, which assumes
# only the mechanism (not the model's exact alignments): per k = 32 instruction every one of
# the 33 terms (the accumulator and 32 products) is truncated to a multiple of
# 2^(emax - 13), emax being at most the largest exponent of the terms, and the sum to 13
# fraction bits below its own leading bit.

F32_ROUNDING = 2.0**-24  # relative, one round-to-nearest f32 operation
RESULT_TRUNCATION = 2.0**-FRACTION_BITS  # relative, step 3's truncation of an instruction's sum


def truncation_error_bound(a: np.ndarray, w: np.ndarray, promote: int = 0) -> np.ndarray:
    """Elementwise bound on |f32 accumulator - exact a @ w.T| for the fp8 wgmma mechanism.

    Per instruction i (32 products, within a promotion interval), with `S_i` the sum of
    |products| the interval's accumulator has taken so far plus the error bound so far (so
    |c| <= S_i):
      emax_i <= max(E(a) + E(w) + 1 over the instruction's products, E(S_i))
      error_i <= 33 * 2^(emax_i - 13) + 2^-13 * (S_i + sum of its |products|)
    (the last term: step 3's truncation of the instruction's sum to 13 fraction bits)
    and each promotion's f32 add rounds once more (2^-24 of the running sum of |products|).
    Any grouping of the products that truncates at most as coarsely stays within it.

    Args:
      a: [R, K] e4m3 values as float64 (K a multiple of 32).
      w: [N, K] e4m3 values as float64.
      promote: products between promotions (a multiple of 32); 0 = never.

    Returns:
      float64 [R, N], the bound in the units of the sums.
    """
    rows, k_dim = a.shape
    chunks = k_dim // WGMMA_K
    per_interval = (promote or k_dim) // WGMMA_K
    abs_a = np.abs(a).reshape(rows, chunks, WGMMA_K)
    abs_w = np.abs(w).reshape(w.shape[0], chunks, WGMMA_K)
    mags = np.einsum("rck,nck->rnc", abs_a, abs_w)  # sum of |products| per instruction
    exp_a = _exponent(a).reshape(rows, chunks, WGMMA_K)
    exp_w = _exponent(w).reshape(w.shape[0], chunks, WGMMA_K)
    nonzero_a = (a != 0).reshape(rows, chunks, WGMMA_K)
    nonzero_w = (w != 0).reshape(w.shape[0], chunks, WGMMA_K)
    bound = np.zeros((rows, w.shape[0]))
    seen = np.zeros_like(bound)  # |products| summed since the interval started
    total = np.zeros_like(bound)  # |products| summed so far
    for c in range(chunks):
        if c % per_interval == 0:
            if c:
                bound += F32_ROUNDING * total  # the promotion's f32 add
            seen[:] = 0
        pe = np.where(nonzero_a[:, None, c, :] & nonzero_w[None, :, c, :],
                      exp_a[:, None, c, :] + exp_w[None, :, c, :] + 1, -1e9).max(axis=2)
        reach = seen + bound  # |c| <= the products it took plus its errors so far
        ce = np.where(seen > 0, np.floor(np.log2(np.where(seen > 0, reach, 1.0))), -1e9)
        emax = np.maximum(pe, ce)
        quantum = np.where(emax > -1e8, np.exp2(emax - FRACTION_BITS), 0.0)
        bound += (WGMMA_K + 1) * quantum + RESULT_TRUNCATION * (reach + mags[:, :, c])
        seen += mags[:, :, c]
        total += mags[:, :, c]
    return bound + F32_ROUNDING * total
