"""Draft vocabulary subset (FR-Spec): drafts come from N ids, output stays exactly the target's."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.sampling import SamplingArrays
from mtpjax.speculative.draft import draw_draft
from mtpjax.speculative.draft_vocab import (attach, frequent_token_ids, load_ranked_ids,
                                            resolve_ids)
from tests.conftest import tiny_config
from tests.model.test_no_weight_copies import capture_and_compile

gen = importlib.import_module("mtpjax.generate")


def _model(V, D, seed):
    cfg = tiny_config(vocab_size=V, num_mtp_layers=D)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def test_frequent_token_ids_rank_by_count_then_id():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, size=n) for n in (30, 200, 1)]
    ranked = frequent_token_ids(docs, 64, always=(63,))
    counts = np.bincount(np.concatenate(docs), minlength=64)
    assert ranked[0] == 63 and sorted(ranked.tolist()) == list(range(64))
    rest = ranked[1:]
    keys = [(-counts[t], t) for t in rest]
    assert keys == sorted(keys)
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        frequent_token_ids([np.array([64])], 64)


def test_bad_subsets_are_refused_with_the_value():
    cfg = tiny_config(vocab_size=32)
    spec = SpecConfig(num_speculative_tokens=2, draft_vocab_size=4)
    with pytest.raises(ValueError, match="draft_vocab_size must be a positive int, got 0"):
        SpecConfig(draft_vocab_size=0)
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        SpecConfig(draft_vocab_size=33).check_model(cfg)
    with pytest.raises(ValueError, match="needs the subset's token ids"):
        resolve_ids(cfg, spec, None)
    with pytest.raises(ValueError, match="has 3 ids"):
        resolve_ids(cfg, spec, [1, 2, 3])
    with pytest.raises(ValueError, match=r"in \[0, 32\), got \[1, 40\]"):
        resolve_ids(cfg, spec, [1, 2, 3, 40])
    with pytest.raises(ValueError, match="distinct"):
        resolve_ids(cfg, spec, [1, 2, 2, 3])
    with pytest.raises(ValueError, match="1-D array of int"):
        resolve_ids(cfg, spec, [[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="no draft_vocab_size"):
        resolve_ids(cfg, SpecConfig(), [1, 2])
    assert resolve_ids(cfg, spec, np.arange(32)[::-1]).tolist() == [31, 30, 29, 28]  # ranked
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="has 3 ids"):       # LLM refuses before building
        mtpjax.LLM(params, cfg, spec, num_pages=8, draft_vocab=[1, 2, 3])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_draws_stay_in_the_subset_with_q_zero_outside(seed):
    V, N, B = 40, 7, 64
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.choice(V, N, replace=False), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(B, N)) * 2, jnp.float32)
    sps = [SamplingParams(temperature=0.0) if i % 4 == 0 else
           SamplingParams(temperature=0.9, top_k=3 if i % 3 else 0, top_p=0.8 if i % 5 else 1.0)
           for i in range(B)]
    sp = SamplingArrays.build(sps, seed)
    tok, q = draw_draft(logits, sp, jnp.arange(B), source="model", vocab_ids=ids, vocab_size=V)
    tok, q = np.asarray(tok), np.asarray(q)
    outside = np.setdiff1d(np.arange(V), np.asarray(ids))
    assert np.isin(tok, np.asarray(ids)).all()
    assert (q[:, outside] == 0).all() and np.allclose(q.sum(-1), 1, atol=1e-5)
    assert (q[np.arange(B), tok] > 0).all()
    greedy = np.arange(B) % 4 == 0
    assert (tok[greedy] == np.asarray(ids)[np.argmax(np.asarray(logits), -1)][greedy]).all()


@pytest.mark.parametrize("method,K,D,seed", [("chain", 3, 1, 0), ("multi_layer", 2, 2, 2)])
def test_greedy_tokens_equal_plain_in_generate_and_engine(method, K, D, seed):
    V = 48
    cfg, params = _model(V, D, seed)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, V, size=n).tolist() for n in (6, 2, 9)]
    ids = rng.choice(V, 12, replace=False)
    spec = SpecConfig(num_speculative_tokens=K, method=method, draft_vocab_size=12)
    plain = mtpjax.generate(params, cfg, prompts, max_new_tokens=14).tokens
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=14, spec=spec, draft_vocab=ids)
    assert out.tokens == plain
    # min_token_bucket=32 (the 17-token prefill's): every step runs one program
    llm = mtpjax.LLM(params, cfg, spec, num_pages=64, page_size=4, draft_vocab=ids,
                     min_token_bucket=32)
    got = llm.generate(prompts, SamplingParams(max_tokens=14))
    assert [o.token_ids for o in got] == plain


def test_whole_vocabulary_as_subset_changes_nothing():
    """N = V with ids 0..V-1: tokens and every statistic equal the full-vocabulary drafts
    (sampled, rejection; one request greedy)."""
    V = 24
    cfg, params = _model(V, 1, 5)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    sps = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7)]
    runs = [mtpjax.generate(params, cfg, prompts, max_new_tokens=16, sampling=sps, seed=3,
                            spec=SpecConfig(num_speculative_tokens=3, draft_vocab_size=n),
                            draft_vocab=None if n is None else np.arange(V))
            for n in (None, V)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats == runs[1].stats
    assert runs[0].stats["accepted_draft_tokens"] > 0


def test_sampled_subset_drafts_keep_the_target_distribution():
    """First two tokens' joint law with drafts from 3 of 8 ids == the target's (chi-square)."""
    import functools
    from mtpjax.sampling import filtered_probs
    from tests.speculative.test_accept import chi2_pvalue
    V = 8
    cfg, params = _model(V, 1, 21)
    prompt = [1, 2, 3]
    spec = SpecConfig(num_speculative_tokens=2, draft_vocab_size=3)
    sp = SamplingParams(temperature=1.0)
    runs = [mtpjax.generate(params, cfg, [prompt] * 500, max_new_tokens=2, spec=spec,
                            sampling=sp, seed=11 + c, draft_vocab=[2, 5, 7]) for c in range(5)]
    toks = np.concatenate([np.asarray(r.tokens) for r in runs])
    assert sum(r.stats["accepted_draft_tokens"] for r in runs) > 100     # drafts do get kept
    t1 = np.repeat(np.arange(V), V)
    seqs = np.concatenate([np.tile(prompt, (V * V, 1)), t1[:, None]], 1)
    logits = mtpjax.forward(params, cfg, jnp.asarray(seqs))                 # [V*V, 4, V]
    f = functools.partial(filtered_probs, temperature=jnp.ones((V * V,)),
                          top_k=jnp.zeros((V * V,), jnp.int32), top_p=jnp.ones((V * V,)))
    p1 = np.asarray(f(logits[:, 2]))[0]
    p2 = np.asarray(f(logits[:, 3])).reshape(V, V, V)[:, 0]
    joint = (p1[:, None] * p2).reshape(-1)
    counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert chi2_pvalue(counts, joint) > 1e-3


def test_coupled_seeded_sampling_equals_plain_with_a_subset():
    V = 32
    cfg, params = _model(V, 1, 8)
    prompts = [[3, 1, 4], [1, 5], [9, 2, 6, 5]]
    sps = [SamplingParams(temperature=0.8, seed=100 + i) for i in range(3)]
    plain = mtpjax.generate(params, cfg, prompts, max_new_tokens=16, sampling=sps).tokens
    spec = SpecConfig(num_speculative_tokens=3, acceptance="coupled", draft_vocab_size=10)
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=16, sampling=sps, spec=spec,
                          draft_vocab=np.arange(10) * 3)
    assert out.tokens == plain


_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* dot\(")


def _vocab_wide_dots(hlo: str, V: int) -> int:
    return sum(1 for ln in hlo.splitlines()
               if (m := _DOT.match(ln)) and m.group(1) and int(m.group(1).split(",")[-1]) == V)


def test_step_reads_only_the_subset_head_when_drafting(monkeypatch):
    """Guard: with a subset, the compiled decode loop keeps one vocabulary-wide matmul (the
    target's verify logits); without, every draft pass adds its own."""
    V = 200
    cfg, params = _model(V, 1, 0)
    counts = {}
    for n in (None, 40):
        spec = SpecConfig(num_speculative_tokens=3, draft_vocab_size=n)
        hlo = capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
            params, cfg, [[1, 2, 3]], max_new_tokens=4, spec=spec,
            draft_vocab=None if n is None else np.arange(n)))
        counts[n] = _vocab_wide_dots(hlo, V)
    assert counts[40] == 1 and counts[None] >= 2, counts


def test_shipped_model_with_its_ranked_subset_accepts_and_stays_lossless():
    """The shipped model's draft_vocab.json through LLM.from_pretrained: 256 of 768 ids, greedy
    tokens == plain decoding while a real share of the drafts is accepted (full vocabulary: ~0.6)."""
    from mtpjax.assets import tiny_model_path, tiny_model_prompts
    ranked = load_ranked_ids(tiny_model_path())
    assert ranked is not None and sorted(ranked.tolist()) == list(range(768))
    kw = dict(dtype=jnp.float32, num_pages=96, max_num_seqs=4)
    llm = mtpjax.LLM.from_pretrained(
        tiny_model_path(), SpecConfig(num_speculative_tokens=2, draft_vocab_size=256), **kw)
    assert np.asarray(llm.runner.params["draft_vocab"]["ids"]).tolist() == ranked[:256].tolist()
    assert attach(llm.runner.params, None)["embed"] is llm.runner.params["embed"]
    # (prompt 1 runs into a "=====" line whose token ranks 557th: no subset below 558 can draft
    # it, and its acceptance falls from 0.65 to 0.08; docs/spec_decoding.md)
    prompts, sp = tiny_model_prompts()[2:6], SamplingParams(max_tokens=24)
    out = llm.generate(prompts, sp)
    plain = mtpjax.LLM.from_pretrained(tiny_model_path(), None, **kw).generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert np.mean([o.acceptance_rate for o in out]) > 0.35      # measured 0.47 (0.53 full)
