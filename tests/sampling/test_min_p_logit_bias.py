"""min_p and logit_bias (SamplingParams): vLLM's semantics, lossless under speculation (the
drafter's proposal and the target's verify distribution get the same processing), per request
in batches with requests that use neither, and no change to the program of a batch without
them (their modes, sampling.FEATURE_MODES, are only traced when some row asks)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.config import LOGIT_BIAS_SLOTS
from mtpjax.sampling import (FEATURE_MODES, PENALTY_MODES, SAMPLING_MODES, SamplingArrays,
                             apply_logit_bias, feature_arrays, filtered_probs, sample,
                             sampling_mode)
from tests.conftest import tiny_config
from tests.speculative.test_accept import chi2_pvalue


def np_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0, bias=None):
    """Reference for one row: bias, temperature, top-k, top-p, then min_p relative to the top
    token (vLLM); temperature 0 is the one-hot argmax of the biased logits."""
    x = np.asarray(logits, np.float64).copy()
    for t, b in (bias or {}).items():
        x[t] += b
    if temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    p = np.exp(x / temperature - np.max(x / temperature))
    p /= p.sum()
    order = np.argsort(-p)
    if top_k:
        p[order[top_k:]] = 0
        p /= p.sum()
    if top_p < 1:
        before = np.cumsum(p[order]) - p[order]
        p[order[before >= top_p]] = 0
        p /= p.sum()
    p[p < min_p * p.max()] = 0
    return p / p.sum()


# ---- semantics ---------------------------------------------------------------------------------

def test_min_p_matches_numpy_reference_and_zero_is_off():
    rng = np.random.default_rng(0)
    B, V = 12, 40
    logits = rng.normal(size=(B, V)).astype(np.float32) * 3
    temp = rng.uniform(0.3, 2.0, B).astype(np.float32)
    temp[:2] = 0
    top_k = rng.choice([0, 5, 20], B).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3, 1.0], B).astype(np.float32)
    got = np.asarray(filtered_probs(jnp.asarray(logits), temp, top_k, top_p, "filter_full",
                                    min_p=jnp.asarray(min_p)))
    want = np.stack([np_probs(logits[i], temp[i], top_k[i], top_p[i], min_p[i])
                     for i in range(B)])
    np.testing.assert_allclose(got, want, atol=2e-6)
    # min_p = 0 in the feature mode gives the "filter" mode's distribution
    zero = np.asarray(filtered_probs(jnp.asarray(logits), temp, top_k, top_p, "filter_full",
                                     min_p=jnp.zeros(B)))
    np.testing.assert_allclose(
        zero, np.asarray(filtered_probs(jnp.asarray(logits), temp, top_k, top_p, "filter")),
        rtol=1e-6, atol=1e-7)


def test_logit_bias_is_added_before_temperature_and_argmax():
    rng = np.random.default_rng(1)
    V = 24
    logits = rng.normal(size=(4, V)).astype(np.float32)
    sps = [SamplingParams(logit_bias={3: 7.5, 11: -2.0}),              # greedy: biased argmax
           SamplingParams(temperature=0.7, logit_bias={5: 100}),        # forced
           SamplingParams(temperature=1.3, min_p=0.1, logit_bias={0: 1.0, 23: -100}),
           SamplingParams(temperature=1.0)]                             # none of it
    sp = SamplingArrays.build(sps, 0)
    assert sp.mode == "filter_full"
    probs = np.asarray(filtered_probs(apply_logit_bias(jnp.asarray(logits), sp),
                                      sp.temperature, sp.top_k, sp.top_p, sp.mode, sp.min_p))
    for i, s in enumerate(sps):
        np.testing.assert_allclose(probs[i], np_probs(logits[i], s.temperature, s.top_k,
                                                      s.top_p, s.min_p, dict(s.logit_bias or ())),
                                   atol=2e-6)
    # over a draft-vocabulary subset, each subset entry gets its own id's bias
    ids = jnp.asarray([5, 0, 11, 23, 7])
    np.testing.assert_array_equal(apply_logit_bias(jnp.asarray(logits)[:, ids], sp, ids),
                                  apply_logit_bias(jnp.asarray(logits), sp)[:, ids])
    toks = np.asarray(jax.jit(sample)(jnp.asarray(logits), sp, jnp.arange(4)))
    assert toks[0] == np.argmax(logits[0] + np.eye(V)[3] * 7.5 - np.eye(V)[11] * 2)
    assert toks[1] == 5


# ---- lossless under speculation, end to end ----------------------------------------------------

@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(vocab_size=16, num_mtp_layers=2)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(3), std=0.3)


@pytest.fixture(scope="module")
def biased(model):
    """Greedy rows with a bias (one boosting, one banning the unbiased argmax), a row with
    none, and a sampled row forced by +100, and their tokens under plain decoding."""
    cfg, params = model
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2]]
    ban = int(jnp.argmax(mtpjax.forward(params, cfg, jnp.asarray([prompts[2]]))[0, -1]))
    sps = [SamplingParams(logit_bias={3: 4.0, 7: 2.0}, max_tokens=10),
           SamplingParams(max_tokens=10),
           SamplingParams(logit_bias={ban: -100}, max_tokens=10),
           SamplingParams(temperature=1.0, logit_bias={"9": 100}, seed=1, max_tokens=10)]
    ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=10, sampling=sps).tokens
    return prompts, sps, ref, ban


def test_greedy_logit_bias_is_lossless_under_speculation(model, biased):
    """Every K and method gives plain decoding's tokens; the featureless row gives what it
    gives in a batch without features."""
    cfg, params = model
    prompts, sps, ref, ban = biased
    free = mtpjax.generate(params, cfg, prompts[:2], max_new_tokens=10).tokens   # no features
    assert ref[1] == free[1]
    assert ref[0] != free[0] and ref[2][0] != ban
    assert ref[3] == [9] * 10
    # chain K = 2 runs in the distribution test below
    for method, K in [("chain", 1), ("chain", 3), ("multi_layer", 2)]:
        out = mtpjax.generate(params, cfg, prompts, max_new_tokens=10, sampling=sps,
                              spec=SpecConfig(num_speculative_tokens=K, method=method))
        assert out.tokens == ref, (method, K)


def test_sampled_min_p_and_logit_bias_distribution_under_speculation():
    """Joint law of the first two tokens of speculative decoding (chain, K = 2) == the exact
    law of the processed target (numpy reference), for min_p rows and logit_bias rows mixed
    with greedy rows in one batch."""
    V = 8
    cfg = tiny_config(vocab_size=V, num_mtp_layers=1)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(21), std=0.3)
    prompt = [1, 2, 3]
    kinds = [SamplingParams(temperature=1.0, min_p=0.25),
             SamplingParams(temperature=0.8, logit_bias={2: 1.5, 5: -2.0, 0: 0.5}),
             SamplingParams(logit_bias={4: 3.0})]
    chunk, chunks = 480, 3
    sps = [kinds[i % 3] for i in range(chunk)]
    spec = SpecConfig(num_speculative_tokens=2)
    toks = np.concatenate([np.asarray(mtpjax.generate(
        params, cfg, [prompt] * chunk, max_new_tokens=2, spec=spec, sampling=sps,
        seed=7 + c).tokens) for c in range(chunks)])
    rows = np.arange(len(toks)) % 3
    seqs = np.concatenate([np.tile(prompt, (V, 1)), np.arange(V)[:, None]], 1)
    logits = np.asarray(mtpjax.forward(params, cfg, jnp.asarray(seqs)))            # [V, 4, V]
    for k, s in enumerate(kinds):
        law = lambda lg: np_probs(lg, s.temperature, s.top_k, s.top_p, s.min_p,   # noqa: E731
                                  dict(s.logit_bias or ()))
        p1 = law(logits[0, 2])
        joint = p1[:, None] * np.stack([law(logits[t, 3]) for t in range(V)])
        got = toks[rows == k]
        counts = np.bincount(got[:, 0] * V + got[:, 1], minlength=V * V)
        if s.temperature == 0:
            assert counts[np.argmax(joint)] == len(got)
        else:
            assert chi2_pvalue(counts, joint.reshape(-1)) > 1e-3, k
            if s.min_p:
                assert (p1 == 0).any()      # min_p did cut something: the test tests it


# ---- the guard: batches without these features run the program they ran before ----------------

def test_features_only_in_their_own_modes():
    """A batch without min_p / logit_bias picks the pre-existing modes, and in those modes the
    step's functions trace to the same program whether or not processor arrays are attached
    (they are never read); the feature modes hold no device-side branch either."""
    from mtpjax.speculative.accept import apply_acceptance
    from mtpjax.speculative.draft import draw_draft
    assert sampling_mode(np.float32([0, 1]), [SamplingParams(min_p=0.0, logit_bias={}),
                                              SamplingParams(temperature=1.0)]) == "filter"
    # min_p cannot change a greedy row, so it does not change a greedy batch's mode
    assert sampling_mode(np.float32([0]), [SamplingParams(min_p=0.5)]) == "greedy"
    assert sampling_mode(np.float32([0]), [SamplingParams(logit_bias={1: 1})]) == "greedy_bias"
    assert SamplingArrays.build([SamplingParams(min_p=0.0)]).min_p is None
    B, K, V = 3, 2, 16
    logits = jnp.zeros((B, K + 1, V))
    drafts, q = jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K, V))
    spec = SpecConfig(num_speculative_tokens=K)
    feats = dict(zip(("min_p", "bias_ids", "bias_vals"), map(
        jnp.asarray, feature_arrays([SamplingParams(min_p=0.5, logit_bias={1: 2.0})] * B))))

    def programs(sp):
        fns = [lambda: sample(logits[:, 0], sp, jnp.zeros((B,), jnp.int32)),
               lambda: apply_acceptance(spec, logits, drafts, q, jnp.full((B,), K, jnp.int32),
                                        jnp.zeros((B,), bool), sp, jnp.zeros((B,), jnp.int32)),
               lambda: draw_draft(logits[:, 0], sp, jnp.zeros((B,), jnp.int32),
                                  source="model")]
        return [str(jax.make_jaxpr(f)()) for f in fns]

    base = SamplingArrays(temperature=jnp.ones((B,)), top_k=jnp.zeros((B,), jnp.int32),
                          top_p=jnp.ones((B,)), keys=jnp.zeros((B, 2), jnp.uint32))
    for mode in SAMPLING_MODES:
        assert programs(base.replace(mode=mode)) == programs(base.replace(mode=mode, **feats))
    for mode in sorted(set(FEATURE_MODES) - set(PENALTY_MODES)):   # those: test_penalties.py
        text = "".join(programs(base.replace(mode=mode, **feats)))
        assert "scatter-add" in text and "cond[" not in text, mode


def test_engine_packs_features_only_when_a_row_has_them(model):
    """The engine's packed batch has its old layout (and base mode) unless a row asks; the
    feature modes are not warmed up (compiled on first use)."""
    from mtpjax.engine import runner as runner_mod
    from mtpjax.engine.runner import pack_host
    cfg, params = model
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=8, warmup=False)
    r = llm.runner
    empty, _ = r.pack(runner_mod.SchedulerOutput([], [], r.K))
    T, R, M = empty.tokens.shape[0], empty.kinds.shape[0], empty.block_tables.shape[1]
    assert empty.sampling.mode in SAMPLING_MODES and empty.sampling.min_p is None
    assert pack_host(empty).size == 3 * T + R * (10 + r.K) + R * M + 4 * R
    e = empty.sampling
    sp = r._sampling(e.temperature, e.top_k, e.top_p, e.keys,
                     [SamplingParams(logit_bias={2: 1})] + [None] * (R - 1))
    assert sp.mode == "greedy_bias" and sp.bias_ids[0, 0] == 2 and sp.bias_vals[0, 0] == 1
    full = pack_host(empty.replace(sampling=sp))
    assert full.size == pack_host(empty).size + R * (1 + 2 * LOGIT_BIAS_SLOTS)
    assert not any(m in FEATURE_MODES for m in SAMPLING_MODES)


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(min_p=1.5), r"min_p must be a number in \[0, 1\].*min_p=1.5"),
    (dict(min_p=-0.1), r"min_p"),
    (dict(min_p=float("nan")), r"min_p"),
    (dict(logit_bias={1: 100.5}), r"logit_bias biases must be numbers in \[-100, 100\]"),
    (dict(logit_bias={1: float("inf")}), r"logit_bias biases"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias token ids must be non-negative"),
    (dict(logit_bias={i: 1.0 for i in range(LOGIT_BIAS_SLOTS + 1)}),
     rf"logit_bias has {LOGIT_BIAS_SLOTS + 1} entries; at most LOGIT_BIAS_SLOTS"),
    (dict(logit_bias=[1, 2]), r"logit_bias must be a mapping"),
    (dict(logit_bias=[(1, 1.0), (1, 2.0)]), r"logit_bias has token id 1 twice"),
])
def test_sampling_params_refuse_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_ids_outside_the_vocabulary_are_refused_by_position(model):
    cfg, params = model
    assert SamplingParams(logit_bias={"5": 1, 2: -3}).logit_bias == ((2, -3.0), (5, 1.0))
    assert SamplingParams(logit_bias={}).logit_bias is None
    sps = [SamplingParams(), SamplingParams(logit_bias={16: 1.0})]
    with pytest.raises(ValueError, match=r"sampling\[1\]: logit_bias has token id 16, outside "
                                         r"the vocabulary \[0, 16\)"):
        mtpjax.generate(params, cfg, [[1], [2]], max_new_tokens=2, sampling=sps)
    llm = mtpjax.LLM(params, cfg, None, num_pages=8, page_size=4, max_num_seqs=2, warmup=False)
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: logit_bias has token id 16"):
        llm.generate([[1], [2]], sps)


def test_server_passes_min_p_and_logit_bias_and_names_the_field():
    from mtpjax.serve.protocol import RequestError, ServeContext, parse_completion
    ctx = ServeContext(model_name="m", vocab_size=16, num_speculative_tokens=2,
                       acceptance="rejection", max_completion_tokens=lambda n: 32 - n,
                       encode=None)
    body = {"model": "m", "prompt": [1, 2], "temperature": 1, "min_p": 0.1,
            "logit_bias": {"5": -100, "3": 2.5}}
    sp = parse_completion(body, ctx).sampling_params
    assert sp.min_p == 0.1 and sp.logit_bias == ((3, 2.5), (5, -100.0))
    for bad, param in [({"logit_bias": {"16": 1}}, "logit_bias"),
                       ({"logit_bias": {"5": 101}}, "logit_bias"),
                       ({"logit_bias": {"x": 1}}, "logit_bias"),
                       ({"logit_bias": [1]}, "logit_bias"),
                       ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(RequestError, match=param) as e:
            parse_completion({**body, **bad}, ctx)
        assert e.value.param == param, bad


def test_packed_features_round_trip_and_the_engine_honours_them(model, biased):
    """The feature section of the engine's one int32 array comes back bit for bit, and the
    engine (chain K = 2, feature mode compiled on first use) gives `biased`'s requests plain
    decoding's tokens."""
    from mtpjax.engine import runner as runner_mod
    from mtpjax.engine.runner import pack_host, unpack_device
    cfg, params = model
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=32,
                     page_size=4, max_num_seqs=4, warmup=False)
    r = llm.runner
    empty, _ = r.pack(runner_mod.SchedulerOutput([], [], r.K))
    R = empty.kinds.shape[0]
    rows = [SamplingParams(temperature=0.5, min_p=0.25, logit_bias={3: -1.5, 15: 100})] + \
        [None] * (R - 1)
    e = empty.sampling
    batch = empty.replace(sampling=r._sampling(np.float32([0.5] + [0] * (R - 1)), e.top_k,
                                               e.top_p, e.keys, rows))
    T, M = batch.tokens.shape[0], batch.block_tables.shape[1]
    got = jax.jit(lambda f: unpack_device(f, num_tokens=T, num_rows=R, max_blocks=M,
                                          sampling_mode=batch.sampling.mode))(pack_host(batch))
    for name in ("temperature", "min_p", "bias_ids", "bias_vals"):
        np.testing.assert_array_equal(getattr(got.sampling, name),
                                      getattr(batch.sampling, name), err_msg=name)
    prompts, sps, want, _ = biased
    assert [o.token_ids for o in llm.generate(prompts, sps)] == want


@pytest.mark.parametrize("method,K", [("chain", 3), ("multi_layer", 2)])
def test_engine_features_equal_plain_decoding_through_preemption(model, method, K):
    """In the engine, with a page pool small enough that requests are preempted and recomputed:
    greedy logit_bias rows give plain decoding's tokens, and seeded min_p / logit_bias rows under
    coupled acceptance (which commits the target's own seeded sample) give plain seeded
    sampling's tokens, over random prompts."""
    cfg, params = model
    rng = np.random.default_rng(K)
    prompts = [[int(t) for t in rng.integers(0, 16, rng.integers(2, 7))] for _ in range(5)]
    sps = [SamplingParams(max_tokens=12, logit_bias={int(rng.integers(16)): 3.0}),
           SamplingParams(max_tokens=12, logit_bias={int(rng.integers(16)): -100.0}),
           SamplingParams(max_tokens=12),
           SamplingParams(max_tokens=12, temperature=1.0, min_p=0.2, seed=11),
           SamplingParams(max_tokens=12, temperature=0.7, min_p=0.1, seed=12,
                          logit_bias={int(rng.integers(16)): 2.0})]

    def run(spec, num_pages):
        # min_token_bucket = the token budget: one T = 16 program per mode (fewer compiles)
        llm = mtpjax.LLM(params, cfg, spec, num_pages=num_pages, page_size=4, max_num_seqs=4,
                         max_num_batched_tokens=16, min_token_bucket=16, warmup=False)
        return [o.token_ids for o in llm.generate(prompts, sps)], llm.num_preemptions

    ref, _ = run(None, 64)
    got, preemptions = run(SpecConfig(num_speculative_tokens=K, method=method,
                                      acceptance="coupled"), 12)
    assert preemptions > 0
    assert got == ref, (method, K)
