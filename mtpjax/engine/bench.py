"""Host-overhead benchmark: engine steps/s against the bare jitted step on the same batch.

    python -m mtpjax.engine.bench [--batch 32] [--k 3] [--steps 50]

Builds a random-weight model, fills the engine with `batch` decoding requests (synthetic
acceptance so acceptance lengths are realistic), then times (a) `LLM.step()` — schedule, pack,
device step, read back, postprocess — with async scheduling (step t+1 dispatched before step t is
read) and synchronously, and (b) the jitted step alone, re-run on one packed batch, without and
with the engine's one readback per step.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def main(argv=None):
    import mtpjax
    from mtpjax.engine import runner as runner_mod
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    B, K = args.batch, args.k
    cfg = mtpjax.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                             intermediate_size=4 * args.hidden, num_layers=args.layers,
                             num_heads=args.hidden // 128, num_kv_heads=max(args.hidden // 512, 1),
                             head_dim=128, num_mtp_layers=1)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16, std=0.02)
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, acceptance="synthetic",
                             synthetic_accept_rate=0.7)
    max_tokens = 8 * args.steps * (K + 1) + 64
    pages = B * ((args.prompt_len + max_tokens + 2 * K + 16) // 16 + 2)
    llm = mtpjax.LLM(params, cfg, spec, num_pages=pages, page_size=16, max_num_seqs=B,
                     max_num_batched_tokens=max(B * (K + 1), args.prompt_len * 4),
                     enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for _ in range(B):
        llm.add_request(rng.integers(0, cfg.vocab_size, args.prompt_len).tolist(),
                        mtpjax.SamplingParams(max_tokens=max_tokens))
    while any(s.is_prefill for s in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()

    def time_engine(async_scheduling):
        llm.flush()
        llm.async_scheduling = async_scheduling
        for _ in range(5):                               # warm every decode bucket
            llm.step()
        llm.flush()
        jax.block_until_ready(llm.runner.state)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        llm.flush()
        jax.block_until_ready(llm.runner.state)
        return (time.perf_counter() - t0) / args.steps

    engine_s = time_engine(True)
    engine_sync_s = time_engine(False)

    out = llm.scheduler.schedule()                       # one more decode step, packed once
    batch, F = llm.runner.pack(out)
    r = llm.runner
    batch = r.device_inputs(batch)
    state = r.state
    for _ in range(3):
        state, res = runner_mod._step(r.params, r.cfg, r.spec, state, batch,
                                      first_pass_len=F, impl=r.impl)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, res = runner_mod._step(r.params, r.cfg, r.spec, state, batch,
                                      first_pass_len=F, impl=r.impl)
    jax.block_until_ready((state, res))
    bare_s = (time.perf_counter() - t0) / args.steps
    t0 = time.perf_counter()
    for _ in range(args.steps):                          # with the engine's one readback
        state, res = runner_mod._step(r.params, r.cfg, r.spec, state, batch,
                                      first_pass_len=F, impl=r.impl)
        np.asarray(res)
    sync_s = (time.perf_counter() - t0) / args.steps
    overhead = engine_s / bare_s - 1
    print(f"device: {jax.devices()[0].device_kind}; batch {B}, K={K}, prompt {args.prompt_len}, "
          f"hidden {args.hidden}, layers {args.layers}, attention {r.impl}")
    print("| path | ms/step | steps/s |\n| --- | --- | --- |")
    print(f"| engine (LLM.step, async scheduling) | {engine_s * 1e3:.2f} | {1 / engine_s:.1f} |")
    print(f"| engine (LLM.step, synchronous) | {engine_sync_s * 1e3:.2f} | "
          f"{1 / engine_sync_s:.1f} |")
    print(f"| bare jitted step (async) | {bare_s * 1e3:.2f} | {1 / bare_s:.1f} |")
    print(f"| bare jitted step + readback | {sync_s * 1e3:.2f} | {1 / sync_s:.1f} |")
    print(f"engine host overhead vs bare async step: {overhead * 100:.1f}%; "
          f"vs step + readback: {(engine_s / sync_s - 1) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
