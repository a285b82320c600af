"""Acceptance rules: TensorRT-LLM's unit-case data, rejection-sampling exactness, relaxed, synthetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtpjax.speculative import accept_greedy, accept_rejection, accept_relaxed, accept_synthetic

V = 8


def chi2_pvalue(counts, probs):
    """Chi-square goodness of fit of counts to probs (cells with zero probability dropped;
    a count in such a cell is an outright failure)."""
    counts = np.asarray(counts, np.float64)
    probs = np.asarray(probs, np.float64)
    assert counts[probs <= 0].sum() == 0, "sample in a zero-probability cell"
    keep = probs > 0
    exp = probs[keep] / probs[keep].sum() * counts.sum()
    return stats.chisquare(counts[keep], exp).pvalue


def onehot_logits(top1):
    row = np.full(V, -100.0, np.float32)
    row[top1] = 0.0
    return row


# (K, target top-1 ids per request (num_drafts+1 rows), drafts per request, ref tokens, ref num)
# Data of TensorRT-LLM's `sample_and_accept_draft_tokens` unit cases (tests/unittest/_torch/
# speculative/test_mtp.py); context requests are rows with num_drafts == 0.
TRTLLM_CASES = {
    "case0_one_context": (1, [[1]], [[]], [[1]], [1]),
    "case1_four_contexts": (1, [[1], [3], [3], [6]], [[], [], [], []], [[1], [3], [3], [6]], [1, 1, 1, 1]),
    "case2_one_gen": (3, [[1, 3, 2, 4]], [[1, 3, 4]], [[1, 3, 2]], [3]),
    "case3_two_gen_k1": (1, [[1, 3], [4, 6]], [[1], [5]], [[1, 3], [4]], [2, 1]),
    "case4_two_gen_k3": (3, [[1, 3, 2, 4], [4, 6, 5, 2]], [[1, 3, 4], [4, 7, 3]],
                         [[1, 3, 2], [4, 6]], [3, 2]),
    "case5_partial_all_none": (3, [[1, 3, 2, 4], [4, 6, 5, 2], [4, 3, 5, 7]],
                               [[1, 3, 5], [4, 6, 5], [5, 7, 4]],
                               [[1, 3, 2], [4, 6, 5, 2], [4]], [3, 4, 1]),
    "case6_context_and_gen": (1, [[1], [4, 6]], [[], [4]], [[1], [4, 6]], [1, 2]),
}


def _pack(K, top1, drafts):
    B = len(top1)
    logits = np.full((B, K + 1, V), -100.0, np.float32)
    d = np.zeros((B, K), np.int32)
    for b in range(B):
        for i, t in enumerate(top1[b]):
            logits[b, i] = onehot_logits(t)
        d[b, :len(drafts[b])] = drafts[b]
    nd = np.array([len(x) for x in drafts], np.int32)
    return jnp.asarray(logits), jnp.asarray(d), jnp.asarray(nd)


@pytest.mark.parametrize("name", list(TRTLLM_CASES))
def test_trtllm_cases_greedy_and_rejection(name):
    K, top1, drafts, ref_tokens, ref_num = TRTLLM_CASES[name]
    logits, d, nd = _pack(K, top1, drafts)
    tok, num = accept_greedy(logits, d, nd)
    np.testing.assert_array_equal(num, ref_num)
    for b, ref in enumerate(ref_tokens):
        assert tok[b, :ref_num[b]].tolist() == ref
    # rejection sampling with one-hot (greedy) distributions is the same rule
    p = jax.nn.one_hot(jnp.argmax(logits, -1), V)
    q = jax.nn.one_hot(d, V)
    keys = jax.random.split(jax.random.PRNGKey(0), len(top1))
    tok_r, num_r = accept_rejection(p, q, d, nd, keys)
    np.testing.assert_array_equal(num_r, ref_num)
    for b, ref in enumerate(ref_tokens):
        assert tok_r[b, :ref_num[b]].tolist() == ref


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("K", [1, 3])
def test_rejection_sampling_is_lossless(seed, K):
    """Every committed token follows the target distribution given its prefix: with fixed p
    and q per position, the first committed token is ~ p[0] exactly, and so is the token after
    an accepted draft (~ p[1] conditionally)."""
    rng = np.random.default_rng(seed)
    n = 40000
    p_rows = rng.dirichlet(np.full(V, 0.5), size=K + 1).astype(np.float32)
    q_rows = rng.dirichlet(np.full(V, 0.5), size=K).astype(np.float32)
    p = jnp.broadcast_to(jnp.asarray(p_rows), (n, K + 1, V))
    q = jnp.broadcast_to(jnp.asarray(q_rows), (n, K, V))
    kd, ka = jax.random.split(jax.random.PRNGKey(seed))
    drafts = jax.random.categorical(kd, jnp.log(q)).astype(jnp.int32)          # d_i ~ q_i
    tok, num = accept_rejection(p, q, drafts, jnp.full((n,), K, jnp.int32),
                                jax.random.split(ka, n))
    tok, num = np.asarray(tok), np.asarray(num)
    counts = np.bincount(tok[:, 0], minlength=V)
    assert chi2_pvalue(counts, p_rows[0]) > 1e-3
    if K > 1:   # second token, conditioned on the first being the accepted draft
        sel = num >= 2
        counts = np.bincount(tok[sel, 1], minlength=V)
        assert chi2_pvalue(counts, p_rows[1]) > 1e-3
    assert num.min() >= 1 and num.max() <= K + 1


def test_relaxed_acceptance_only_inside_thinking():
    START, END = 6, 7
    # position 0: top1=1 (p~.5), token 2 close behind (p~.4)
    row = np.full(V, -20.0, np.float32)
    row[1], row[2] = np.log(0.5), np.log(0.4)
    logits = jnp.asarray(np.stack([row, row, row])[None].repeat(2, 0))          # [2, 3, V]
    drafts = jnp.asarray([[2, 2], [2, 2]], jnp.int32)
    nd = jnp.asarray([2, 2], jnp.int32)
    thinking = jnp.asarray([True, False])
    tok, num, phase = accept_relaxed(logits, drafts, nd, thinking, topk=3, delta=0.2,
                                     think_start=START, think_end=END)
    assert num.tolist() == [3, 1]                # relaxed accepts both drafts; strict none
    assert tok[0].tolist() == [2, 2, 1] and tok[1, 0] == 1
    assert phase.tolist() == [True, False]
    tok, num, _ = accept_relaxed(logits, drafts, nd, thinking, topk=3, delta=0.05,
                                 think_start=START, think_end=END)
    assert num.tolist() == [1, 1]                # 0.4 < 0.5 - 0.05: outside delta
    # a think-end marker leaves the phase: the draft after it is judged strictly
    row_end = row.copy()
    row_end[END] = np.log(0.45)
    logits = jnp.asarray(np.stack([row_end, row, row])[None])
    tok, num, phase = accept_relaxed(logits, jnp.asarray([[END, 2]]), jnp.asarray([2]),
                                     jnp.asarray([True]), topk=3, delta=0.2,
                                     think_start=START, think_end=END)
    assert num.tolist() == [1]                   # markers need an exact match
    assert phase.tolist() == [True]


def test_synthetic_acceptance_rates():
    n, K = 20000, 3
    rates = jnp.asarray([0.8, 0.5, 0.3])
    logits = jnp.zeros((n, K + 1, V))
    drafts = jnp.ones((n, K), jnp.int32)
    tok, num = accept_synthetic(logits, drafts, jnp.full((n,), K, jnp.int32), rates,
                                jax.random.split(jax.random.PRNGKey(0), n))
    num = np.asarray(num)
    np.testing.assert_allclose((num >= 2).mean(), 0.8, atol=0.02)
    np.testing.assert_allclose((num >= 3).mean(), 0.8 * 0.5, atol=0.02)
    np.testing.assert_allclose((num >= 4).mean(), 0.8 * 0.5 * 0.3, atol=0.02)
