"""The Mosaic-GPU FP8 weight-only matmul (pallas_kernels/fp8_matmul/mosaic.py) on one GPU:
correctness on random inputs, then its time against its byte floor, the Triton FP8 kernels
(`tiles`, `stream`) and XLA's bf16 matmul on the same shapes, in one process.

    python -u -m mtpjax.bench.fp8_mosaic [--shapes 4096x14336,14336x4096,4096x6144]
        [--tokens 1,8,32] [--budget-s 150] [--out DIR]

Checks: each case's output against x @ dequantize(W) in float32 (max |y - ref| / max |ref|,
FAIL above 1e-2), with a NaN-input call first so that an output element the kernel leaves
unwritten shows up as NaN (XLA reuses the freed buffer). Timing: per shape and token count, 8
weight sets (so L2 holds none of them between calls) called in one jit, 20 such calls
dispatched back to back (`fp8_linear.pipelined_wall`): device time per call. Floor: the
weight's bytes (values + scales; bf16: 2 bytes a weight) / the copy bandwidth measured in the
same run. Each variant runs under try/except: a crash prints its error and the run goes on.
Variants: `xla-bf16` (the peer), `mosaic` (the whole call: x's padding, the kernel, the
split-K sum), `mosaic-kernel` (the kernel alone on prepared operands), `mosaic-reads` (its
TMA pipeline's loads alone: the load path's ceiling), `mosaic-launch` (the same call doing
nothing: its fixed cost), `tiles`, `stream`. The defaults of
every variant run first; the Mosaic kernel's other configurations (stages, splits, block_k,
the "x64" orientation, per-channel scales) follow while --budget-s lasts.
"""
from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.bench.fp8_linear import pipelined_wall
from mtpjax.model.fp8_weight import quantize

TOLERANCE = 1e-2
SETS = 8                      # weight sets per timed call: more bytes than L2 holds
INTERPRET = {}                # {"interpret": True} under --interpret (a CPU smoke test)


def _mosaic(x, w, **kw):
    from pallas_kernels.fp8_matmul.mosaic import fp8_weight_matmul_mosaic
    return fp8_weight_matmul_mosaic(x, w.values, w.scale, block=w.block, **kw, **INTERPRET)


def _triton(x, w, **kw):
    from pallas_kernels.fp8_matmul import fp8_weight_matmul
    return fp8_weight_matmul(x, w.values, w.scale, block=w.block, **kw, **INTERPRET)


def max_rel_err(fn, x, w) -> float:
    """max |fn(x, w) - x @ W| / max |x @ W|, after a NaN-input call (unwritten -> NaN)."""
    jax.block_until_ready(fn(jnp.full_like(x, jnp.nan), w))
    y = np.asarray(fn(x, w).astype(jnp.float32))
    ref = np.asarray(x.astype(jnp.float32) @ w.dequantize(jnp.float32))
    err = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
    return float("nan") if not np.all(np.isfinite(y)) else err


def check(cases, key) -> bool:
    """Prints each case's max relative error; True if all pass."""
    ok = True
    for i, (M, K, N, scales, cfg) in enumerate(cases):
        kx, kw = jax.random.split(jax.random.fold_in(key, i))
        x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
        w = quantize(0.05 * jax.random.normal(kw, (K, N), jnp.float32),
                     (128, 128) if scales == "block" else (K, 1))
        try:
            err = max_rel_err(jax.jit(lambda x, w, cfg=cfg: _mosaic(x, w, **cfg)), x, w)
            good = err < TOLERANCE
            msg = f"{err:.2e}"
        except Exception as e:
            good, msg = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            traceback.print_exc(limit=4)
        ok &= good
        print(f"check M={M} K={K} N={N} {scales} {cfg}: {msg}"
              + ("" if good else "   <<<<<< FAIL"), flush=True)
    return ok


def mosaic_configs(M: int) -> list[dict]:
    """The Mosaic kernel's variations around its default (wt, 4 stages, 128-row steps, one
    compute warpgroup)."""
    return [dict(compute_warpgroups=2, stages=6), dict(compute_warpgroups=2, splits=1),
            dict(stages=2), dict(block_k=64, stages=4), dict(splits=4), dict(splits=1),
            dict(stages=3), dict(stages=2, splits=4), dict(orientation="x64"),
            dict(block_k=64, stages=8), dict(stages=6), dict(splits=8)]


def _name(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x6144")
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop starting variations (not defaults) after this long")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--interpret", action="store_true",
                    help="run the kernels interpreted (a CPU smoke test of this script: use "
                         "small --shapes; times mean nothing)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    if a.interpret:
        INTERPRET["interpret"] = True
    from mtpjax.bench.e2e import copy_bandwidth
    bw = copy_bandwidth(1024)
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}; copy "
          f"{bw / 1e12:.3f} TB/s", flush=True)
    key = jax.random.PRNGKey(0)
    shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]

    ok = True
    if not a.skip_check:
        cases = [(M, K, N, sc, cfg)
                 for M in (1, 8, 32) for (K, N) in ((256, 384),)
                 for sc in ("block", "channel") for cfg in ({}, dict(orientation="x64"))
                 if M != 8 or not cfg]
        cases += [(M, 4096, 14336, "block", {}) for M in (1, 32)]
        cases += [(M, 1024, 384, sc, dict(compute_warpgroups=2))
                  for M, sc in ((1, "block"), (8, "channel"), (32, "block"))]
        cases += [(5, 14336, 4096, "channel", {}), (8, 1024, 512, "block", dict(splits=1)),
                  (3, 1024, 512, "block", dict(block_k=64, stages=2)),
                  (32, 512, 256, "channel", dict(block_n=64))]
        ok = check(cases, key)
        print(f"checks {'passed' if ok else 'FAILED'} ({time.perf_counter() - t_start:.0f} s)",
              flush=True)

    results, rows = {}, []
    weights = {}

    def fp8_sets(K, N, scales):
        if (K, N, scales) not in weights:
            weights[(K, N, scales)] = [jax.block_until_ready(quantize(
                (0.02 * jax.random.normal(jax.random.fold_in(key, 100 + i), (K, N)))
                .astype(jnp.bfloat16), (128, 128) if scales == "block" else (K, 1)))
                for i in range(SETS)]
        return weights[(K, N, scales)]

    def run(K, N, M, label, cfg):
        xs = [jax.random.normal(jax.random.fold_in(key, 300 + i), (M, K)).astype(jnp.bfloat16)
              for i in range(SETS)]
        try:
            if label in ("mosaic-kernel", "mosaic-reads", "mosaic-launch"):
                from pallas_kernels.fp8_matmul.mosaic import (mosaic_config, mosaic_operands,
                                                              mosaic_partials)
                ws = fp8_sets(K, N, "block")
                floor, err = ws[0].nbytes / bw, float("nan")
                kcfg = dict(mosaic_config(M, K, N, ws[0].block, **cfg),
                            probe={"mosaic-reads": "loads", "mosaic-launch": "launch"}.get(label))
                ops = [mosaic_operands(x, w.scale, block_scales=True,
                                       orientation=kcfg["orientation"]) for x, w in zip(xs, ws)]
                xs = jax.block_until_ready([o[0] for o in ops])
                ws = [(w.values, o[1]) for w, o in zip(ws, ops)]
                fn = jax.jit(lambda xs, ws, kcfg=kcfg: [
                    mosaic_partials(x, v, s, **kcfg, **INTERPRET) for x, (v, s) in zip(xs, ws)])
            elif label == "xla-bf16":
                ws = [jax.random.normal(jax.random.fold_in(key, 200 + i), (K, N), jnp.bfloat16)
                      for i in range(SETS)]
                floor, err = ws[0].nbytes / bw, float("nan")
                fn = jax.jit(lambda xs, ws: [x @ w for x, w in zip(xs, ws)])
            else:
                cfg = dict(cfg)
                scales = cfg.pop("scales", "block")
                ws = fp8_sets(K, N, scales)
                floor = ws[0].nbytes / bw
                call = _mosaic if label == "mosaic" else _triton
                one = jax.jit(lambda x, w, cfg=cfg: call(x, w, **cfg))
                err = max_rel_err(one, xs[0], ws[0])
                fn = jax.jit(lambda xs, ws, cfg=cfg: [call(x, w, **cfg) for x, w in zip(xs, ws)])
                if not err < TOLERANCE:
                    print(f"  {label} {_name(cfg)} K={K} N={N} M={M}: max rel err {err:.2e}"
                          "   <<<<<< FAIL", flush=True)
            t = pipelined_wall(fn, (xs, ws), 20) / SETS
        except Exception as e:
            print(f"  {label} {_name(cfg)} K={K} N={N} M={M}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:300] if str(e) else ''}", flush=True)
            traceback.print_exc(limit=3)
            return
        base = results.get((K, N, M, "xla-bf16"))
        row = dict(K=K, N=N, M=M, variant=label, config=_name(cfg), us=t * 1e6,
                   floor_us=floor * 1e6, x_floor=t / floor, err=err,
                   vs_bf16=(base / t) if base else None)
        rows.append(row)
        results.setdefault((K, N, M, label), t)
        print(f"| {K} x {N} | {M} | {label} | {_name(cfg)} | {t * 1e6:.1f} | {t / floor:.2f} | "
              f"{row['vs_bf16'] or 0:.2f}x | {err:.1e} |", flush=True)

    print("| K x N | tokens | variant | config | us | x floor | vs bf16 | max rel err |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    first, rest_lists = [], []
    for K, N in shapes:
        for M in tokens:
            first += [(K, N, M, "xla-bf16", {}), (K, N, M, "mosaic", {}),
                      (K, N, M, "mosaic-kernel", {}),
                      (K, N, M, "mosaic-kernel", dict(compute_warpgroups=2)),
                      (K, N, M, "tiles", {}), (K, N, M, "stream", dict(variant="stream"))]
            if M == tokens[0]:        # the TMA pipeline's loads alone: its ceiling
                first += [(K, N, M, "mosaic-reads", {}), (K, N, M, "mosaic-launch", {})]
            rest_lists.append([(K, N, M, "mosaic", dict(compute_warpgroups=2))]
                              + [(K, N, M, v, c) for c in mosaic_configs(M)
                                 for v in ("mosaic-kernel", "mosaic")]
                              + ([(K, N, M, "mosaic-reads", dict(stages=s)) for s in (2, 6)]
                                 if M == tokens[0] else [])
                              + [(K, N, M, "mosaic", dict(scales="channel"))])
    # variations round-robin over shapes and token counts: a spent budget cuts the least
    # telling variation of each, not a whole shape
    rest = [r[j] for j in range(max(map(len, rest_lists))) for r in rest_lists if j < len(r)]
    order = first + rest
    for i, (K, N, M, label, cfg) in enumerate(order):
        if i >= len(first) and time.perf_counter() - t_start > a.budget_s:
            print(f"  budget of {a.budget_s:.0f} s spent: {len(order) - i} configs not run",
                  flush=True)
            break
        run(K, N, M, label, cfg)

    print(f"\nfloor = weight bytes / {bw / 1e12:.3f} TB/s; best of each variant "
          f"({time.perf_counter() - t_start:.0f} s in all); checks "
          f"{'passed' if ok else 'FAILED'}\n"
          "| K x N | tokens | variant | best config | us | x floor | vs bf16 |\n"
          "|---|---|---|---|---|---|---|")
    best = {}
    for r in rows:
        k = (r["K"], r["N"], r["M"], r["variant"])
        if k not in best or r["us"] < best[k]["us"]:
            best[k] = r
    for r in best.values():
        base = results.get((r["K"], r["N"], r["M"], "xla-bf16"))
        print(f"| {r['K']} x {r['N']} | {r['M']} | {r['variant']} | {r['config']} | "
              f"{r['us']:.1f} | {r['x_floor']:.2f} | {base / (r['us'] / 1e6):.2f}x |"
              if base else f"| {r['K']} x {r['N']} | {r['M']} | {r['variant']} | "
              f"{r['config']} | {r['us']:.1f} | {r['x_floor']:.2f} | |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fp8_mosaic.json"), "w") as f:
            json.dump(dict(copy_Bps=bw, checks_ok=ok, rows=rows), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
