"""Host-overhead benchmark: engine steps/s against the bare jitted step on the same batch.

    python -m mtpjax.bench.engine [--batch 32] [--k 3] [--steps 50]

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
        for _ in range(3):                               # warm every decode bucket
            llm.step()
        llm.flush()
        jax.block_until_ready(llm.runner.state)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            llm.step()
        llm.flush()
        jax.block_until_ready(llm.runner.state)
        return (time.perf_counter() - t0) / args.steps

    # A step costs more as contexts grow, so the paths are timed in the order
    # bare, async, sync, sync, async, bare and each is averaged over its two runs: every path then
    # sees the same mean context length.
    times = {"bare": [], "bare_sync": [], "async": [], "sync": []}
    for phase in ("bare", "async", "sync", "sync", "async", "bare"):
        if phase == "bare":
            bare_s, sync_s = time_bare_step(llm, runner_mod, args.steps)
            times["bare"].append(bare_s)
            times["bare_sync"].append(sync_s)
        else:
            times[phase].append(time_engine(phase == "async"))
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    engine_s, engine_sync_s, bare_s, sync_s = (mean["async"], mean["sync"], mean["bare"],
                                               mean["bare_sync"])
    host = host_breakdown(llm, runner_mod, args.steps)
    overhead = engine_s / bare_s - 1
    r = llm.runner
    print("host time per synchronous step (ms): " + ", ".join(
        f"{k} {v * 1e3:.3f}" for k, v in host.items()))
    print(f"device: {jax.devices()[0].device_kind}; batch {B}, K={K}, prompt {args.prompt_len}, "
          f"hidden {args.hidden}, layers {args.layers}, attention {r.backend.impl}")
    print("| path | ms/step | steps/s | runs (ms) |\n| --- | --- | --- | --- |")
    for name, key in (("engine (LLM.step, async scheduling)", "async"),
                      ("engine (LLM.step, synchronous)", "sync"),
                      ("bare jitted step (async)", "bare"),
                      ("bare jitted step + readback", "bare_sync")):
        runs = " / ".join(f"{t * 1e3:.2f}" for t in times[key])
        print(f"| {name} | {mean[key] * 1e3:.2f} | {1 / mean[key]:.1f} | {runs} |")
    print(f"engine host overhead vs bare async step: {overhead * 100:.1f}%; "
          f"vs step + readback: {(engine_s / sync_s - 1) * 100:.1f}%; "
          f"synchronous engine vs step + readback: {(engine_sync_s / sync_s - 1) * 100:.1f}%")
    return 0


def time_bare_step(llm, runner_mod, steps):
    """Seconds per call of the jitted step alone, replaying one packed batch of every running
    request's decode: (no host sync, one readback per call). Runs on a copy of the device state
    and leaves the engine's state and the scheduler untouched."""
    from mtpjax.engine.scheduler import ScheduledRequest, SchedulerOutput
    llm.flush()
    r = llm.runner
    K = llm.spec.num_speculative_tokens if llm.spec else 0
    reqs = [ScheduledRequest(seq=seq, is_prefill=False, start_position=seq.num_computed_tokens,
                             num_query_tokens=K + 1, is_last_chunk=True,
                             token_ids=(seq.last_token_id,)) for seq in llm.scheduler.running]
    batch, F = r.pack(SchedulerOutput(reqs, [], K))
    # Replays advance positions on the device copy; give each row distinct pages past its table
    # so they never pile onto one page (contents do not matter on the copy).
    tables = batch.block_tables
    for i, req in enumerate(reqs):
        n = len(req.seq.block_table)
        tables[i, n:] = (np.arange(n, tables.shape[1]) * len(reqs) + i) % llm.block_manager.num_blocks
    inputs, shape = r.device_inputs(batch)
    state = jax.tree.map(jnp.copy, r.state)

    def run(n, readback):
        nonlocal state
        t0 = time.perf_counter()
        for _ in range(n):
            state, res = runner_mod._step(r.params, r.cfg, r.spec, state, inputs,
                                          first_pass_len=F, backend=r.backend, shape=shape)
            if readback:
                np.asarray(res)
        jax.block_until_ready((state, res))
        return (time.perf_counter() - t0) / n

    run(3, False)
    bare = run(steps, False)
    with_readback = run(steps, True)
    del state
    return bare, with_readback


def host_breakdown(llm, runner_mod, steps):
    """Host seconds per step spent in each phase of a synchronous LLM.step (device work shows up
    in `collect`, which waits for it)."""
    totals: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    sched, runner = llm.scheduler, llm.runner
    patches = [(sched, "schedule"), (sched, "postprocess"), (runner, "pack"),
               (runner, "device_inputs"), (runner, "collect")]
    for obj, name in patches:
        setattr(obj, name, timed(name, getattr(obj, name)))
    step = runner_mod._step
    runner_mod._step = timed("jit dispatch", step)
    try:
        llm.flush()
        llm.async_scheduling = False
        for _ in range(steps):
            llm.step()
    finally:
        runner_mod._step = step
        for obj, name in patches:
            delattr(obj, name)
    return {k: v / steps for k, v in totals.items()}


if __name__ == "__main__":
    raise SystemExit(main())
