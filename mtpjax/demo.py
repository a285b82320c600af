"""`python -m mtpjax.demo`: MTP speculative decoding on the shipped trained model, with statistics.

Loads the tiny trained code model that ships with mtpjax (`mtpjax.assets.tiny_model_path()`,
a MiMo-style Qwen2 target + 1 MTP module trained on CPython's stdlib, see its README.md) through
`mtpjax.LLM.from_pretrained`, completes held-out Python snippets greedily twice - plain decoding
and speculative decoding with K chained MTP drafts - checks the two agree token for token (the
lossless guarantee), and prints the acceptance statistics, the target forward passes saved, the
wall-clock ratio with compilation excluded (each path runs once to compile, then once timed), the
measured speedup on an H100 (docs/benchmarks.md) and one decoded completion.

`--random` runs the older demo instead: a random-weight model (drafts are almost never accepted)
plus the benchmark-only synthetic acceptance.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import mtpjax

# docs/benchmarks.md, "Plain and MTP, batch 1 and 32" (commit 0819bea; H100, Llama-3-8B shape,
# random bf16 weights, K=3 chain drafts at synthetic acceptance 0.8): the engine rows at batch 1.
# tests/project/test_demo.py checks these against the docs file.
GPU_8B_BATCH1 = {"commit": "0819bea", "plain_ms": 6.16, "plain_tok_s": 162, "mtp_ms": 7.87,
                 "mtp_tokens_per_step": 3.02, "mtp_tok_s": 375}
# docs/benchmarks.md, "Batch 1 over four seeds" (commit 8fa0a18): engine batch 1, mean of four
# seeds, K=3 with and without a 32k-token draft vocabulary (SpecConfig.draft_vocab_size).
GPU_8B_SEEDS = {"commit": "8fa0a18", "plain_tok_s": 160, "mtp_tok_s": 352,
                "draft_vocab_tok_s": 402}


@contextlib.contextmanager
def waiting(text: str):
    """Says on stderr what the program is doing while a person waits (a cold run compiles for
    tens of seconds on a CPU with nothing else on screen): a rich spinner on a terminal, else a
    line; then the step's time."""
    t0 = time.perf_counter()
    console = None
    try:
        from rich.console import Console
        console = Console(stderr=True)
    except ImportError:
        pass
    if console is not None and console.is_terminal:
        with console.status(f"{text} ..."):
            yield
    else:
        print(f"{text} ...", file=sys.stderr, flush=True)
        yield
    print(f"  {text}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)


def acceptance_stats(outputs, step_counts, K: int) -> dict:
    """Statistics over requests. step_counts: per request, the tokens each verify step committed.

    acceptance rate = accepted drafts / proposed drafts; mean acceptance length = committed tokens
    per verify step (bonus included); per-position acceptance[i] = P(draft i+1 accepted), over
    the verify steps that are not a request's last (max_tokens or a stop token may cut the last
    one short, after the engine counted its accepted drafts).
    """
    steps = sum(o.num_verify_steps for o in outputs)
    proposed = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_draft_tokens for o in outputs)
    total = sum(sum(cs) for cs in step_counts)
    if sum(map(len, step_counts)) != steps or total - steps > accepted:
        raise AssertionError(f"streamed verify steps ({sum(map(len, step_counts))} steps, {total} "
                             f"tokens) disagree with the engine's ({steps} steps, {accepted} "
                             "accepted drafts)")
    full = np.asarray([c for cs in step_counts for c in cs[:-1]], np.int64)
    return {
        "verify_steps": steps,
        "proposed_draft_tokens": proposed,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": accepted / max(proposed, 1),
        "mean_acceptance_length": (accepted + steps) / max(steps, 1),
        "per_position_acceptance": [float((full > i).mean()) if len(full) else 0.0
                                    for i in range(1, K + 1)],
        "num_accepted_histogram": np.bincount(full, minlength=K + 2)[:K + 2].tolist(),
    }


def run_llm(llm, prompts, sampling):
    """Generates; returns (outputs in prompt order, per request the tokens of each verify step)."""
    outputs = [None] * len(prompts)
    events = [[] for _ in prompts]
    for ev in llm.generate_stream(prompts, sampling):
        events[ev.request_index].append(len(ev.new_token_ids))
        if ev.finished:
            outputs[ev.request_index] = ev.output
    # the first event of a request carries the token sampled at the end of its prefill
    return outputs, [e[1:] for e in events]


def trained_demo(args) -> None:
    from mtpjax.assets import tiny_model_path, tiny_model_prompts
    path = args.model or tiny_model_path()
    prompts = tiny_model_prompts(path)[:args.num_prompts]
    K = args.num_speculative_tokens
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, method="chain")
    sampling = mtpjax.SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens)
    kw = dict(dtype=jnp.float32, num_pages=256, page_size=16, max_num_seqs=len(prompts),
              max_num_batched_tokens=1024)
    first, times, results = {}, {}, {}
    for name, sp in (("plain", None), ("speculative", spec)):
        # prefix caching off: the timed second run must redo the prompts' prefill like the first
        with waiting(f"{name} decoding: loading the model"):
            llm = mtpjax.LLM.from_pretrained(path, sp, enable_prefix_caching=False, **kw)
        with waiting(f"{name} decoding: first run (compiles its steps)"):
            t0 = time.perf_counter()
            run_llm(llm, prompts, sampling)         # compiles the step buckets this run uses
            first[name] = time.perf_counter() - t0
        with waiting(f"{name} decoding: timed run"):
            t0 = time.perf_counter()
            results[name] = run_llm(llm, prompts, sampling)
            times[name] = time.perf_counter() - t0
    plain, _ = results["plain"]
    spec_out, step_counts = results["speculative"]
    same = [a.token_ids == b.token_ids for a, b in zip(plain, spec_out)]
    s = acceptance_stats(spec_out, step_counts, K)
    n_tok = sum(len(o.token_ids) for o in spec_out)
    # target passes after the prefill: plain decoding runs one per token after the first (which
    # the prefill samples); speculative decoding one verify step per committed run of tokens
    plain_passes = sum(len(o.token_ids) - 1 for o in plain)
    cfg = llm.cfg
    print(f"\nmodel (trained weights; the acceptance below is measured): {path}\n  {cfg.model_type}, {cfg.num_layers} target layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_mtp_layers} MTP module(s); "
          f"device {jax.devices()[0].device_kind}")
    print(f"{len(prompts)} held-out Python prompts, greedy, up to {args.max_new_tokens} new tokens, "
          f"K={K} chained MTP drafts")
    print(f"greedy speculative == plain, token for token: {all(same)} "
          f"({sum(same)}/{len(same)} requests, {n_tok} tokens)")
    print(f"acceptance rate {s['acceptance_rate']:.3f} ({s['accepted_draft_tokens']}/"
          f"{s['proposed_draft_tokens']} drafts)")
    print(f"mean acceptance length {s['mean_acceptance_length']:.2f} tokens per verify step "
          f"(plain decoding: 1.00), {s['verify_steps']} verify steps")
    print(f"per-position acceptance {[round(x, 3) for x in s['per_position_acceptance']]}")
    print(f"verify steps committing 0..K+1 tokens {s['num_accepted_histogram']} (requests' last "
          "steps left out of these two)")
    print(f"target forward passes after the prompts: plain {plain_passes} decode steps, "
          f"speculative {s['verify_steps']} verify steps ({plain_passes / s['verify_steps']:.2f}x "
          "fewer)")
    ratio = times["plain"] / times["speculative"]
    per_step = (times["speculative"] / s["verify_steps"]) / (times["plain"] / plain_passes)
    print(f"wall time, compile excluded (second run of each): plain {times['plain']:.2f}s, "
          f"speculative {times['speculative']:.2f}s: speculative runs at {ratio:.2f}x plain's "
          f"speed on this {jax.devices()[0].platform.upper()} (first runs, with compiles: plain "
          f"{first['plain']:.1f}s, speculative {first['speculative']:.1f}s)")
    print(f"  here a verify step costs {per_step:.2f}x a plain decode step: this tiny model's step "
          f"time grows with the tokens it computes (K+1={K + 1} verify tokens and {K} draft passes "
          "per request); a large model's decode step on a GPU is bound by reading its weights, "
          "which the extra tokens share")
    g = GPU_8B_BATCH1
    print(f"on an H100 (docs/benchmarks.md, Llama-3-8B table, commit {g['commit']}; random weights "
          "with synthetic acceptance 0.8 per draft, a benchmark stand-in for a trained head, not "
          f"this model's acceptance): Llama-3-8B shape, batch 1, engine MTP K=3 {g['mtp_tok_s']} tok/s vs plain {g['plain_tok_s']} "
          f"tok/s = {g['mtp_tok_s'] / g['plain_tok_s']:.2f}x at {g['mtp_tokens_per_step']} tokens "
          f"per verify step (a step {g['mtp_ms'] / g['plain_ms']:.2f}x a plain one)")
    g = GPU_8B_SEEDS
    print(f"  mean of four seeds (commit {g['commit']}, same synthetic acceptance): K=3 "
          f"{g['mtp_tok_s'] / g['plain_tok_s']:.2f}x plain; drafting from the 32k most frequent tokens (draft_vocab_size=32768, output "
          f"unchanged) {g['draft_vocab_tok_s'] / g['plain_tok_s']:.2f}x")
    # greedy decoding of a tiny model often falls into repetition (which drafts predict easily);
    # show the completion with the most distinct tokens
    i = int(np.argmax([len(set(o.token_ids)) for o in spec_out]))
    print(f"\n--- prompt {i} (last lines) ---")
    print("".join(prompts[i].splitlines(keepends=True)[-4:]), end="")
    print(f"--- completion ({len(spec_out[i].token_ids)} tokens, acceptance rate "
          f"{spec_out[i].acceptance_rate:.2f}) ---")
    print(spec_out[i].text)
    print("---")
    if not all(same):
        raise SystemExit("lossless check failed: speculative output differs from plain decoding")


def random_demo(args) -> None:
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
    with waiting("autoregressive decoding (compiles, then runs)"):
        ar = mtpjax.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens)
    t1 = time.perf_counter()
    with waiting("speculative decoding (compiles, then runs)"):
        sd = mtpjax.generate(params, cfg, prompts, max_new_tokens=args.max_new_tokens, spec=spec)
    t2 = time.perf_counter()
    same = ar.tokens == sd.tokens
    print(f"random weights; device: {jax.devices()[0].device_kind}; {len(prompts)} prompts, K={K}, "
          f"{args.method}")
    print(f"autoregressive: {t1 - t0:.1f}s (incl. compile); speculative: {t2 - t1:.1f}s (incl. compile)")
    print(f"greedy speculative == autoregressive, token for token: {same}")
    with waiting("synthetic acceptance 0.8 (compiles, then runs)"):
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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model folder (default: the shipped tiny model; needs prompts.json)")
    ap.add_argument("--random", action="store_true",
                    help="random-weight model + synthetic acceptance (the old demo)")
    ap.add_argument("--num-prompts", type=int, default=6, help="held-out prompts to complete")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="new tokens per prompt at most")
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=3,
                    help="MTP drafts per verify step, K")
    ap.add_argument("--method", choices=["chain", "multi_layer"], default="chain",
                    help="--random only (the shipped model has one MTP module: chain)")
    ap.add_argument("--seed", type=int, default=0, help="--random only")
    args = ap.parse_args(argv)
    if args.random:
        random_demo(args)
    else:
        trained_demo(args)


if __name__ == "__main__":
    main()
