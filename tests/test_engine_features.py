"""Serving features: reproducible seeded sampling (coupled acceptance; preemption-invariant
rejection sampling), per-request K, logprobs, adaptive K."""

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine.runner import _step
from mtpjax.speculative.adaptive import AdaptiveK, RequestAcceptance
from tests.conftest import tiny_config

V = 32
KW = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32)
BIG, TIGHT = 96, 12          # pages: TIGHT forces preemption


@pytest.fixture(scope="module")
def model():
    # default init: flat distributions, so sampled drafts are often accepted (runs of K + bonus)
    cfg = tiny_config(vocab_size=V, num_mtp_layers=2)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, V, size=int(n)).tolist() for n in (3, 9, 5, 12)]


def _sampled(ks=(None,) * 4, logprobs=2):
    return [SamplingParams(temperature=1.0, top_k=(0, 0, 12, 0)[i], top_p=(1, 0.9, 1, 1)[i],
                           seed=100 + i, max_tokens=10, num_speculative_tokens=k,
                           logprobs=logprobs) for i, k in enumerate(ks)]


def _same_logprobs(a, b, tol=1e-5):
    assert len(a) == len(b)
    for da, db in zip(a, b):
        assert da.keys() == db.keys()
        for t in da:
            assert da[t] == pytest.approx(db[t], abs=tol) or da[t] == db[t] == -np.inf


def _check_stats(outs, ks, K):
    for o, k in zip(outs, ks):
        k = K if k is None else k
        assert o.num_draft_tokens == k * o.num_verify_steps     # its own k, not the engine's K
        assert 0 <= o.num_accepted_draft_tokens <= o.num_draft_tokens


def test_seeded_sampling_reproduces_across_preemption_k_and_speculation(model, prompts):
    cfg, params = model
    ks = (0, 1, 2, None)
    plain = mtpjax.LLM(params, cfg, None, num_pages=BIG, max_logprobs=2, **KW)
    want = plain.generate(prompts, _sampled())
    # coupled acceptance: token for token plain seeded sampling, whatever k (0..K per request),
    # with or without preemption; logprobs those of plain decoding at every committed position
    for pages in (BIG, TIGHT):
        llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2, acceptance="coupled"),
                         num_pages=pages, max_logprobs=2, **KW)
        got = llm.generate(prompts, _sampled(ks))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert len(g.logprobs) == len(g.token_ids)
            _same_logprobs(g.logprobs, w.logprobs)
            assert all(len(d) <= 3 and g.token_ids[i] in d for i, d in enumerate(g.logprobs))
        _check_stats(got, ks, 2)
        assert (llm.num_preemptions > 0) == (pages == TIGHT)
    assert sum(o.num_accepted_draft_tokens for o in got) > 0        # accepted runs were checked
    # rejection sampling: a different realization, but the same one with or without preemption
    # (a resumed request re-enters the verify step it left; bug10)
    outs = []
    for pages in (BIG, TIGHT):
        llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=pages, **KW)
        outs.append(llm.generate(prompts, _sampled(logprobs=None)))
        assert (llm.num_preemptions > 0) == (pages == TIGHT)
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_greedy_mixed_k_adaptive_logprobs_and_no_recompiles(model, prompts):
    cfg, params = model
    greedy = lambda ks: [SamplingParams(max_tokens=10, num_speculative_tokens=k, logprobs=2)  # noqa
                         for k in ks]
    plain = mtpjax.LLM(params, cfg, None, num_pages=BIG, max_logprobs=2, **KW)
    want = plain.generate(prompts, greedy((None,) * 4))
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=BIG,
                     max_logprobs=2, **KW)
    for ks in ((2, 2, 2, 2), (0, 1, 2, None)):
        got = llm.generate(prompts, greedy(ks))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            _same_logprobs(g.logprobs, w.logprobs)
        _check_stats(got, ks, 2)
        if ks[0] == 2:
            compiled = _step._cache_size()
    assert _step._cache_size() == compiled        # per-request k is a mask: nothing recompiled
    assert got[0].num_accepted_draft_tokens == 0 and got[0].num_verify_steps > 0
    # adaptive K changes how many drafts are verified, never the tokens
    llm.adaptive_k = AdaptiveK(draft_cost=0.5, probe_interval=3)
    got = llm.generate(prompts, greedy((None,) * 4))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert _step._cache_size() == compiled
    assert sum(o.num_draft_tokens for o in got) < 2 * sum(o.num_verify_steps for o in got)


def test_bad_per_request_k_and_logprobs_are_refused(model):
    cfg, params = model
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16, **KW)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=3 exceeds the engine's K=2"):
        llm.add_request([1, 2], SamplingParams(num_speculative_tokens=3))
    with pytest.raises(ValueError, match=r"logprobs=1 exceeds the engine's max_logprobs=0"):
        llm.add_request([1, 2], SamplingParams(logprobs=1))
    assert llm.scheduler.num_unfinished == 0 and llm._next_id == 0      # nothing changed
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0"):
            SamplingParams(num_speculative_tokens=bad)
        with pytest.raises(ValueError, match="logprobs must be an int >= 0"):
            SamplingParams(logprobs=bad)
    with pytest.raises(ValueError, match="adaptive_k must be an AdaptiveK"):
        mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16,
                   adaptive_k=0.5, **KW)
    with pytest.raises(ValueError, match="draft_cost must be a number >= 0"):
        AdaptiveK(draft_cost=-1)


def test_adaptive_k_follows_its_rule_on_a_scripted_trace():
    pol = AdaptiveK(draft_cost=0.3, batch_knee=16, decay=0.5, prior=0.7, prior_weight=2.0,
                    probe_interval=0)
    st = RequestAcceptance(3)
    # no history: alpha = prior 0.7 everywhere, gains 0.7, 0.49, 0.343 >= 0.3: all three drafts
    assert pol.choose(st, 3, batch_size=1) == 3
    # batch 32: cost 0.3 * 32/16 = 0.6, only gain_1 = 0.7 clears it
    assert pol.choose(st, 3, batch_size=32) == 1
    assert pol.choose(st, 2, batch_size=1) == 2                 # never above the request's k
    # a step that proposed 3 and accepted 1: positions 1 and 2 judged, 1 hit, 2 missed
    st.observe(3, 1, pol.decay)
    np.testing.assert_allclose(st.trials, [1, 1, 0])
    np.testing.assert_allclose(st.hits, [1, 0, 0])
    a = (np.array([1, 0, 0]) + 1.4) / (np.array([1, 1, 0]) + 2.0)   # 0.8, 0.467, 0.7
    np.testing.assert_allclose(pol.alphas(st), a)
    # gains 0.8, 0.373, 0.261: the third falls below 0.3
    assert pol.choose(st, 3, batch_size=1) == 2
    st.observe(2, 0, pol.decay)          # position 1 missed: trials 1.5, hits 0.5
    np.testing.assert_allclose(st.trials, [1.5, 1, 0])
    np.testing.assert_allclose(st.hits, [0.5, 0, 0])
    # alpha_1 = 1.9 / 3.5 = 0.543, gain_2 = 0.543 * 0.467 = 0.253 < 0.3: one draft
    assert pol.choose(st, 3, batch_size=1) == 1
    probing = AdaptiveK(draft_cost=0.3, decay=0.5, probe_interval=3)
    st = RequestAcceptance(3)
    st.observe(3, 0, 0.5)
    st.observe(3, 0, 0.5)                # alpha_1 = (0 + 1.4) / (1.5 + 2) = 0.4 -> k = 1
    assert probing.choose(st, 3, 1) == 2   # steps == 2: the 3rd step of the request probes k + 1
    st.observe(2, 0, 0.5)
    assert probing.choose(st, 3, 1) == 1
