"""generate decodes a single request as two rows (generate.py: the second is a padding request
that finishes at prefill). The real request must see no difference: its tokens equal those of
the same request decoded beside other requests and through the engine, sampled tokens follow
its own key, the stats count only it, and an exact `num_pages` still fits."""

import jax
import numpy as np
import pytest

import mtpjax

CFG = mtpjax.ModelConfig(vocab_size=160, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_layers=2)
SPECS = {"plain": None, "chain": mtpjax.SpecConfig(num_speculative_tokens=2),
         "multi_layer": mtpjax.SpecConfig(num_speculative_tokens=2, method="multi_layer")}


def prompts_for(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, CFG.vocab_size, int(m)).tolist() for m in rng.integers(3, 20, n)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", sorted(SPECS))
def test_one_request_equals_itself_in_a_batch_and_the_engine(seed, mode):
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(seed))
    spec = SPECS[mode]
    prompts = prompts_for(seed, 3)
    alone = mtpjax.generate(params, CFG, prompts[:1], max_new_tokens=9, spec=spec)
    batched = mtpjax.generate(params, CFG, prompts, max_new_tokens=9, spec=spec)
    assert alone.tokens == batched.tokens[:1]
    llm = mtpjax.LLM(params, CFG, spec, num_pages=64, page_size=8, max_num_seqs=4,
                     max_num_batched_tokens=64, warmup=False)
    engine = llm.generate(prompts[:1], mtpjax.SamplingParams(max_tokens=9))
    assert alone.tokens == [engine[0].token_ids]
    if spec is None:
        assert alone.stats["generated_tokens"] == len(alone.tokens[0]) == 9
        assert alone.stats["target_forward_passes"] == alone.stats["decode_steps"] + 1
    else:                           # the padding row adds no verify step and no token
        st = alone.stats
        assert st["generated_tokens"] == len(alone.tokens[0]) == 9
        assert st["prefill_tokens"] == 1
        assert st["verify_steps"] == st["draft_steps"]
        assert st["committed_tokens"] == 8
        assert st["proposed_draft_tokens"] == 2 * st["verify_steps"]

@pytest.mark.parametrize("seed", [3, 4, 5])
def test_sampled_request_follows_its_own_key(seed):
    """Row 0 keeps the key of request 0 (fold_in(seed, 0)): its sampled tokens equal the same
    request's in a batch, where row 0 has that key too."""
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(seed))
    prompts = prompts_for(seed, 2)
    sp = mtpjax.SamplingParams(temperature=1.0, top_p=0.9)
    alone = mtpjax.generate(params, CFG, prompts[:1], max_new_tokens=8, sampling=sp, seed=seed)
    batched = mtpjax.generate(params, CFG, prompts, max_new_tokens=8, sampling=sp, seed=seed)
    assert alone.tokens == batched.tokens[:1]


def test_exact_num_pages_still_fits():
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    prompt = list(range(1, 13))                         # 12 tokens + 4 new = 16 = 2 pages of 8
    out = mtpjax.generate(params, CFG, [prompt], max_new_tokens=4, page_size=8, num_pages=2)
    assert len(out.tokens[0]) == 4
    with pytest.raises(ValueError, match="num_pages=1"):
        mtpjax.generate(params, CFG, [prompt], max_new_tokens=4, page_size=8, num_pages=1)
