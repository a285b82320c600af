"""GPU smoke check (not a test): Pallas and reference attention give the same greedy tokens,
through `generate` (uniform batches) and the engine (ragged batches), with float32 params.

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
        rows.append((method, K, same(ref, pal), same(ref, eng), len(prompts)))
    print("| method | K | generate pallas == reference | engine pallas == reference | of |")
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
