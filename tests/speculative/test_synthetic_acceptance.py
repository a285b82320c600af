"""Synthetic acceptance end to end: what `mtpjax.generate` and the engine measure over thousands
of verify steps equals the closed form of the rule.

`SpecConfig(acceptance="synthetic", synthetic_accept_rate=r)` accepts draft i with probability
r_i given that drafts 1..i-1 were accepted, so

    P(draft i accepted)          = p_i = r_1 * ... * r_i      (per-position acceptance)
    mean acceptance length E[n]  = 1 + p_1 + ... + p_K        (bonus token included)

Every verify step is an independent draw of n (its uniforms come from a key no other step
uses), so the measured means are checked within 4 standard errors of n verify steps.
"""

import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from tests.conftest import random_params, tiny_config

CASES = [(0.8, 3), ((0.9, 0.6, 0.4), 3)]    # (synthetic_accept_rate, K): scalar and per-draft
IDS = ["r0.8-K3", "r(0.9,0.6,0.4)-K3"]
Z = 4.0                                      # standard errors allowed


def closed_form(rate, K):
    """(per-position acceptance p [K], mean acceptance length, variance of num_accepted)."""
    r = np.broadcast_to(np.asarray(rate, np.float64), (K,))
    p = np.cumprod(r)
    # P(num_accepted = 1 + i) = p_i - p_{i+1}, with p_0 = 1 and p_{K+1} = 0
    p_full = np.concatenate([[1.0], p, [0.0]])
    n = np.arange(1, K + 2)
    pmf = p_full[:-1] - p_full[1:]
    mean = float(np.sum(n * pmf))
    var = float(np.sum(n * n * pmf) - mean * mean)
    assert np.isclose(mean, 1 + p.sum())
    return p, mean, var


def _check(per_position, mean_len, steps, rate, K, slack=0.0):
    """Measured per-position acceptance (None: not checked) and mean acceptance length over
    `steps` verify steps against the closed form; `slack` widens the mean's bound."""
    p, mean, var = closed_form(rate, K)
    se = np.sqrt(var / steps)
    assert abs(mean_len - mean) <= Z * se + slack, (
        f"mean acceptance length {mean_len:.4f} over {steps} verify steps; closed form "
        f"{mean:.4f} +- {Z * se:.4f}")
    if per_position is None:
        return
    per_position = np.asarray(per_position, np.float64)
    tol = Z * np.sqrt(p * (1 - p) / steps)
    assert np.all(np.abs(per_position - p) <= tol), (
        f"per-position acceptance {np.round(per_position, 4)}; closed form {np.round(p, 4)} "
        f"+- {np.round(tol, 4)} over {steps} verify steps")


def _model():
    cfg = tiny_config(vocab_size=64, hidden_size=32, num_layers=2, num_mtp_layers=1)
    return cfg, random_params(cfg, 3)


def test_closed_form():
    p, mean, _ = closed_form(0.8, 3)
    np.testing.assert_allclose(p, [0.8, 0.64, 0.512])
    assert np.isclose(mean, 2.952)


@pytest.mark.parametrize("rate,K", CASES, ids=IDS)
def test_generate_matches_closed_form(rate, K):
    cfg, params = _model()
    B, M = 16, 380                           # ~2,000 verify steps
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist()
               for n in rng.integers(2, 9, size=B)]
    spec = SpecConfig(num_speculative_tokens=K, acceptance="synthetic", synthetic_accept_rate=rate)
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=M, spec=spec, page_size=16)
    s = out.stats
    steps = s["verify_steps"]
    assert steps >= 1500
    assert [len(t) for t in out.tokens] == [M] * B            # no stop token, full length
    # the rule's own counts (before max_tokens truncation)
    _check(s["per_position_acceptance"], 1 + s["accepted_draft_tokens"] / steps, steps, rate, K)
    # committed tokens per verify step: the last step of each request may be cut by max_tokens,
    # which removes at most K tokens per request
    _check(s["per_position_acceptance"], s["mean_acceptance_length"], steps, rate, K,
           slack=B * K / steps)


@pytest.mark.parametrize("rate,K", CASES, ids=IDS)
def test_engine_matches_closed_form(rate, K):
    """LLM.generate under continuous batching: more requests than slots, so requests start
    and finish at different steps. Two slots and prompts of K+1 tokens keep every step in one
    token bucket (2 (K+1) <= 8), so the step compiles once."""
    cfg, params = _model()
    S, N, M = 2, 24, 256                     # slots, requests, max_tokens: ~2,000 verify steps
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, size=K + 1).tolist() for _ in range(N)]
    spec = SpecConfig(num_speculative_tokens=K, acceptance="synthetic", synthetic_accept_rate=rate)
    llm = mtpjax.LLM(params, cfg, spec, num_pages=S * 24, page_size=16, max_num_seqs=S,
                     max_num_batched_tokens=S * (K + 1), enable_prefix_caching=False,
                     max_model_len=320)
    counts = [[] for _ in range(N)]          # tokens each request received at each step
    outs = [None] * N
    for ev in llm.generate_stream(prompts, SamplingParams(max_tokens=M)):
        counts[ev.request_index].append(len(ev.new_token_ids))
        if ev.finished:
            outs[ev.request_index] = ev.output
    assert all(o.finish_reason == "length" and len(o.token_ids) == M for o in outs)
    # the engine's own statistics (RequestOutput): accepted drafts before truncation
    steps = sum(o.num_verify_steps for o in outs)
    accepted = sum(o.num_accepted_draft_tokens for o in outs)
    assert steps >= 1500
    assert sum(o.num_draft_tokens for o in outs) == K * steps
    # per-position acceptance from what each verify step delivered: the first event of a
    # request is its prefill token, its last verify step may be cut by max_tokens (left out)
    assert all(c[0] == 1 for c in counts)
    assert sum(len(c) - 1 for c in counts) == steps
    n = np.concatenate([c[1:-1] for c in counts])
    per_position = [(n >= i + 2).mean() for i in range(K)]
    _check(None, 1 + accepted / steps, steps, rate, K)
    _check(per_position, n.mean(), len(n), rate, K)
