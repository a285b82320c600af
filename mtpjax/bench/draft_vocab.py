"""`python -m mtpjax.bench.draft_vocab`: acceptance lost vs lm_head bytes saved by a draft
vocabulary subset (speculative/draft_vocab.py) on a shipped model's held-out prompts.

For each subset size N (the first N of the folder's draft_vocab.json ranked ids; N = V is the
whole vocabulary) it runs `mtpjax.eval_acceptance` (greedy and sampled at T=1, rejection
sampling) and prints acceptance rate, tokens per verify step, the share of the held-out
prompts' own tokens the subset covers, and the head bytes a draft pass reads.
"""

from __future__ import annotations

import argparse
import json
import os

import jax.numpy as jnp
import numpy as np

from mtpjax.config import SpecConfig
from mtpjax.speculative.acceptance_eval import eval_acceptance


def main(argv=None):
    from mtpjax.assets import SHIPPED, tiny_model_path
    from mtpjax.checkpoint import load_pretrained
    from mtpjax.speculative.draft_vocab import load_ranked_ids
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=SHIPPED[0], help=f"a shipped model {SHIPPED} or a folder")
    ap.add_argument("--sizes", type=int, nargs="+", default=[768, 512, 256, 128, 64])
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--method", default="chain", choices=["chain", "multi_layer"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    args = ap.parse_args(argv)
    path = tiny_model_path(args.model) if args.model in SHIPPED else args.model
    ck = load_pretrained(path, jnp.float32)
    ranked = load_ranked_ids(path)
    if ranked is None:
        raise SystemExit(f"{path} has no draft_vocab.json (python -m "
                         "mtpjax.speculative.draft_vocab --model ...)")
    with open(os.path.join(path, "prompts.json")) as f:
        texts = [p["text"] for p in json.load(f)][:args.prompts]
    prompt_ids = np.concatenate([ck.tokenizer.encode(t) for t in texts])
    E, V = ck.cfg.hidden_size, ck.cfg.vocab_size
    rows = ["| N | head bytes per draft pass (bf16) | prompt tokens covered | T | acceptance rate "
            "| tokens per verify step | per-position acceptance |", "|---|---|---|---|---|---|---|"]
    for n in args.sizes:
        spec = SpecConfig(num_speculative_tokens=args.k, method=args.method,
                          draft_vocab_size=None if n >= V else n)
        res = eval_acceptance(ck.params, ck.cfg, spec, texts, tokenizer=ck.tokenizer,
                              temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                              draft_vocab=None if n >= V else ranked)
        cover = np.isin(prompt_ids, ranked[:n]).mean()
        for t, r in res.items():
            rows.append(f"| {min(n, V)} | {2 * E * min(n, V):,} | {cover:.3f} | "
                        f"{'greedy' if t == 0 else t} | {r.acceptance_rate:.3f} | "
                        f"{r.mean_acceptance_length:.2f} | "
                        f"{' '.join(f'{x:.2f}' for x in r.per_position_acceptance)} |")
            print(rows[-1], flush=True)
    print(f"\n{path}: {args.method} K={args.k}, {len(texts)} prompts x {args.max_new_tokens} "
          "new tokens\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
