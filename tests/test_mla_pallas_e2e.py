"""End to end on an MLA (DeepSeek-style, MLA + MoE) model: the Pallas MLA kernel (interpret mode
on CPU) gives the reference's tokens through `generate` (uniform decode / verify batches) and the
engine (ragged batches: chunked prefill rows next to verify rows)."""

import jax
import numpy as np

import mtpjax
from mtpjax import ModelConfig, SamplingParams, SpecConfig

# test_deepseek's tiny DeepSeek-V3 shape with one target layer and one MTP module (small
# interpreted-kernel compiles); rope 8 is fine interpreted (the compiled kernel needs >= 16).
CFG = ModelConfig(model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=1, num_heads=4, num_kv_heads=4, attention_kind="mla",
                  q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                  v_head_dim=12, rope_interleave=True, ffn_kind="moe", n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                  first_k_dense_replace=0, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, num_mtp_layers=1)


def _ds_params(cfg, seed):
    return mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def _prompts(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, int(t)).tolist() for t in rng.integers(4, 14, n)]


def test_generate_mla_kernel_matches_reference():
    params = _ds_params(CFG, 5)
    prompts = _prompts(50, 2)
    kw = dict(max_new_tokens=4, page_size=8, spec=SpecConfig(num_speculative_tokens=1))
    ref = mtpjax.generate(params, CFG, prompts, attention_impl="reference", **kw)
    got = mtpjax.generate(params, CFG, prompts, attention_impl="pallas_interpret", **kw)
    assert got.tokens == ref.tokens


def test_engine_mla_kernel_matches_reference():
    params = _ds_params(CFG, 6)
    prompts = _prompts(51, 3)
    want = mtpjax.generate(params, CFG, prompts, max_new_tokens=5,
                           attention_impl="reference").tokens
    llm = mtpjax.LLM(params, CFG, SpecConfig(num_speculative_tokens=2), num_pages=24,
                     page_size=8, max_num_seqs=3, max_num_batched_tokens=8,
                     attention_impl="pallas_interpret", warmup=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == want
