"""Serving-feature benchmarks: logprobs cost, adaptive vs fixed K, coupled vs rejection acceptance.

    python -m mtpjax.bench.spec_features logprobs  [--batch 32] [--k 3] [--steps 50]
    python -m mtpjax.bench.spec_features adaptive  [--batches 1 64] [--rates 0.9 0.6 0.3]
    python -m mtpjax.bench.spec_features acceptance [--k 1 2 3] [--temperatures 0.6 1.0]
    python -m mtpjax.bench.spec_features sampling  [--batch 32] [--k 3] [--layers 4 --hidden 4096 --vocab 128256]
    python -m mtpjax.bench.spec_features all --tiny        # CPU smoke shapes (the test runs this)

logprobs: engine ms/step at `batch` decoding requests, K drafts, `LLM(max_logprobs=0)` against
  `LLM(max_logprobs=5)` with every request asking `logprobs=5`; greedy (`--temperature 0`) with
  synthetic acceptance 0.7, sampled with rejection sampling (what a sampled request runs).
  Also the device-only step time (the last batch replayed back to back, no host work).
adaptive: tokens/s of fixed K against `AdaptiveK()` at each batch size, synthetic acceptance whose
  conditional per-position rates decay (`--rates`, P(draft i kept | drafts < i kept)).
acceptance: the shipped trained model (`tiny_code_mimo`), seeded sampled requests, coupled vs
  rejection: acceptance rate and tokens per verify step (real acceptance; no synthetic rule).
sampling: engine ms/step at `batch` sampled requests (temperature 1, rejection sampling), K
  drafts, every row using one feature: none, min_p, logit_bias, penalties, stop strings, a
  regex grammar — one engine per feature, their timed windows interleaved, plus a second
  "none" engine whose spread bounds the noise. A feature's cost is the step after the last
  layer plus its host work, so `--layers` can be cut without changing it (the table says the
  depth). Stop strings and the grammar need a tokenizer: the shipped tiny model's (its
  vocabulary is smaller than the model's; ids past it are never allowed by the grammar).
Model for logprobs/adaptive/sampling: random weights, bf16, hidden 2048, 8 layers, vocab 32000 (GPU).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def _model(args, tiny_vocab: int = 64):
    import mtpjax
    if args.tiny:
        cfg = mtpjax.ModelConfig(vocab_size=tiny_vocab, hidden_size=32, intermediate_size=64,
                                 num_layers=2, num_heads=4, num_kv_heads=2, num_mtp_layers=1)
        return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    h = args.hidden
    cfg = mtpjax.ModelConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=4 * h,
                             num_layers=args.layers, num_heads=h // 128,
                             num_kv_heads=max(h // 512, 1), head_dim=128, num_mtp_layers=1)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16, std=0.02)


def _engine(cfg, params, spec, batch, steps, prompt_len, **kw):
    import mtpjax
    K = spec.num_speculative_tokens
    max_tokens = (steps + 8) * (K + 1) + 8
    pages = batch * ((prompt_len + max_tokens + 2 * K + 16) // 16 + 2)
    return mtpjax.LLM(params, cfg, spec, num_pages=pages, page_size=16, max_num_seqs=batch,
                      max_num_batched_tokens=max(batch * (K + 1), prompt_len * 4),
                      enable_prefix_caching=False, warmup=False,   # a compile lands in one
                      **kw), max_tokens                            # window: the median drops it


def _fill(llm, cfg, batch, prompt_len, max_tokens, sp_kw=None):
    """Fills the engine with `batch` requests, prefills them and runs a few decode steps (every
    decode bucket compiled). Returns the requests."""
    import mtpjax
    rng = np.random.default_rng(0)
    seqs = [llm.add_request(rng.integers(0, cfg.vocab_size, prompt_len).tolist(),
                            mtpjax.SamplingParams(max_tokens=max_tokens, **(sp_kw or {})))
            for _ in range(batch)]
    while any(s.is_prefill for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    for _ in range(2 if args_tiny(llm) else 4):
        llm.step()
    return seqs


def _window(llm, seqs, steps):
    """(seconds, committed tokens) of `steps` engine steps, device work included."""
    llm.flush()
    jax.block_until_ready(llm.runner.state)
    before = sum(s.num_completion_tokens for s in seqs)
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    llm.flush()
    jax.block_until_ready(llm.runner.state)
    return time.perf_counter() - t0, sum(s.num_completion_tokens for s in seqs) - before


def _compare(runs, steps, windows):
    """runs: {name: (llm, seqs, setup)}; `windows` rounds, each timing `steps` steps of every
    run in turn (setup() first), so drift and one-off stalls hit all runs alike. Returns
    {name: (median seconds per step, tokens per second at that window)}."""
    per = {name: [] for name in runs}
    for _ in range(windows):
        for name, (llm, seqs, setup) in runs.items():
            setup()
            dt, tokens = _window(llm, seqs, steps)
            per[name].append((dt / steps, tokens / dt))
    out = {}
    for name, rows in per.items():
        rows.sort()
        out[name] = rows[len(rows) // 2]
    for llm, seqs, _ in runs.values():
        for s in seqs:
            if not s.is_finished:
                llm.abort(s)
        llm.step()
    return out


def args_tiny(llm) -> bool:
    return llm.cfg.hidden_size <= 64


def bench_logprobs(args):
    import mtpjax
    cfg, params = _model(args)
    # greedy: synthetic acceptance 0.7. Sampled: rejection sampling, what serving a sampled
    # request runs — synthetic acceptance never filters the target's distribution, so there
    # the logprobs alone would pay the top-k / top-p sorts that sampling otherwise shares
    spec = (mtpjax.SpecConfig(num_speculative_tokens=args.k, acceptance="synthetic",
                              synthetic_accept_rate=0.7) if args.temperature == 0 else
            mtpjax.SpecConfig(num_speculative_tokens=args.k))
    # an engine without logprobs against one compiled with max_logprobs=5 whose every request
    # asks (the logprob work runs for every row of such an engine: no device-side branch)
    runs = {}
    for n in (0, 5):
        llm, mt = _engine(cfg, params, spec, args.batch, args.steps * args.windows,
                          args.prompt_len, max_logprobs=n)
        sp_kw = {"temperature": args.temperature, **({"logprobs": n} if n else {})}
        seqs = _fill(llm, cfg, args.batch, args.prompt_len, mt, sp_kw)
        runs[n] = (llm, seqs, lambda: None)
    for llm, _, _ in runs.values():
        _record_last_batch(llm)
    res = _compare(runs, args.steps, args.windows)
    device = {n: _device_step_seconds(runs[n][0], args.steps) for n in (0, 5)}
    rows = [(n, *res[n], device[n]) for n in (0, 5)]
    print(f"logprobs cost: batch {args.batch}, K={args.k}, temperature {args.temperature}, "
          f"{jax.devices()[0].device_kind}")
    print("| logprobs per request (all rows) | ms/step | tokens/s | device-only ms/step |")
    print("| --- | --- | --- | --- |")
    for n, s, tps, dev in rows:
        print(f"| {n} | {1e3 * s:.3f} | {tps:.0f} | {1e3 * dev:.3f} |")
    print(f"logprobs=5 adds {1e3 * (rows[1][1] - rows[0][1]):.3f} ms/step "
          f"({100 * (rows[1][1] / rows[0][1] - 1):+.1f}%)")
    return rows


def _record_last_batch(llm) -> None:
    """Keeps the engine's last packed decode batch (for `_device_step_seconds`)."""
    r, pack = llm.runner, llm.runner.pack

    def recording(out, num_drafts=None):
        batch, F = pack(out, num_drafts)
        if out.requests:
            r.last_batch = (batch, F)
        return batch, F
    r.pack = recording


def _device_step_seconds(llm, steps: int) -> float:
    """Seconds per step of the compiled step alone: the engine's last batch replayed `steps`
    times back to back (no host work between steps; the replay advances the slots' KV, so the
    engine is finished with afterwards)."""
    from mtpjax.engine.runner import _step
    from mtpjax.sampling import sampling_mode
    r = llm.runner
    batch, F = r.last_batch
    inputs, shape = r.device_inputs(batch)
    kw = dict(first_pass_len=F, backend=r.backend, shape=shape, logprobs=r.max_logprobs,
              sampling_mode=sampling_mode(batch.sampling.temperature))
    times = []
    for _ in range(3):
        jax.block_until_ready(r.state)
        t0 = time.perf_counter()
        for _ in range(steps):
            r.state, result = _step(r.params, r.cfg, r.spec, r.state, inputs, **kw)
        jax.block_until_ready(result)
        times.append((time.perf_counter() - t0) / steps)
    return sorted(times)[1]


def bench_adaptive(args):
    import mtpjax
    cfg, params = _model(args)
    rates = tuple(args.rates)
    spec = mtpjax.SpecConfig(num_speculative_tokens=len(rates), acceptance="synthetic",
                             synthetic_accept_rate=rates)
    rows = []
    for b in args.batches:
        llm, mt = _engine(cfg, params, spec, b, args.steps * args.windows * 2, args.prompt_len)
        seqs = _fill(llm, cfg, b, args.prompt_len, mt)
        policies = {"fixed K": None, "adaptive": mtpjax.AdaptiveK()}
        res = _compare({name: (llm, seqs, lambda p=p: setattr(llm, "adaptive_k", p))
                        for name, p in policies.items()}, args.steps, args.windows)
        rows += [(b, name, *res[name]) for name in policies]
        del llm
    print(f"adaptive K: conditional acceptance by position {rates}, "
          f"{jax.devices()[0].device_kind}")
    print("| batch | policy | ms/step | tokens/s |")
    print("| --- | --- | --- | --- |")
    for b, name, s, tps in rows:
        print(f"| {b} | {name} | {1e3 * s:.3f} | {tps:.0f} |")
    return rows


def bench_acceptance(args):
    import mtpjax
    from mtpjax.assets import tiny_model_path, tiny_model_prompts
    from mtpjax.checkpoint import load_pretrained
    ck = load_pretrained(tiny_model_path(), jnp.float32)
    prompts = tiny_model_prompts()[:args.prompts]
    if args.tiny:
        prompts = [ck.tokenizer.encode(p)[:24] for p in prompts]
    rows = []
    for K in args.k:
        for acc in ("rejection", "coupled"):
            llm = mtpjax.LLM(ck.params, ck.cfg, mtpjax.SpecConfig(num_speculative_tokens=K,
                                                                  acceptance=acc),
                             num_pages=256, page_size=16, max_num_seqs=len(prompts),
                             max_num_batched_tokens=1024, tokenizer=ck.tokenizer)
            for t in args.temperatures:
                sps = [mtpjax.SamplingParams(temperature=t, seed=i, max_tokens=args.tokens)
                       for i in range(len(prompts))]
                outs = llm.generate(prompts, sps)
                prop = sum(o.num_draft_tokens for o in outs)
                accd = sum(o.num_accepted_draft_tokens for o in outs)
                steps = sum(o.num_verify_steps for o in outs)
                rows.append((K, t, acc, accd / max(prop, 1), (accd + steps) / max(steps, 1)))
    print(f"acceptance on tiny_code_mimo: {len(prompts)} prompts x {args.tokens} tokens, "
          f"seeded sampling (chain)")
    print("| K | temperature | acceptance | acceptance rate | tokens / verify step |")
    print("| --- | --- | --- | --- | --- |")
    for K, t, acc, rate, length in sorted(rows):
        print(f"| {K} | {t} | {acc} | {rate:.3f} | {length:.2f} |")
    return rows


SAMPLING_FEATURES = {   # row name -> SamplingParams fields every request of that row sets
    "none": {},
    "none (again)": {},
    "min_p 0.05": {"min_p": 0.05},
    "logit_bias (32 ids)": {"logit_bias": {i * 97: (-1.0) ** i * 2.0 for i in range(32)}},
    "penalties (rep 1.1, pres 0.5, freq 0.5)": {"repetition_penalty": 1.1,
                                                "presence_penalty": 0.5,
                                                "frequency_penalty": 0.5},
    "stop strings (2)": {"stop": ["zzzz", "qqqq"]},
    "regex grammar": {"structured_output": "regex"},
}


def bench_sampling(args):
    import mtpjax
    from mtpjax.assets import tiny_model_path
    from mtpjax.checkpoint import load_pretrained
    tokenizer = load_pretrained(tiny_model_path(), jnp.float32).tokenizer
    # the tokenizer's ids must be the model's (a smoke model gets its vocabulary's size)
    cfg, params = _model(args, tiny_vocab=1024)
    spec = mtpjax.SpecConfig(num_speculative_tokens=args.k)
    features = dict(SAMPLING_FEATURES)
    try:
        from mtpjax.structured.compiler import import_xgrammar
        import_xgrammar()
    except ImportError as e:                    # the table says which row is missing and why
        print(f"regex grammar row skipped: {e}")
        features.pop("regex grammar")
    runs = {}
    for name, fields in features.items():
        fields = dict(fields)
        if fields.get("structured_output") == "regex":
            # fixed length: eos is allowed only at the end, so no request ends early
            fields["structured_output"] = mtpjax.StructuredOutput(regex="[a-z ]{4096}")
        if args.tiny and "logit_bias" in fields:
            fields["logit_bias"] = {i: 1.0 for i in range(4)}
        # eos only where a grammar needs one (random weights would otherwise end requests)
        eos = 0 if "structured_output" in fields else None
        llm, mt = _engine(cfg, params, spec, args.batch, args.steps * args.windows,
                          args.prompt_len, tokenizer=tokenizer, eos_token_id=eos)
        seqs = _fill(llm, cfg, args.batch, args.prompt_len, mt,
                     {"temperature": 1.0, **fields})
        runs[name] = (llm, seqs, lambda: None)
    res = _compare(runs, args.steps, args.windows)
    base = res["none"][0]
    print(f"sampling features: batch {args.batch}, K={args.k}, temperature 1 (rejection), "
          f"hidden {cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}, "
          f"{jax.devices()[0].device_kind}")
    print("| every row uses | ms/step | cost vs none (ms/step) | tokens/s |")
    print("| --- | --- | --- | --- |")
    rows = []
    for name, (s, tps) in res.items():
        rows.append((name, s, tps))
        print(f"| {name} | {1e3 * s:.3f} | {1e3 * (s - base):+.3f} "
              f"({100 * (s / base - 1):+.1f}%) | {tps:.0f} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["logprobs", "adaptive", "acceptance", "sampling", "all"])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke shapes")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="logprobs: the requests' temperature")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.9, 0.6, 0.3])
    ap.add_argument("--steps", type=int, default=30, help="engine steps per timed window")
    ap.add_argument("--windows", type=int, default=5,
                    help="timed windows per row, interleaved across rows (median reported)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args(argv)
    if args.what in ("logprobs", "adaptive", "sampling") and len(args.k) != 1:
        ap.error("logprobs/adaptive/sampling take one --k")
    args.k = args.k if args.what == "acceptance" else args.k
    out = {}
    if args.what in ("logprobs", "all"):
        a = argparse.Namespace(**{**vars(args), "k": args.k[0]})
        out["logprobs"] = bench_logprobs(a)
    if args.what in ("adaptive", "all"):
        out["adaptive"] = bench_adaptive(args)
    if args.what in ("acceptance", "all"):
        out["acceptance"] = bench_acceptance(args)
    if args.what in ("sampling", "all"):
        out["sampling"] = bench_sampling(argparse.Namespace(**{**vars(args), "k": args.k[0]}))
    return out


if __name__ == "__main__":
    main()
