"""repetition / presence / frequency penalties (SamplingParams): vLLM's definitions, exact under
speculation (the verify window's position j and the drafter's step j count the j drafts before
them as output), per request in batches with requests that use none, through preemption, and
no change to the program of a batch without them (sampling.PENALTY_MODES)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine.penalty_history import sparse_history
from mtpjax.logit_processors import process_logits
from mtpjax.sampling import (FEATURE_MODES, PENALTY_MODES, SAMPLING_MODES, SamplingArrays,
                             feature_arrays, penalty_arrays, sample, sampling_mode)
from tests.conftest import tiny_config
from tests.speculative.test_accept import chi2_pvalue


def np_penalized(logits, prompt, output, sp: SamplingParams):
    """vLLM's definitions, for one row (float64): logit_bias, then repetition (prompt or
    output), frequency and presence (output)."""
    x = np.asarray(logits, np.float64).copy()
    V = len(x)
    for t, b in sp.logit_bias or ():
        x[t] += b
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)
    seen = counts > 0
    seen[np.asarray(prompt, np.int64)] = True
    r = sp.repetition_penalty
    x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    return x - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)


def dense_history(prompt, output, V):
    ids, vals = sparse_history(list(prompt) + list(output), len(prompt))
    row = np.zeros(V, np.int32)
    row[ids] = vals
    return row


def pooled_chi2_pvalue(counts, probs, min_expected=5.0):
    """chi2_pvalue with the cells expected fewer than min_expected times pooled into one: a
    joint law over V**3 cells has many cells of expectation << 1, where one sample alone would
    decide the statistic. A sample in a zero-probability cell still fails outright."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    small = probs * counts.sum() < min_expected
    return chi2_pvalue(np.append(counts[~small], counts[small].sum()),
                       np.append(probs[~small], probs[small].sum()))


def np_probs(x, temperature):
    if temperature == 0:
        return np.eye(len(x))[np.argmax(x)]
    p = np.exp(x / temperature - np.max(x / temperature))
    return p / p.sum()


# ---- semantics ---------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_match_vllm_with_drafts_counted(seed):
    """Verify window ([B, K+1, V]: position j counts drafts 0..j-1), one draft step ([B, V],
    num_drafted), and a draft-vocabulary subset, against the numpy reference on random logits,
    histories and drafts (a small vocabulary: drafts repeat each other and the history)."""
    rng = np.random.default_rng(seed)
    B, K, V = 6, 3, 12
    logits = (rng.normal(size=(B, K + 1, V)) * 3).astype(np.float32)
    prompts = [rng.integers(0, V, rng.integers(1, 8)) for _ in range(B)]
    outputs = [rng.integers(0, V, rng.integers(0, 10)) for _ in range(B)]
    drafts = rng.integers(0, V, (B, K)).astype(np.int32)
    sps = [SamplingParams(repetition_penalty=float(rng.choice([0.5, 1.0, 1.7])),
                          presence_penalty=float(rng.uniform(-2, 2)),
                          frequency_penalty=float(rng.uniform(-2, 2)),
                          logit_bias={int(rng.integers(V)): 2.5} if b % 2 else None)
           for b in range(B - 1)] + [SamplingParams(temperature=1.0)]      # last: penalties off
    sp = SamplingArrays.build(sps)
    assert sp.mode == "filter_penalty"
    hist = np.stack([dense_history(prompts[b], outputs[b], V) for b in range(B)])
    sp = sp.replace(history=jnp.asarray(hist))
    run = jax.jit(process_logits, static_argnames=())
    got = np.asarray(run(jnp.asarray(logits), sp, drafts=jnp.asarray(drafts)))
    for b in range(B):
        for j in range(K + 1):
            want = np_penalized(logits[b, j], prompts[b],
                                np.concatenate([outputs[b], drafts[b, :j]]), sps[b])
            np.testing.assert_allclose(got[b, j], want, rtol=1e-5, atol=1e-5, err_msg=(b, j))
    # penalties off: not a bit changes
    np.testing.assert_array_equal(got[-1], logits[-1])
    ids = jnp.asarray(rng.permutation(V)[:7])
    for i in range(K + 1):
        step = np.asarray(run(jnp.asarray(logits[:, i]), sp, drafts=jnp.asarray(drafts),
                              num_drafted=jnp.int32(i)))
        np.testing.assert_allclose(step, got[:, i], rtol=1e-6, atol=1e-6)
        sub = np.asarray(run(jnp.asarray(logits[:, i])[:, ids], sp, drafts=jnp.asarray(drafts),
                             num_drafted=i, vocab_ids=ids))
        np.testing.assert_allclose(sub, got[:, i][:, np.asarray(ids)], rtol=1e-6, atol=1e-6)


def test_sparse_history_encodes_counts_and_prompt():
    ids, vals = sparse_history([3, 3, 5, 1, 3, 7, 7], 3)          # prompt 3 3 5, output 1 3 7 7
    got = dict(zip(ids.tolist(), vals.tolist()))
    from mtpjax.logit_processors import PROMPT_FLAG
    assert got == {1: 1, 3: 1 | PROMPT_FLAG, 5: PROMPT_FLAG, 7: 2}


# ---- lossless under speculation, end to end ----------------------------------------------------

@pytest.fixture(scope="module")
def model():
    cfg = tiny_config(vocab_size=16, num_mtp_layers=2)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(3), std=0.3)


def _requests(seed):
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, 16, rng.integers(2, 7))] for _ in range(5)]
    sps = [SamplingParams(max_tokens=10, repetition_penalty=1.8, logprobs=2),
           SamplingParams(max_tokens=10, presence_penalty=1.5, frequency_penalty=0.5, logprobs=2),
           SamplingParams(max_tokens=10),                                    # none
           SamplingParams(max_tokens=10, frequency_penalty=2.0, logit_bias={4: 1.0}),
           SamplingParams(max_tokens=10, repetition_penalty=0.6, presence_penalty=-1.0)]
    return prompts, sps


def _llm(model, spec, **kw):
    cfg, params = model
    # min_token_bucket = the token budget: every step runs a T = 16 program (fewer compiles)
    kw = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
              min_token_bucket=16, max_logprobs=2, warmup=False) | kw
    return mtpjax.LLM(params, cfg, spec, **kw)


@pytest.fixture(scope="module")
def plain(model):
    """Plain (non-speculative) greedy decoding of random requests, which the penalties change."""
    llm = _llm(model, None)
    prompts, sps = _requests(0)
    outs = llm.generate(prompts, sps)
    free = [o.token_ids for o in llm.generate(prompts, [SamplingParams(max_tokens=10)] * 5)]
    assert sum(a != b for a, b in zip(free, [o.token_ids for o in outs])) >= 3
    return outs


@pytest.mark.parametrize("method,K", [("chain", 1), ("chain", 3), ("multi_layer", 2)])
def test_greedy_penalties_equal_plain_decoding_with_preemption(model, plain, method, K):
    """Speculative greedy tokens == plain greedy tokens, with penalties that change the output,
    in a page pool small enough that requests are preempted and recomputed; the reported
    logprobs (the penalized distribution, drafts before each position counted) agree too."""
    llm = _llm(model, SpecConfig(num_speculative_tokens=K, method=method), num_pages=12)
    outs = llm.generate(*_requests(0))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain], (method, K)
    assert llm.num_preemptions > 0
    for got, want in zip(outs[:2], plain[:2]):
        assert [sorted(d) for d in got.logprobs] == [sorted(d) for d in want.logprobs]
        np.testing.assert_allclose([v for d in got.logprobs for _, v in sorted(d.items())],
                                   [v for d in want.logprobs for _, v in sorted(d.items())],
                                   atol=1e-4)


def test_rows_without_penalties_are_unchanged_by_the_batch(model):
    """In a batch with penalty rows, a greedy and a seeded sampled row without penalties give
    exactly the tokens they give in a batch without penalties."""
    llm = _llm(model, SpecConfig(num_speculative_tokens=2))
    prompts, sps = _requests(2)
    free = [SamplingParams(max_tokens=10), SamplingParams(temperature=1.0, seed=5, max_tokens=10)]
    alone = [o.token_ids for o in llm.generate(prompts[:2], free)]
    mixed = [o.token_ids for o in llm.generate(prompts[:2] + prompts,
                                               free + [sps[0], sps[1], sps[3]] + sps[:2])]
    assert mixed[:2] == alone


def test_coupled_acceptance_gives_plain_seeded_tokens_with_penalties(model):
    """Coupled acceptance commits the target's own seeded sample at every position, so with
    penalties (drafts counted) a sampled request's tokens equal plain seeded sampling's."""
    prompts, _ = _requests(3)
    sps = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, repetition_penalty=1.6,
                          presence_penalty=0.8, frequency_penalty=0.6) for s in range(5)]
    ref = [o.token_ids for o in _llm(model, None).generate(prompts, sps)]
    llm = _llm(model, SpecConfig(num_speculative_tokens=3, acceptance="coupled"))
    outs = llm.generate(prompts, sps)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.num_accepted_draft_tokens for o in outs) > 0


def test_sampled_penalties_follow_plain_decodings_law_under_speculation():
    """Joint law of the first three tokens of speculative decoding (chain, K = 2: the second
    verify position and the drafter's second step count the first draft) == the exact law of
    the penalized target (numpy reference): chi-square."""
    V = 6
    cfg = tiny_config(vocab_size=V, num_mtp_layers=1)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(21), std=0.3)
    prompt = [1, 2, 2]
    sp = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.8,
                        repetition_penalty=1.5, max_tokens=3)
    # 600 draws keep the power: a verify window that counts one draft too few (its drafts'
    # penalties off by one position) fails at p ~ 5e-5, and in a numpy check every joint of a
    # history missing a token (position 2 or 3 not counting one before it) failed 300 of 300
    # times, and draws of the law itself none
    n = 600
    # max_model_len: 3 + 3 tokens; a row's block table spans it (not the model's 4096
    # positions), which keeps the reference attention of 150-row steps small
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=1024,
                     page_size=4, max_num_seqs=150, max_num_batched_tokens=1024, warmup=False,
                     seed=11, max_model_len=8)
    outs = llm.generate([prompt] * n, sp)
    toks = np.asarray([o.token_ids for o in outs])
    assert np.mean([o.acceptance_rate for o in outs]) > 0.2     # drafts were verified
    seqs = np.asarray([prompt + [a, b] for a in range(V) for b in range(V)])
    logits = np.asarray(mtpjax.forward(params, cfg, jnp.asarray(seqs)))        # [V*V, 5, V]
    law = lambda lg, out: np_probs(np_penalized(lg, prompt, out, sp), 1.0)      # noqa: E731
    p1 = law(logits[0, 2], [])
    joint = np.zeros((V, V, V))
    for a in range(V):
        p2 = law(logits[a * V, 3], [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * law(logits[a * V + b, 4], [a, b])
    counts = np.bincount((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2], minlength=V ** 3)
    assert pooled_chi2_pvalue(counts, joint.reshape(-1)) > 1e-3


# ---- the guard: batches without penalties run the program they ran before ----------------------

def test_penalties_only_in_their_own_modes():
    """A batch without penalties picks the earlier modes, whose step functions trace to the
    same program whether or not penalty arrays and a history are attached (never read); the
    penalty modes hold no device-side branch."""
    from mtpjax.speculative.accept import apply_acceptance
    from mtpjax.speculative.draft import draw_draft
    off = SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    assert not off.has_penalties
    assert sampling_mode(np.float32([0, 1]), [off, SamplingParams(temperature=1.0)]) == "filter"
    assert sampling_mode(np.float32([0]), [SamplingParams(presence_penalty=0.1)]) == \
        "greedy_penalty"
    assert sampling_mode(np.float32([0, 1]), [SamplingParams(repetition_penalty=1.1), None]) \
        == "filter_penalty"
    B, K, V = 3, 2, 16
    logits = jnp.zeros((B, K + 1, V))
    drafts, q = jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K, V))
    spec = SpecConfig(num_speculative_tokens=K)
    rows = [SamplingParams(min_p=0.5, logit_bias={1: 2.0}, repetition_penalty=1.3)] * B
    feats = dict(zip(("min_p", "bias_ids", "bias_vals"), map(jnp.asarray, feature_arrays(rows))))
    pens = dict(zip(("repetition_penalty", "presence_penalty", "frequency_penalty"),
                    map(jnp.asarray, penalty_arrays(rows))), history=jnp.ones((B, V), jnp.int32))

    def programs(sp, text=True):
        fns = [lambda: sample(logits[:, 0], sp, jnp.zeros((B,), jnp.int32)),
               lambda: apply_acceptance(spec, logits, drafts, q, jnp.full((B,), K, jnp.int32),
                                        jnp.zeros((B,), bool), sp, jnp.zeros((B,), jnp.int32)),
               lambda: draw_draft(logits[:, 0], sp, jnp.zeros((B,), jnp.int32),
                                  source="model", drafts=drafts, num_drafted=1)]
        return [str(jax.make_jaxpr(f)()) if text else jax.make_jaxpr(f)().jaxpr for f in fns]

    base = SamplingArrays(temperature=jnp.ones((B,)), top_k=jnp.zeros((B,), jnp.int32),
                          top_p=jnp.ones((B,)), keys=jnp.zeros((B, 2), jnp.uint32))
    for mode in SAMPLING_MODES:
        assert programs(base.replace(mode=mode)) == programs(base.replace(mode=mode, **feats,
                                                                          **pens))
    for mode in set(FEATURE_MODES) - set(PENALTY_MODES):
        assert programs(base.replace(mode=mode, **feats)) == \
            programs(base.replace(mode=mode, **feats, **pens))
    for mode in PENALTY_MODES:
        text = "".join(programs(base.replace(mode=mode, **feats, **pens)))
        assert "scatter" in text and "cond[" not in text, mode
    # an all-greedy penalty batch stays argmax-only: no sort, softmax or draw
    from tests.sampling.test_sampling_fast_path import _primitives
    for jaxpr in programs(base.replace(mode="greedy_penalty", **feats, **pens), text=False):
        assert not _primitives(jaxpr) & {"sort", "exp", "random_bits", "log", "cond"}


def test_engine_step_carries_the_history_only_in_penalty_modes(model):
    """The engine's compiled step of a batch without penalties is the same program before and
    after penalty batches ran (the history is not among its inputs); a penalty batch's step
    has the history and no conditional."""
    from mtpjax.engine import runner as runner_mod
    from mtpjax.engine.runner import _step, pack_host
    cfg, params = model
    llm = _llm(model, SpecConfig(num_speculative_tokens=2))
    r = llm.runner

    def hlo(mode, sps, with_history=False):
        empty, F = r.pack(runner_mod.SchedulerOutput([], [], r.K))
        e = empty.sampling
        batch = empty.replace(sampling=r._sampling(e.temperature, e.top_k, e.top_p, e.keys, sps))
        assert batch.sampling.mode == mode
        shape = (batch.tokens.shape[0], batch.kinds.shape[0], batch.block_tables.shape[1])
        state = r.state.replace(history=jnp.zeros((r.num_slots, cfg.vocab_size), jnp.int32)) \
            if with_history else r.state
        return _step.lower(params, cfg, r.spec, state, jnp.asarray(pack_host(batch)),
                           **r._static(F, shape, mode)).as_text()

    R = r.max_num_seqs
    before = hlo("greedy", [None] * R)
    llm.generate(*_requests(0))                      # penalty batches: the history exists now
    assert r.penalties.array is not None
    assert hlo("greedy", [None] * R) == before
    pen = hlo("greedy_penalty", [SamplingParams(frequency_penalty=1.0)] + [None] * (R - 1),
              with_history=True)
    history = f"tensor<{r.num_slots}x{cfg.vocab_size}xi32>"
    signature = lambda text: text[text.index("func.func public @main("):].split("\n")[0]  # noqa
    assert history in signature(pen) and history not in signature(before)
    assert "stablehlo.if" not in pen and "stablehlo.case" not in pen


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0.*=0.0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\].*=2.5"),
    (dict(frequency_penalty=-2.01), r"frequency_penalty must be a number in \[-2, 2\]"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty"),
    (dict(presence_penalty="1"), r"presence_penalty"),
])
def test_sampling_params_refuse_bad_penalties(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_generate_refuses_penalties_by_position(model):
    cfg, params = model
    sps = [SamplingParams(), SamplingParams(presence_penalty=0.5)]
    with pytest.raises(ValueError, match=r"sampling\[1\]: .*presence_penalty=0.5.*mtpjax.generate "
                                         r"does not apply penalties.*mtpjax.LLM"):
        mtpjax.generate(params, cfg, [[1], [2]], max_new_tokens=2, sampling=sps)


def test_server_passes_penalties_and_names_the_field():
    from mtpjax.serve.protocol import RequestError, ServeContext, parse_completion
    ctx = ServeContext(model_name="m", vocab_size=16, num_speculative_tokens=2,
                       acceptance="rejection", max_completion_tokens=lambda n: 32 - n,
                       encode=None)
    body = {"model": "m", "prompt": [1, 2], "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2}
    sp = parse_completion(body, ctx).sampling_params
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    for bad, param in [({"presence_penalty": 3}, "presence_penalty"),
                       ({"frequency_penalty": "x"}, "frequency_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty")]:
        with pytest.raises(RequestError, match=param) as e:
            parse_completion({**body, **bad}, ctx)
        assert e.value.param == param, bad


def test_packed_penalties_round_trip():
    from mtpjax.engine.runner import ModelRunner, pack_host, unpack_device
    from mtpjax.speculative.mixed_step import MixedBatch
    R, T, M, K = 3, 8, 2, 1
    rows = [SamplingParams(repetition_penalty=1.25, presence_penalty=-0.5,
                           frequency_penalty=2.0, logit_bias={3: 1.0}), None, SamplingParams()]
    sp = ModelRunner._sampling(np.zeros(R, np.float32), np.zeros(R, np.int32),
                               np.ones(R, np.float32), np.zeros((R, 2), np.uint32), rows)
    assert sp.mode == "greedy_penalty"
    z = lambda *s: np.zeros(s, np.int32)                                  # noqa: E731
    batch = MixedBatch(tokens=z(T), positions=z(T), seq_ids=z(T), cu_q_lens=z(R + 1),
                       kv_lens=z(R), block_tables=z(R, M), slots=z(R), kinds=z(R),
                       next_tokens=z(R, K + 1), thinking=np.zeros(R, bool), hist_from=z(R),
                       sampling=sp, num_drafts=z(R), want_logprobs=np.zeros(R, bool))
    got = jax.jit(lambda f: unpack_device(f, num_tokens=T, num_rows=R, max_blocks=M,
                                          sampling_mode=sp.mode))(pack_host(batch))
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "bias_ids"):
        np.testing.assert_array_equal(getattr(got.sampling, name), getattr(sp, name), name)
    assert got.sampling.repetition_penalty[0] == 1.25 and got.sampling.presence_penalty[1] == 0
