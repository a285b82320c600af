"""Where a decode step's time goes on the device: `generate`'s on-device loop against the
engine's steps, kernel by kernel, from a `jax.profiler` trace.

    python -m mtpjax.bench.step_profile [--model-shape llama3-8b] [--layers 16] [--batch 1]
                                        [--new-tokens 64] [--k 0] [--out DIR] [--loop-graph]
                                        [--paths generate,engine] [--no-async-scheduling]

Paths (`--paths`, the first two are compared): `generate`, `engine` (both with --k drafts, or
plain at --k 0), `engine-plain` (an engine without MTP) and `engine-k0` (the --k engine, every
request asking `num_speculative_tokens=0`: its zero-pass program, what adaptive K runs when it
stops drafting). An engine path first times one untraced pass (ms per decode step, as `bench
e2e` times it) and prints its host split: host work per step (scheduling, packing, XLA's launch
of the program) and time spent waiting for results; at batch 1 the step is bound by whichever
is larger.

For each path it traces one greedy run after a warm-up run and reports, over the decode part
of the trace (the last 70% of its device time): steps (paged-attention kernels / layers),
device-busy and wall span per step, kernels per step, the idle gaps between kernels (with the
host events inside the biggest one: what the device was waiting for), and the top kernels per
step; then the kernels whose time per step differs most between the two paths. Both causes of
`generate`'s former batch-1 gap were found this way (docs/benchmarks.md). On a
machine without a GPU the trace has no device kernels and the report says so.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import gzip
import json
import os
import tempfile

# One per layer per step. Mosaic-GPU kernels are all named "entry_mosaic_gpu_kernel"; in a
# decode window that is the MLA kernel (the Mosaic MoE kernels run from 256 rows per expert:
# prefill sizes), which counting only the Triton names missed for DeepSeek-V2-Lite.
ATTENTION_KERNELS = ("paged_attn", "ragged", "mla_paged", "entry_mosaic_gpu_kernel")


def device_kernels(trace_dir: str):
    """(kernel events of the busiest device stream sorted by start, all events, pid names)."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    pids = {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0
               and "/device:GPU" in pids.get(e["pid"], "")]
    if not kernels:
        return [], events, pids
    stream = collections.Counter((e["pid"], e["tid"]) for e in kernels).most_common(1)[0][0]
    return (sorted((e for e in kernels if (e["pid"], e["tid"]) == stream), key=lambda e: e["ts"]),
            events, pids)


def summarize(trace_dir: str, layers: int, name: str, top: int = 12) -> dict:
    """The report of one path's trace (see the module docstring); prints it."""
    kernels, events, pids = device_kernels(trace_dir)
    if not kernels:
        print(f"{name}: no device kernels in the trace (no GPU?)")
        return {"name": name, "per_kernel_us": {}}
    t0, t1 = kernels[0]["ts"], kernels[-1]["ts"] + kernels[-1]["dur"]
    window = [e for e in kernels if e["ts"] >= t0 + 0.3 * (t1 - t0)]
    span = window[-1]["ts"] + window[-1]["dur"] - window[0]["ts"]
    busy = sum(e["dur"] for e in window)
    steps = max(1, sum(1 for e in window if any(a in e["name"] for a in ATTENTION_KERNELS))
                // layers)
    gaps = [(b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(window, window[1:])]
    big = sorted(gaps, key=lambda g: -g[0])[:3]
    per = collections.Counter()
    for e in window:
        per[e["name"][:80]] += e["dur"] / steps
    print(f"{name}: {steps} steps in the window; per step: busy {busy / steps / 1e3:.3f} ms, "
          f"span {span / steps / 1e3:.3f} ms, {len(window) / steps:.0f} kernels; idle "
          f"{100 * (span - busy) / span:.1f}%, gaps > 5 us: "
          f"{sum(g for g, _, _ in gaps if g > 5) / 1e3:.2f} ms in {sum(g > 5 for g, _, _ in gaps)}")
    for g, a, b in big:
        print(f"  gap {g:.0f} us after {a['name'][:40]} before {b['name'][:40]}")
    if big and big[0][0] > 50:
        g, a, b = big[0]
        lo, hi = a["ts"] + a["dur"], b["ts"]
        inside = sorted((e for e in events if e.get("ph") == "X" and e.get("dur", 0) > 0
                         and "/device:GPU" not in pids.get(e["pid"], "")
                         and lo <= e["ts"] < hi), key=lambda e: -e["dur"])[:5]
        for e in inside:
            print(f"    host in the biggest gap: {e['dur']:.0f} us {e['name'][:70]}")
    coll = sum(us for k, us in per.items() if "nccl" in k.lower())
    if coll:
        print(f"  collectives (NCCL kernels): {coll / 1e3:.3f} ms/step, "
              f"{sum('nccl' in e['name'].lower() for e in window) / steps:.0f} per step")
    for kname, us in per.most_common(top):
        print(f"  {us / 1e3:8.3f} ms/step  {kname}")
    return {"name": name, "steps": steps, "busy_ms_per_step": busy / steps / 1e3,
            "span_ms_per_step": span / steps / 1e3, "kernels_per_step": len(window) / steps,
            "per_kernel_us": dict(per)}


PATHS = ("generate", "engine", "engine-plain", "engine-k0")


def host_split(llm, prompts, new_tokens: int, verify_k: int | None) -> dict:
    """One pass of an engine path outside the profiler (`e2e.engine_pass`: ms per decode
    step), the step loop's host / waiting split (`StepLoop.host_split`) per step() call, and
    the draft passes its steps ran ({passes: steps})."""
    from mtpjax.bench import e2e
    llm._loop.reset_host_split()
    llm._loop.passes_used.clear()
    timed = e2e.engine_pass(llm, prompts, new_tokens, verify_k)
    host, wait = llm._loop.host_split()
    return {"ms_per_step": timed["ms_per_step"], "host_ms_per_step": 1e3 * host,
            "wait_ms_per_step": 1e3 * wait, "passes_used": dict(llm._loop.passes_used)}


def profile_loop_kernel_by_kernel():
    """Swap generate's loop for the same function compiled without LOOP_COMPILER_OPTIONS.

    Shipped, the whole while loop is one CUDA graph (step_jit.LOOP_COMPILER_OPTIONS) and a
    `jax.profiler` trace shows none of its kernels (seen on the H100: "2 steps in the window",
    prefill kernels only). Without the loop's command buffers each iteration's body is its own
    graph launch: the kernels are the same and visible; the gaps between steps are not the
    shipped ones (docs/benchmarks.md has those)."""
    import importlib

    from mtpjax.step_jit import step_jit
    gen = importlib.import_module("mtpjax.generate")
    shipped = gen._loop
    gen._loop = step_jit(shipped.__wrapped__, static_argnames=(
        "cfg", "spec", "backend", "draft_source", "steps_per_check"), donate_argnames=("state",))
    return lambda: setattr(gen, "_loop", shipped)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-shape", default="llama3-8b")
    ap.add_argument("--layers", type=int, default=16, help="target layers (fewer compile faster)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=0, help="MTP drafts per step (0: plain decoding)")
    ap.add_argument("--out", default=None, help="folder for step_profile.json")
    ap.add_argument("--loop-graph", action="store_true",
                    help="profile generate's loop as it ships (one CUDA graph: the profiler "
                         "sees none of its kernels); default: compiled without the WHILE / "
                         "CONDITIONAL command buffers, same kernels, visible one by one")
    ap.add_argument("--paths", default="generate,engine",
                    help=f"comma-separated, of {', '.join(PATHS)} (the first two are compared)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="engine paths read each step back before scheduling the next: no "
                         "two steps in flight (does XLA's launch of the program cost less "
                         "host time when consecutive runs can reuse the same buffers?)")
    ap.add_argument("--tensor-parallel", type=int, default=1,
                    help="devices on the mesh's model axis (the trace's busiest GPU stream is "
                         "reported; NCCL kernels are the collectives)")
    a = ap.parse_args(argv)
    names = a.paths.split(",")
    if not names or set(names) - set(PATHS) or len(set(names)) != len(names):
        raise SystemExit(f"--paths takes distinct names of {', '.join(PATHS)}, got {a.paths!r}")
    if "engine-k0" in names and a.k == 0:
        raise SystemExit("--paths engine-k0 needs an MTP engine: give --k >= 1")

    import jax
    import jax.numpy as jnp

    import mtpjax
    from mtpjax.bench import e2e
    cfg = dataclasses.replace(e2e.model_config(a.model_shape), num_layers=a.layers)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16, std=0.02)
    mesh = None
    if a.tensor_parallel > 1:
        from mtpjax.parallel import shard_params
        mesh = mtpjax.make_mesh(tensor_parallel=a.tensor_parallel)
        params = jax.block_until_ready(shard_params(params, cfg, mesh))
    prompts = e2e.prompts_for(cfg, a.batch, 128, 0)
    spec = None if a.k == 0 else mtpjax.SpecConfig(
        num_speculative_tokens=a.k, acceptance="synthetic", synthetic_accept_rate=0.8)
    engine_args = argparse.Namespace(k=max(a.k, 1), prompt_len=128, new_tokens=a.new_tokens,
                                     max_num_batched_tokens=None,
                                     min_token_bucket=None)    # the engine's default

    def engine(spec, verify_k=None):
        """(the LLM, each request's num_speculative_tokens, a run of the workload)."""
        llm = mtpjax.LLM(params, cfg, spec, warmup=False, mesh=mesh,
                         async_scheduling=not a.no_async_scheduling,
                         **e2e.engine_kwargs(engine_args, a.batch))
        sp = mtpjax.SamplingParams(max_tokens=a.new_tokens, num_speculative_tokens=verify_k)
        return llm, verify_k, lambda: llm.generate(prompts, sp)
    made = {"engine": lambda: engine(spec), "engine-plain": lambda: engine(None),
            "engine-k0": lambda: engine(spec, verify_k=0)}
    engines = {n: made[n]() for n in names if n in made}
    paths = {n: engines[n][2] if n in engines else
             (lambda: mtpjax.generate(params, cfg, prompts, max_new_tokens=a.new_tokens,
                                      spec=spec, page_size=e2e.PAGE_SIZE, mesh=mesh).tokens)
             for n in names}
    restore = (lambda: None) if a.loop_graph or "generate" not in names \
        else profile_loop_kernel_by_kernel()
    reports = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, run in paths.items():
                jax.block_until_ready(run())                    # compiles
                host = None
                if name in engines:
                    llm, verify_k, _ = engines[name]
                    host = host_split(llm, prompts, a.new_tokens, verify_k)
                    print(f"{name}: untraced {host['ms_per_step']:.3f} ms a decode step; host "
                          f"{host['host_ms_per_step']:.3f} ms, waiting "
                          f"{host['wait_ms_per_step']:.3f} ms per step")
                with jax.profiler.trace(os.path.join(tmp, name)):
                    jax.block_until_ready(run())
                reports.append(summarize(os.path.join(tmp, name), cfg.num_layers, name))
                if host:
                    reports[-1].update(host)
    finally:
        restore()
    # one path: nothing to compare
    a_, b_ = (r["per_kernel_us"] for r in reports[:2]) if len(reports) > 1 else ({}, {})
    if a_ or b_:
        print(f"kernels whose time per step differs most ({reports[0]['name']} vs "
              f"{reports[1]['name']}, ms/step):")
        for k in sorted(set(a_) | set(b_), key=lambda k: -abs(a_.get(k, 0) - b_.get(k, 0)))[:10]:
            print(f"  {a_.get(k, 0) / 1e3:8.3f} {b_.get(k, 0) / 1e3:8.3f}  {k}")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "step_profile.json"), "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
