"""GPU smoke check (not a test): Pallas and reference attention give the same greedy tokens,
through `generate` (uniform batches) and the engine (ragged batches), with float32 params, for a
GQA model (the paged / ragged kernels) and a DeepSeek-style MLA + MoE model (the MLA kernel).

    python -m mtpjax.bench.gpu_check
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax


def main():
    # True float32 matmuls: with GPU's default (TF32) precision the two attention paths round
    # differently and near-ties flip (seen on the H100: one token of 192 with a top-2 logit gap
    # of 0.006), which says nothing about the kernels.
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = mtpjax.ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                             num_layers=4, num_heads=8, num_kv_heads=2, head_dim=128,
                             num_mtp_layers=2)
    mla = mtpjax.ModelConfig(model_type="deepseek_v3", vocab_size=4096, hidden_size=512,
                             intermediate_size=1024, num_layers=3, num_heads=16, num_kv_heads=16,
                             attention_kind="mla", q_lora_rank=128, kv_lora_rank=128,
                             qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                             rope_interleave=True, ffn_kind="moe", n_routed_experts=8,
                             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
                             first_k_dense_replace=1, n_group=4, topk_group=2,
                             routed_scaling_factor=2.5, norm_topk_prob=True, num_mtp_layers=1)
    rows = []
    for name, c in (("gqa", cfg), ("mla", mla)):
        rows += check(name, c)
    print("| model | method | K | generate pallas == reference | engine pallas == reference | of |")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


def check(name, cfg):
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.float32, std=0.05)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(5, 120, 8)]
    rows = []
    for method, K in (("chain", 3),):
        spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=method)
        ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=24, spec=spec,
                              attention_impl="reference").tokens
        pal = mtpjax.generate(params, cfg, prompts, max_new_tokens=24, spec=spec,
                              attention_impl="pallas").tokens
        llm = mtpjax.LLM(params, cfg, spec, num_pages=1024, page_size=16, max_num_seqs=8,
                         max_num_batched_tokens=256, attention_impl="pallas",
                         warmup=False)   # compile only the buckets this check uses
        eng = [o.token_ids for o in llm.generate(prompts, mtpjax.SamplingParams(max_tokens=24))]
        same = lambda a, b: sum(x == y for x, y in zip(a, b))
        rows.append((name, method, K, same(ref, pal), same(ref, eng), len(prompts)))
    return rows


if __name__ == "__main__":
    main()
