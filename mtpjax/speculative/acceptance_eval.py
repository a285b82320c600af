"""Acceptance of a model's MTP drafts on a set of prompts: `mtpjax.eval_acceptance`.

Runs `mtpjax.generate` (speculative, the compiled on-device loop) once per temperature and reads
its statistics (`speculative/metrics.py: SpecStats`). Vocabulary (docs/spec_decoding.md):
acceptance rate = accepted drafts / proposed drafts; mean acceptance length = committed tokens /
verify steps (bonus token included, 1..K+1); per-position acceptance[i] = P(draft i+1 accepted)
per verify step; the histogram counts verify steps by tokens committed (index n = n tokens; 0
unused).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from mtpjax.config import ModelConfig, SamplingParams, SpecConfig


@dataclasses.dataclass(frozen=True)
class AcceptanceResult:
    method: str                                  # "chain" | "multi_layer"
    num_speculative_tokens: int                  # K
    temperature: float                           # 0.0 = greedy
    verify_steps: int
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    acceptance_rate: float
    mean_acceptance_length: float
    per_position_acceptance: tuple[float, ...]   # [K]
    num_accepted_histogram: tuple[int, ...]      # [K + 2]
    generated_tokens: int


def _token_prompts(prompts, tokenizer) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompt {i} is text; pass tokenizer= (anything with "
                                 "encode(str) -> ids) or token-id lists")
            p = tokenizer.encode(p)
        out.append(list(p))
    return out


def eval_acceptance(params, cfg: ModelConfig, spec: SpecConfig, prompts: Sequence, *,
                    max_new_tokens: int = 64, temperatures: Sequence[float] = (0.0, 1.0),
                    seed: int = 0, tokenizer=None, top_k: int = 0, top_p: float = 1.0,
                    truncate_prompts: bool = True, **generate_kwargs) -> dict[float, AcceptanceResult]:
    """Speculative generation over `prompts` at each temperature -> {temperature: result}.

    prompts: token-id lists, or strings with `tokenizer=`. temperatures: 0.0 is greedy
    (acceptance = exact match with the target's argmax); > 0 samples with `spec.acceptance`'s
    rule (rejection sampling by default), seeded by `seed`. truncate_prompts: keep each
    prompt's last `max_position_embeddings - max_new_tokens` tokens, so prompt and completion
    stay within the context the model was trained on. generate_kwargs go to
    `mtpjax.generate` (page_size, attention_impl, mesh, ...).
    """
    from mtpjax.generate import generate
    if not isinstance(spec, SpecConfig):
        raise ValueError(f"spec must be a SpecConfig, got {type(spec).__name__}")
    temps = tuple(float(t) for t in temperatures)
    if not temps or any(t < 0 for t in temps):
        raise ValueError(f"temperatures must be a non-empty list of numbers >= 0, got {temperatures!r}")
    ids = _token_prompts(prompts, tokenizer)
    if truncate_prompts:
        keep = cfg.max_position_embeddings - max_new_tokens
        if keep < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        ids = [p[-keep:] for p in ids]
    out = {}
    for t in temps:
        sp = SamplingParams(temperature=t, top_k=top_k if t > 0 else 0,
                            top_p=top_p if t > 0 else 1.0)
        stats = generate(params, cfg, ids, max_new_tokens=max_new_tokens, sampling=sp, spec=spec,
                         seed=seed, **generate_kwargs).stats
        out[t] = AcceptanceResult(
            method=spec.method, num_speculative_tokens=spec.num_speculative_tokens,
            temperature=t, verify_steps=stats["verify_steps"],
            proposed_draft_tokens=stats["proposed_draft_tokens"],
            accepted_draft_tokens=stats["accepted_draft_tokens"],
            acceptance_rate=stats["acceptance_rate"],
            mean_acceptance_length=stats["mean_acceptance_length"],
            per_position_acceptance=tuple(stats["per_position_acceptance"]),
            num_accepted_histogram=tuple(stats["num_accepted_histogram"]),
            generated_tokens=stats["generated_tokens"])
    return out


def acceptance_table(results: Sequence[AcceptanceResult]) -> str:
    """A markdown table, one row per result."""
    rows = ["| method | K | temperature | acceptance rate | mean acceptance length | "
            "per-position acceptance | committed tokens per verify step (1..K+1) |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.method} | {r.num_speculative_tokens} | "
                    f"{'greedy' if r.temperature == 0 else r.temperature} | "
                    f"{r.acceptance_rate:.3f} | {r.mean_acceptance_length:.2f} | "
                    f"{' '.join(f'{x:.2f}' for x in r.per_position_acceptance)} | "
                    f"{' '.join(str(n) for n in r.num_accepted_histogram[1:])} |")
    return "\n".join(rows)


def main(argv=None):
    """`python -m mtpjax.speculative.acceptance_eval --model FOLDER`: the acceptance table of a
    model folder's MTP modules on its held-out prompts (`prompts.json`), chain at each K and
    multi_layer at each K <= D."""
    import argparse
    import json
    import os

    import jax.numpy as jnp

    from mtpjax.checkpoint import load_pretrained

    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="Hugging Face or Orbax folder with prompts.json")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--methods", nargs="+", choices=["chain", "multi_layer"],
                    default=["chain", "multi_layer"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--prompts", type=int, default=16, help="first N prompts of prompts.json")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ck = load_pretrained(args.model, getattr(jnp, args.dtype))
    with open(os.path.join(args.model, "prompts.json")) as f:
        texts = [p["text"] for p in json.load(f)][:args.prompts]
    rows = []
    for method in args.methods:
        for k in args.k:
            if method == "multi_layer" and k > ck.cfg.num_mtp_layers:
                continue
            res = eval_acceptance(ck.params, ck.cfg, SpecConfig(num_speculative_tokens=k,
                                                                method=method),
                                  texts, tokenizer=ck.tokenizer, temperatures=args.temperatures,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed)
            rows += list(res.values())
            print(acceptance_table(list(res.values())).splitlines()[-1], flush=True)
    print(f"\n{args.model}: {len(texts)} prompts x {args.max_new_tokens} new tokens, "
          f"{args.dtype}\n" + acceptance_table(rows))
    return rows


if __name__ == "__main__":
    main()
