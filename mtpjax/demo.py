"""`python -m mtpjax.demo`: speculative decoding on a small random model, with statistics.

Random weights make the MTP drafts nearly useless, so the demo runs two passes: greedy
speculative decoding checked token for token against autoregressive decoding (the lossless
guarantee), and the benchmark-only synthetic acceptance to show the statistics a trained
model's acceptance would produce.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import mtpjax


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--method", choices=["chain", "multi_layer"], default="chain")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    K = args.num_speculative_tokens
    D = K if args.method == "multi_layer" else 1
    cfg = mtpjax.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                             num_heads=4, num_kv_heads=2, head_dim=64, num_mtp_layers=D)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(args.seed), std=0.05)
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(0, cfg.vocab_size, size=int(n)).tolist()
               for n in rng.integers(4, 48, size=args.num_prompts)]
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=args.method)
    t0 = time.perf_counter()
    ar = mtpjax.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens)
    t1 = time.perf_counter()
    sd = mtpjax.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens, spec=spec)
    t2 = time.perf_counter()
    same = ar.tokens == sd.tokens
    print(f"device: {jax.devices()[0].device_kind}; {len(prompts)} prompts, K={K}, {args.method}")
    print(f"autoregressive: {t1 - t0:.1f}s (incl. compile); speculative: {t2 - t1:.1f}s (incl. compile)")
    print(f"greedy speculative == autoregressive, token for token: {same}")
    syn = mtpjax.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens,
                          spec=mtpjax.SpecConfig(num_speculative_tokens=K, method=args.method,
                                                 acceptance="synthetic",
                                                 synthetic_accept_rate=0.8))
    for name, out in (("model drafts", sd), ("synthetic 0.8 (benchmark-only)", syn)):
        s = out.stats
        print(f"[{name}] acceptance rate {s['acceptance_rate']:.3f}, mean acceptance length "
              f"{s['mean_acceptance_length']:.2f}, per-position "
              f"{[round(x, 3) for x in s['per_position_acceptance']]}, verify steps "
              f"{s['verify_steps']}, histogram {s['num_accepted_histogram']}")
    if not same:
        raise SystemExit("lossless check failed")


if __name__ == "__main__":
    main()
