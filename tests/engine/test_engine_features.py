"""Serving features: reproducible seeded sampling (coupled acceptance; preemption-invariant
rejection sampling), per-request K, logprobs, adaptive K."""

import dataclasses

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine.runner import _step
from mtpjax.sampling import sampling_mode
from mtpjax.speculative.adaptive import AcceptanceTable, AdaptiveK, RequestAcceptance
from tests.conftest import tiny_config

V = 32
# PAGES is tight: 4 requests at once preempt; one alone never does (each fits alone), which
# gives "with and without preemption" on one engine (sampling never depends on the batch)
# min_token_bucket = the token budget: every step of an engine runs T = 32 (fewer compiles)
KW = dict(num_pages=10, page_size=4, max_num_seqs=4, max_num_batched_tokens=32,
          min_token_bucket=32, max_logprobs=2)


@pytest.fixture(scope="module")
def model():
    # default init: flat distributions, so sampled drafts are often accepted (runs of K + bonus)
    cfg = tiny_config(vocab_size=V, num_mtp_layers=2)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def engines(model):
    cfg, params = model
    llms = {name: mtpjax.LLM(params, cfg, spec, **KW) for name, spec in (
        ("plain", None), ("rejection", SpecConfig(num_speculative_tokens=2)),
        ("coupled", SpecConfig(num_speculative_tokens=2, acceptance="coupled")))}
    for llm in llms.values():         # record every (tokens, first-pass, sampling mode) it packs
        llm.buckets, pack = set(), llm.runner.pack

        def recording_pack(out, num_drafts=None, llm=llm, pack=pack):
            batch, F = pack(out, num_drafts)
            llm.buckets.add((batch.tokens.shape[0], F, sampling_mode(batch.sampling.temperature)))
            return batch, F
        llm.runner.pack = recording_pack
    return llms


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, V, size=int(n)).tolist() for n in (3, 9, 5, 12)]


def _sampled(ks=(None,) * 4, logprobs=2):
    return [SamplingParams(temperature=1.0, top_k=(0, 0, 12, 0)[i], top_p=(1, 0.9, 1, 1)[i],
                           seed=100 + i, max_tokens=16, num_speculative_tokens=k,
                           logprobs=logprobs) for i, k in enumerate(ks)]


def _together(llm, prompts, sps):
    """All requests at once: the tight cache preempts."""
    before = llm.num_preemptions
    outs = llm.generate(prompts, sps)
    assert llm.num_preemptions > before
    return outs


def _alone(llm, prompts, sps):
    """One request at a time: never preempted."""
    before = llm.num_preemptions
    outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, sps)]
    assert llm.num_preemptions == before
    return outs


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


def test_seeded_sampling_reproduces_across_preemption_k_and_speculation(engines, prompts):
    want = engines["plain"].generate(prompts, _sampled())   # plain: preemption never mattered
    # coupled acceptance: token for token plain seeded sampling, whatever k (0..K per request),
    # through preemption; logprobs those of plain decoding at every committed position
    ks = (0, 1, 2, None)
    got = _together(engines["coupled"], prompts, _sampled(ks))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert len(g.logprobs) == len(g.token_ids)
        _same_logprobs(g.logprobs, w.logprobs)
        assert all(len(d) <= 3 and g.token_ids[i] in d for i, d in enumerate(g.logprobs))
    _check_stats(got, ks, 2)
    assert sum(o.num_accepted_draft_tokens for o in got) > 0        # accepted runs were checked
    # rejection sampling: another realization, but the same one with or without preemption
    # (a resumed request re-enters the verify step it left; bug10: before, 2 of these 4
    # requests changed when preempted)
    llm = engines["rejection"]
    alone = _alone(llm, prompts, _sampled(logprobs=None))
    assert [o.token_ids for o in _together(llm, prompts, _sampled(logprobs=None))] == \
        [o.token_ids for o in alone]
    assert [o.token_ids for o in alone] != [o.token_ids for o in want]


def test_greedy_mixed_k_adaptive_logprobs_and_no_recompiles(engines, prompts):
    greedy = lambda ks: [SamplingParams(max_tokens=10, num_speculative_tokens=k, logprobs=2)  # noqa
                         for k in ks]
    want = engines["plain"].generate(prompts, greedy((None,) * 4))
    llm = engines["rejection"]
    # compile guard: the step compiles once per (tokens, first-pass, sampling mode, draft
    # passes); k is data, so the compile cache may grow only by the programs a run newly
    # reaches (scheduling differs with k; a batch whose largest k is lower draws fewer drafts)
    buckets = llm.runner.compiled_keys

    def run(ks, policy=None):
        seen, compiled = set(buckets), _step._cache_size()
        llm.adaptive_k = policy
        try:
            outs = llm.generate(prompts, greedy(ks))
        finally:
            llm.adaptive_k = None
        assert _step._cache_size() == compiled + len(buckets - seen)     # nothing else compiled
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        for o, w in zip(outs, want):
            _same_logprobs(o.logprobs, w.logprobs)
        return outs

    for ks in ((2, 2, 2, 2), (0, 1, 2, None)):
        got = run(ks)
        _check_stats(got, ks, 2)
    assert got[0].num_accepted_draft_tokens == 0 and got[0].num_verify_steps > 0
    # adaptive K changes how many drafts are verified, never the tokens
    got = run((None,) * 4, AdaptiveK(draft_cost=0.5, probe_interval=3))
    assert sum(o.num_draft_tokens for o in got) < 2 * sum(o.num_verify_steps for o in got)


def test_bad_per_request_k_and_logprobs_are_refused(model):
    cfg, params = model
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16)
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
                   adaptive_k=0.5)
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


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adaptive_k_table_equals_the_per_request_rule(seed):
    """The engine's vectorized table chooses and updates exactly as the per-request rule does,
    over a random trace with requests joining and leaving (rows reused)."""
    rng = np.random.default_rng(seed)
    K = 4
    pol = AdaptiveK(draft_cost=0.25, batch_knee=8, decay=0.8, probe_interval=3, min_k=1)
    table, alone = AcceptanceTable(K), {}
    next_id = 0
    for _ in range(60):
        for sid in [s for s in alone if rng.random() < 0.1]:
            table.drop(sid)
            del alone[sid]
        while len(alone) < 12 and rng.random() < 0.7:
            alone[next_id] = RequestAcceptance(K)
            next_id += 1
        sids = list(alone)
        if not sids:
            continue
        k_max = rng.integers(0, K + 1, len(sids))
        batch = int(rng.integers(1, 40))
        ks = table.choose(pol, sids, k_max, batch)
        assert ks.tolist() == [pol.choose(alone[s], int(m), batch) for s, m in zip(sids, k_max)]
        acc = np.minimum(rng.integers(0, K + 1, len(sids)), ks)
        table.observe(sids, ks, acc, pol.decay)
        for s, k, a in zip(sids, ks, acc):
            alone[s].observe(int(k), int(a), pol.decay)
        for s in sids:
            r = table.row_of[s]
            np.testing.assert_allclose(table.trials[r], alone[s].trials)
            np.testing.assert_allclose(table.hits[r], alone[s].hits)
            assert table.steps[r] == alone[s].steps


def test_coupled_rule_commits_the_targets_own_samples():
    """accept_coupled == sample_from_probs(p_j, key_j) at every committed position, whatever the
    drafts (so the output is the target distribution exactly); drafts drawn with the same keys
    from q == p are always accepted, from an unrelated q rarely."""
    import jax.numpy as jnp
    from mtpjax.sampling import sample_from_probs
    from mtpjax.speculative.accept import accept_coupled
    B, K, Vs = 256, 3, 8
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    p = jax.nn.softmax(jax.random.normal(ks[0], (B, K + 1, Vs)), -1)
    keys = jax.random.split(ks[1], B * (K + 1)).reshape(B, K + 1, 2)
    own = np.asarray(sample_from_probs(p.reshape(-1, Vs), keys.reshape(-1, 2)).reshape(B, K + 1))
    num_drafts = jnp.asarray(np.arange(B) % (K + 1), jnp.int32)          # k = 0..K per row
    rates = []
    for q in (p[:, :K], jax.nn.softmax(jax.random.normal(ks[2], (B, K, Vs)), -1)):
        drafts = sample_from_probs(q.reshape(-1, Vs), keys[:, :K].reshape(-1, 2)).reshape(B, K)
        toks, n = accept_coupled(p, drafts, num_drafts, keys)
        toks, n, drafts = np.asarray(toks), np.asarray(n), np.asarray(drafts)
        for b in range(B):
            assert 1 <= n[b] <= num_drafts[b] + 1
            assert (toks[b, :n[b]] == own[b, :n[b]]).all()
            assert (toks[b, :n[b] - 1] == drafts[b, :n[b] - 1]).all()
        rates.append((n - 1).sum() / int(num_drafts.sum()))
    assert rates[0] == 1.0 and rates[1] < 0.5


def test_bench_spec_features_smoke():
    from mtpjax.bench import spec_features
    # one timed window each: the smoke checks the rows, not their timings
    out = spec_features.main(["logprobs", "--tiny", "--batch", "2", "--steps", "1",
                              "--windows", "1", "--prompt-len", "8"])
    assert [r[0] for r in out["logprobs"]] == [0, 5] and all(r[1] > 0 for r in out["logprobs"])
    out = spec_features.main(["adaptive", "--tiny", "--batches", "2", "--steps", "1",
                              "--windows", "1", "--prompt-len", "8"])
    assert [r[1] for r in out["adaptive"]] == ["fixed K", "adaptive"]


@pytest.mark.parametrize("seed", range(3))
def test_token_logprobs_equal_the_dicts_built_eagerly(seed):
    """RequestOutput.logprobs keeps each step's arrays and builds dicts on access: the same
    dicts the eager per-step build gave, in order, through snapshots and later appends."""
    from mtpjax.engine.logprobs import TokenLogprobs
    r = np.random.default_rng(seed)
    n, N = int(r.integers(1, 4)), 5
    lp, want, snaps = TokenLogprobs(n), [], []
    for _ in range(int(r.integers(3, 9))):
        k = int(r.integers(0, 5))
        toks = r.integers(0, 50, k).tolist()
        chosen = r.standard_normal(k).astype(np.float32)
        ids = r.integers(0, 50, (k, N)).astype(np.int32)
        vals = np.sort(r.standard_normal((k, N)).astype(np.float32))[:, ::-1]
        R = int(r.integers(1, 4))                   # the request's row of a step's [R, J] arrays
        row = int(r.integers(0, R))
        J = k + int(r.integers(0, 2))
        pad = lambda a: np.stack([np.pad(a, [(0, J - k)] + [(0, 0)] * (a.ndim - 1))  # noqa: E731
                                  if i == row else r.standard_normal((J,) + a.shape[1:]).astype(a.dtype)
                                  for i in range(R)])
        lp.append_step(toks, (pad(chosen), pad(ids), pad(vals)), row)
        for j in range(k):
            d = dict(zip(ids[j, :n].tolist(), vals[j, :n].tolist()))
            d[toks[j]] = float(chosen[j])
            want.append(d)
        if r.random() < 0.5 and len(lp):
            _ = lp[int(r.integers(0, len(lp)))]          # a partial build, then more appends
        snaps.append((lp.snapshot(), list(want)))
    assert lp == want and list(lp) == want and len(lp) == len(want)
    for snap, w in snaps:
        assert snap == w
    if want:
        assert lp[-1] == want[-1] and lp[1:3] == want[1:3]
        lp[0][12345] = 0.0                                  # a copy: the stored dict is unchanged
        assert lp[0] == want[0]
    with pytest.raises(IndexError, match=f"index {len(want)} out of range"):
        lp[len(want)]


@pytest.mark.parametrize("name", ["plain", "rejection"])
def test_prompt_logprobs_equal_the_generated_tokens_logprobs(engines, prompts, name):
    """prompt_logprobs come from a separate uncached pass over the prompt: for a prompt that
    is an earlier request's prompt + completion, they equal the logprobs that request got for
    its completion (paged verify logits, bonus tokens included) to 1e-5 — greedy, and sampled
    with top-k / top-p (the processed distribution, -inf outside the filter)."""
    llm = engines[name]
    for i, sp in enumerate(_sampled() + [SamplingParams(max_tokens=12, logprobs=2)]):
        p = prompts[i % len(prompts)]
        first = llm.generate([p], [sp])[0]
        again = dataclasses.replace(sp, max_tokens=1, prompt_logprobs=2, logprobs=None)
        second = llm.generate([p + first.token_ids], [again])[0]
        plp = second.prompt_logprobs
        assert len(plp) == len(p) + len(first.token_ids) and plp[0] is None
        assert first.prompt_logprobs is None and second.logprobs is None
        for j, d in enumerate(plp[1:], start=1):
            assert (p + first.token_ids)[j] in d and len(d) <= 3
        _same_logprobs(plp[len(p):], first.logprobs[:len(first.token_ids)])


def test_prompt_logprobs_are_refused_past_max_logprobs(model):
    cfg, params = model
    llm = mtpjax.LLM(params, cfg, None, num_pages=8, page_size=4, max_logprobs=1, warmup=False)
    with pytest.raises(ValueError, match=r"prompt_logprobs=2 exceeds the engine's max_logprobs=1"):
        llm.generate([[1, 2, 3]], [SamplingParams(prompt_logprobs=2)])
    with pytest.raises(ValueError, match="prompt_logprobs must be an int >= 0"):
        SamplingParams(prompt_logprobs=-1)
    out = llm.generate([[1, 2, 3]], [SamplingParams(max_tokens=2, prompt_logprobs=0)])[0]
    assert out.prompt_logprobs[0] is None and [list(d) for d in out.prompt_logprobs[1:]] == [[2], [3]]
