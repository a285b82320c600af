"""End to end: the Pallas attention path (interpret mode on CPU) gives the reference's tokens."""

import jax
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig

pytest.importorskip("jax.experimental.pallas")


def _model():
    # head_dim 64 and page size 8: shapes the kernels support
    cfg = mtpjax.ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=64, num_mtp_layers=1)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(0), std=0.3)


def test_generate_pallas_interpret_matches_reference():
    cfg, params = _model()
    prompts = [[1, 2, 3, 4, 5], [9, 8]]
    spec = SpecConfig(num_speculative_tokens=2)
    kw = dict(max_new_tokens=4, page_size=8, spec=spec)
    ref = mtpjax.generate(params, cfg, prompts, attention_impl="reference", **kw)
    got = mtpjax.generate(params, cfg, prompts, attention_impl="pallas_interpret", **kw)
    assert got.tokens == ref.tokens


def test_engine_pallas_interpret_matches_reference():
    cfg, params = _model()
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [9, 8]]
    want = mtpjax.generate(params, cfg, prompts, max_new_tokens=4,
                           attention_impl="reference").tokens
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=16,
                     page_size=8, max_num_seqs=2, max_num_batched_tokens=8,
                     attention_impl="pallas_interpret")
    outs = llm.generate(prompts, SamplingParams(max_tokens=4))
    assert [o.token_ids for o in outs] == want
