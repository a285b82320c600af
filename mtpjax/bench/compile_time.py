"""Compile time of one engine step program against the model's depth (not a test).

    python -u -m mtpjax.bench.compile_time [--model-shape llama3-8b] [--layers 8,16,32]
        [--k 3] [--tokens 32] [--fresh-process]

For each depth: random bf16 params of the shape with that many target layers, one engine
(`LLM(..., warmup=False)`), and one step bucket (T = --tokens query tokens, F = its first pass)
lowered and compiled in both sampling modes on one thread (`ModelRunner.warmup`). Printed per
depth: seconds to trace + lower and to compile (XLA's passes, code generation and the Pallas
kernels' own compiles), the optimized program's fusions and custom calls (Pallas kernels), and
the ratio to the shallowest depth. A compile whose time grows with depth compiles every
layer's kernels anew; one flat in depth compiles each distinct kernel once.

In one process a later depth reuses what XLA keeps from the earlier compiles (GEMM autotuning
results), so it times less than a cold start pays; `--fresh-process` compiles each depth in a
process of its own (the persistent compilation cache off), as a cold start does.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-shape", default="llama3-8b")
    ap.add_argument("--layers", default="8,16,32")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fresh-process", action="store_true",
                    help="each depth in a process of its own (nothing reused between depths)")
    args = ap.parse_args(argv)
    if args.fresh_process:
        return _fresh_processes(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import mtpjax
    from mtpjax.bench.e2e import model_config
    from mtpjax.engine.runner import _step
    from mtpjax.engine.scheduler import SchedulerOutput
    from mtpjax.engine.warmup import step_buckets

    base = model_config(args.model_shape)
    spec = mtpjax.SpecConfig(num_speculative_tokens=args.k) if args.k else None
    rows = []
    print(f"compile time, {args.model_shape} dims, K={args.k}, device "
          f"{jax.devices()[0].device_kind}, JAX {jax.__version__}", flush=True)
    for L in [int(x) for x in args.layers.split(",")]:
        cfg = dataclasses.replace(base, num_layers=L)
        params = jax.block_until_ready(mtpjax.init_params(cfg, jax.random.PRNGKey(0),
                                                          jnp.bfloat16))
        llm = mtpjax.LLM(params, cfg, spec, warmup=False, max_num_seqs=max(1, args.tokens // (
            args.k + 1)), max_num_batched_tokens=args.tokens, num_pages=256,
            executable_cache=False)
        runner = llm.runner
        T, F = max(step_buckets(args.tokens, runner.max_num_seqs, runner.W, runner.min_bucket,
                                  runner.decode_tokens))
        empty, _ = runner.pack(SchedulerOutput([], [], runner.K))
        batch = empty.replace(tokens=np.zeros(T, np.int32), seq_ids=np.zeros(T, np.int32),
                              positions=np.full(T, -1, np.int32))
        inputs, shape = runner.device_inputs(batch)
        kw = runner._static(F, shape, "greedy")
        t0 = time.perf_counter()
        lowered = _step.lower(runner.params, cfg, spec, runner.state, inputs, **kw)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        text = compiled.as_text() or ""
        fusions = len(re.findall(r"^\s*\S+ = \S+ fusion\(", text, re.M))
        custom = len(re.findall(r"custom_call_target=", text))
        rows.append((L, t1 - t0, t2 - t1, fusions, custom))
        print(f"  {L} layers: trace+lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s, "
              f"{fusions} fusions, {custom} custom calls", flush=True)
        print("COMPILE_ROW " + json.dumps([L, t1 - t0, t2 - t1, fusions, custom]), flush=True)
        del llm, runner, params, compiled, lowered
    _table(rows)


def _table(rows) -> None:
    base_c = rows[0][2]
    print("\n| layers | trace+lower s | compile s | x shallowest | fusions | custom calls |")
    print("|---|---|---|---|---|---|")
    for L, lo, c, f, cc in rows:
        print(f"| {L} | {lo:.1f} | {c:.1f} | {c / base_c:.2f} | {f} | {cc} |")


def _fresh_processes(args) -> int:
    """Each depth compiled by `python -m mtpjax.bench.compile_time --layers L` in a fresh
    process with the persistent compilation cache off; one table of all."""
    rows = []
    for L in args.layers.split(","):
        cmd = [sys.executable, "-u", "-m", "mtpjax.bench.compile_time", "--model-shape",
               args.model_shape, "--layers", L, "--k", str(args.k), "--tokens", str(args.tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, MTPJAX_COMPILATION_CACHE="0"))
        found = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                 if line.startswith("COMPILE_ROW ")]
        if proc.returncode or not found:
            print(f"  {L} layers: process exited {proc.returncode}: "
                  f"{(proc.stdout + proc.stderr)[-1500:]}", flush=True)
            continue
        rows.append(found[0])
        print(f"  {L} layers (fresh process): trace+lower {found[0][1]:.1f} s, compile "
              f"{found[0][2]:.1f} s", flush=True)
    if rows:
        _table(rows)
    return 0 if len(rows) == len(args.layers.split(",")) else 1


if __name__ == "__main__":
    main()
