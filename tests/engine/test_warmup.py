"""Engine warm-up: the bucket list is exactly what the scheduler can reach, and after warm-up a
mixed workload compiles nothing and gives the tokens of an engine that was not warmed up."""

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine import runner as runner_mod
from mtpjax.engine.warmup import step_buckets
from mtpjax.generate import bucket_size
from tests.conftest import random_params, tiny_config

_COMPILES = []


def _count_compiles(name, seconds, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)

# Counts XLA compiles: a hit in the run's shared persistent cache would hide one.
pytestmark = pytest.mark.own_compilation_cache


def _reachable(max_tokens, max_rows, window, minimum=8, decode_tokens=None):
    """(T, F) of every mix of 1..max_rows rows of q >= 1 tokens, sum(q) <= max_tokens: chunks
    take max(W, q) first-pass entries; decode rows (decode_tokens given: q <= decode_tokens)
    take q. Without decode_tokens a decode row is q = K + 1 <= W, the same as a chunk."""
    out = set()

    def add(q_min, rows, S, first_pass):
        if rows:
            out.add((bucket_size(S, minimum), bucket_size(first_pass, minimum)))
        if rows < max_rows:
            for q in range(q_min, max_tokens - S + 1):
                add(q, rows + 1, S + q, first_pass + max(window, q))
                if decode_tokens and q <= decode_tokens:
                    add(q, rows + 1, S + q, first_pass + q)
    add(1, 0, 0, 0)
    return out


@pytest.mark.parametrize("max_tokens", [3, 8, 9, 16, 20, 33])
@pytest.mark.parametrize("max_rows", [1, 3, 5])
# no spec; chain K=1 and K=3 (ragged decode rows of 1..K+1 tokens); multi_layer K=3
@pytest.mark.parametrize("window,decode_tokens", [(1, None), (2, 2), (4, 4), (6, None)])
@pytest.mark.parametrize("minimum", [8, 1, 2])         # LLM(min_token_bucket=...)
def test_step_buckets_are_exactly_the_reachable_shapes(max_tokens, max_rows, window,
                                                       decode_tokens, minimum):
    assert set(step_buckets(max_tokens, max_rows, window, minimum, decode_tokens)) == \
        _reachable(max_tokens, max_rows, window, minimum, decode_tokens)


def test_no_compilation_after_warmup_and_same_tokens(monkeypatch):
    monkeypatch.setenv("MTPJAX_WARMUP_THREADS", "2")        # the ahead-of-time path too
    cfg = tiny_config(vocab_size=40)                         # a config no other test compiles
    params = random_params(cfg)
    spec = SpecConfig(num_speculative_tokens=1)
    kw = dict(num_pages=40, page_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    rng = np.random.default_rng(0)
    # buckets (8, 8) and (8, 16): a 1-token prompt admitted with a 7-token chunk takes a first
    # pass of 2 + 7 = 9 entries; a chunked prompt (21 tokens), sampling and greedy requests
    prompts = [[5], rng.integers(0, 40, 7).tolist(), rng.integers(0, 40, 21).tolist(), [7],
               rng.integers(0, 40, 3).tolist(), [1, 2]]
    sps = [SamplingParams(max_tokens=int(m), temperature=t, seed=i)
           for i, (m, t) in enumerate(zip([3, 9, 6, 4, 7, 5], [0, 0.8, 0, 1.0, 0, 0]))]

    llm = mtpjax.LLM(params, cfg, spec, warmup=True, **kw)
    buckets = set(step_buckets(8, 2, llm.runner.W))
    assert [(T, F) for T, F, _ in llm.warmup_times] == sorted(buckets)
    used = set()
    pack = llm.runner.pack

    def spy(out, num_drafts=None):
        batch, F = pack(out, num_drafts)
        used.add((batch.tokens.shape[0], F))
        return batch, F
    llm.runner.pack = spy
    before, size = len(_COMPILES), runner_mod._step._cache_size()
    outs = llm.generate(prompts, sps)
    assert len(_COMPILES) == before, "a step compiled after warm-up"
    assert runner_mod._step._cache_size() == size
    assert used == buckets == {(8, 8), (8, 16)}, used

    cold = mtpjax.LLM(params, cfg, spec, warmup=False, **kw)
    assert [o.token_ids for o in cold.generate(prompts, sps)] == [o.token_ids for o in outs]


def test_min_token_bucket_one_runs_batch_one_unpadded_with_the_same_tokens():
    """LLM(min_token_bucket=1): a batch-1 decode step is T = 1 (plain) or K + 1 = 2 (MTP K=1)
    tokens, not 8, and the tokens equal the default engine's; a value that is not a power of
    two is refused by name."""
    cfg = tiny_config(vocab_size=48)
    params = random_params(cfg, seed=3)
    kw = dict(num_pages=40, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
              warmup=False)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 48, 5).tolist(), rng.integers(0, 48, 11).tolist()]
    sp = SamplingParams(max_tokens=7)
    for spec, decode_T in ((None, 1), (SpecConfig(num_speculative_tokens=1), 2)):
        want = [o.token_ids for o in mtpjax.LLM(params, cfg, spec, **kw).generate(prompts, sp)]
        llm = mtpjax.LLM(params, cfg, spec, min_token_bucket=1, **kw)
        shapes = []
        pack = llm.runner.pack

        def spy(out, num_drafts=None):
            batch, F = pack(out, num_drafts)
            shapes.append((len(out.requests), batch.tokens.shape[0], F))
            return batch, F
        llm.runner.pack = spy
        got = [llm.generate([p], sp)[0].token_ids for p in prompts]     # batch 1 each
        assert got == want, spec
        decodes = {(T, F) for n, T, F in shapes if T < 8}
        assert (decode_T, decode_T) in decodes, (spec, shapes)
    with pytest.raises(ValueError, match="min_token_bucket must be a power of two, got "
                                         "min_token_bucket=3"):
        mtpjax.LLM(params, cfg, min_token_bucket=3, **kw)
    with pytest.raises(ValueError, match="min_token_bucket must be an int >= 1"):
        mtpjax.LLM(params, cfg, min_token_bucket=0, **kw)


def test_default_min_token_bucket_is_one_for_moe_models_and_eight_for_dense_ones():
    """LLM(min_token_bucket=None): MoE models get 1 (a padded token runs the experts), dense
    ones 8 (fewer programs); a value given is kept either way."""
    import dataclasses

    from mtpjax.config import ModelConfig
    from mtpjax.generate import default_min_token_bucket
    dense = tiny_config(vocab_size=48)
    moe = ModelConfig(model_type="deepseek_v3", vocab_size=48, hidden_size=32,
                      intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                      attention_kind="mla",
                      mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                               qk_rope_head_dim=8, v_head_dim=12),
                      ffn_kind="moe",
                      moe=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                               moe_intermediate_size=16, first_k_dense_replace=1, n_group=4,
                               topk_group=2),
                      num_mtp_layers=1)
    assert default_min_token_bucket(dense) == 8
    assert default_min_token_bucket(moe) == 1
    assert default_min_token_bucket(dataclasses.replace(moe, ffn_kind="dense", moe=None)) == 8
    kw = dict(num_pages=40, page_size=4, max_num_seqs=2, max_num_batched_tokens=8,
              warmup=False)
    for cfg, want in ((dense, 8), (moe, 1)):
        params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), std=0.02)
        assert mtpjax.LLM(params, cfg, **kw).runner.min_bucket == want, cfg.ffn_kind
        assert mtpjax.LLM(params, cfg, min_token_bucket=4, **kw).runner.min_bucket == 4
