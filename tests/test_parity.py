"""The drift tool: k3 / KL / per-layer metrics against hand-computed values, the sampler,
and `python -m train.parity` end to end on a tiny model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_moe import parity


def test_k3_and_exact_kl_hand_computed():
    # p = (1/2, 1/2), q = (1/4, 3/4). KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3).
    kl = 0.5 * math.log(4 / 3)
    logits_p = np.log([[0.5, 0.5]])
    logits_q = np.log([[0.25, 0.75]]) + 3.0  # logits are unnormalized
    assert parity.exact_kl(logits_p, logits_q) == pytest.approx(kl, rel=1e-12)
    # Sample x = 0: r = q/p = 1/2, k3 = r - 1 - ln r = -1/2 + ln 2.
    # Sample x = 1: r = 3/2, k3 = 1/2 - ln(3/2). Each sample has p = 1/2, so their mean is KL.
    logp = np.log([0.5, 0.5])
    logq = np.log([0.25, 0.75])
    per_token = parity.k3_per_token(logp, logq)
    np.testing.assert_allclose(per_token, [-0.5 + math.log(2), 0.5 - math.log(1.5)], rtol=1e-12)
    assert parity.k3(logp, logq) == pytest.approx(kl, rel=1e-12)
    # KL(q||p) differs: the direction is the sampler's.
    assert parity.exact_kl(logits_q, logits_p) != pytest.approx(kl, rel=1e-3)


def test_k3_is_exact_for_tiny_log_ratios():
    # r - 1 - ln r = d^2/2 + d^3/6 + ... for ln r = d; the naive formula cancels to ~0 here.
    d = 1e-4
    assert parity.k3([0.0], [d]) == pytest.approx(d**2 / 2 + d**3 / 6 + d**4 / 24, rel=1e-9)
    assert parity.k3([0.0], [1e-9]) == pytest.approx(5e-19, rel=1e-6)
    assert parity.k3([-1.5, -0.25], [-1.5, -0.25]) == 0.0


def test_relative_error_and_flip_rate_hand_computed():
    assert parity.relative_error([3.0, 4.0], [3.0, 4.0]) == 0.0
    assert parity.relative_error([3.0, 4.0], [3.0, 5.0]) == pytest.approx(0.2)  # 1 / 5
    a = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1], [0, 0, 1, 1]], bool)
    b = a.copy()
    b[1] = [1, 0, 1, 0]  # one of four tokens changes its set
    assert parity.flip_rate(a, b) == 0.25
    assert parity.flip_rate(a, a) == 0.0


def test_drift_scores_only_generated_tokens():
    rng = np.random.default_rng(0)
    n, s, v, prompt = 2, 6, 5, 3
    tokens = rng.integers(0, v, (n, s))
    ref = rng.normal(size=(n, s, v))
    cand = ref.copy()
    cand[:, : prompt - 1] += 10.0  # prompt positions that predict prompt tokens: ignored
    cand[:, -1] += 10.0  # the last position predicts nothing: ignored
    hidden = rng.normal(size=(3, n, s, 4))
    sets = rng.random((3, n, s, v)) < 0.5
    same = parity.drift(tokens, prompt, ref, cand, ref_hidden=hidden, cand_hidden=hidden,
                        ref_selected=sets, cand_selected=sets)
    assert (same.k3, same.kl, same.max_abs_logp) == (0.0, 0.0, 0.0)
    assert same.hidden_rel_err == (0.0,) * 3 and same.flip_rate == (0.0,) * 3
    assert same.num_tokens == n * (s - prompt)
    cand[0, prompt - 1, tokens[0, prompt]] += 0.5  # raise one generated token's logit
    moved = parity.drift(tokens, prompt, ref, cand)
    lp = parity.log_softmax64(ref[0, prompt - 1])
    lq = parity.log_softmax64(cand[0, prompt - 1])
    tok = tokens[0, prompt]
    want_k3 = float(np.expm1(lq[tok] - lp[tok]) - (lq[tok] - lp[tok])) / same.num_tokens
    want_kl = float(np.sum(np.exp(lp) * (lp - lq))) / same.num_tokens
    assert moved.k3 == pytest.approx(want_k3, rel=1e-9)
    assert moved.kl == pytest.approx(want_kl, rel=1e-9)
    assert moved.max_abs_logp == pytest.approx(abs(lq[tok] - lp[tok]), rel=1e-12)
    with pytest.raises(ValueError, match="prompt_len must be in"):
        parity.drift(tokens, s, ref, cand)
    with pytest.raises(ValueError, match="cand_logits must be"):
        parity.drift(tokens, prompt, ref, cand[:, :-1])


def test_sample_continuations_from_a_bigram_model():
    vocab = 7
    table = jax.random.normal(jax.random.key(0), (vocab, vocab)) * 3.0  # next-token logits

    def logits_fn(table, tokens):  # causal: position t sees only tokens[:, t]
        return table[tokens]

    prompts = jnp.array([[1, 2, 3], [4, 5, 6]])
    key = jax.random.key(1)
    tokens, logits = parity.sample_continuations(logits_fn, table, prompts, 5, key)
    assert tokens.shape == (2, 8) and logits.shape == (2, 5, vocab)
    np.testing.assert_array_equal(tokens[:, :3], prompts)
    # Each step's logits are the bigram row of the previous token.
    np.testing.assert_array_equal(logits, np.asarray(table)[np.asarray(tokens[:, 2:-1])])
    again, _ = parity.sample_continuations(logits_fn, table, prompts, 5, key)
    np.testing.assert_array_equal(tokens, again)
    other, _ = parity.sample_continuations(logits_fn, table, prompts, 5, jax.random.key(2))
    assert np.any(np.asarray(other) != np.asarray(tokens))
    with pytest.raises(ValueError, match="num_tokens must be a positive int"):
        parity.sample_continuations(logits_fn, table, prompts, 0, key)


SMALL = ["--set", "num_layers=1", "--set", "d_model=64", "--set", "d_expert=64",
         "--set", "seq_len=32", "--set", "batch_size=2", "--set", "eval_batches=1"]


def test_parity_tool_end_to_end(tmp_path, capsys):
    from train import parity as tool

    out = tmp_path / "parity"
    argv = ["--train-steps", "2", "--no-progress", "--prompts", "2", "--prompt-len", "8",
            "--tokens", "8", "--references", "hf_order", "--candidates",
            "fp32,bf16_per_expert", "--out", str(out), *SMALL]
    assert tool.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Reference `hf_order`" in printed and "| bf16_per_expert |" in printed
    results = json.loads((out / "parity.json").read_text())
    assert (out / "parity.png").stat().st_size > 0 and (out / "parity.md").exists()
    assert "step 2" in results["model"]  # trained here, then loaded from its checkpoint
    rows = results["references"]["hf_order"]["rows"]
    zero = {"k3": 0.0, "kl": 0.0, "max_abs_logp": 0.0}
    for name in ("noise: reference scored twice", "noise: sampling vs rescoring",
                 "noise: fp32 scored twice", "bf16_per_expert"):
        assert {k: rows[name][k] for k in zero} == zero, name  # deterministic; parity mode is exact
    fp32 = rows["fp32"]
    assert fp32["k3"] > 0 and fp32["kl"] > 0 and fp32["num_tokens"] == 16
    assert len(fp32["hidden_rel_err"]) == 1 and 0 < fp32["hidden_rel_err"][0] < 0.05
    # A checkpoint directory works too, and bad arguments are refused with a message.
    again = tmp_path / "again"
    assert tool.main(["--checkpoint", str(out / "model"), "--prompts", "2", "--prompt-len", "8",
                      "--tokens", "8", "--references", "hf_order", "--candidates",
                      "bf16_per_expert", "--out", str(again)]) == 0
    assert tool.main(["--candidates", "nope", "--out", str(again)]) == 2
    assert tool.main(["--exact-math", "--out", str(again)]) == 2  # xla runs no kernels
    assert tool.main(["--checkpoint", str(tmp_path), "--out", str(again)]) == 2
    assert "no checkpoints/ directory" in capsys.readouterr().err


def test_quant_eval_end_to_end(tmp_path, capsys):
    """`python -m train.quant_eval` scores the same validation windows as built, in bf16 and
    with fp8 experts (the jnp references here). It loads models through `train.parity`'s
    `load_model`, whose train-then-reload path `test_parity_tool_end_to_end` covers."""
    from train import quant_eval

    out = tmp_path / "quant"
    argv = ["--config", "tiny", "--train-steps", "0", "--no-progress", "--batches", "1",
            "--backend", "xla", "--out", str(out), *SMALL]
    assert quant_eval.main(argv) == 0
    assert "| fp8 | bfloat16 | xla (fp8 experts) |" in capsys.readouterr().out
    results = json.loads((out / "quant_eval.json").read_text())
    assert "untrained" in results["model"]
    rows = results["rows"]
    assert rows["bf16"]["minus_bf16"] == 0 and rows["bf16"]["logits_rel_err_vs_bf16"] == 0
    # fp8 changes the logits (four e4m3 roundings per layer) but not what the model predicts.
    assert 0 < rows["fp8"]["logits_rel_err_vs_bf16"] < 0.2
    assert abs(rows["fp8"]["minus_bf16"]) < 0.1
    assert math.isfinite(rows["as trained"]["val_loss"])
