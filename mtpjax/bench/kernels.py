"""Benchmarks of the mtpjax Pallas kernels against peers measured in the same run.

    python -m mtpjax.bench.kernels [--mode full|tune|check] [--out DIR] [--quick]

Prints one table per kernel: median time, TB/s (TFLOP/s for prefill), % of the
device-to-device copy bandwidth measured in this run, and peers on the same shapes:
JAX's `pallas.ops.gpu.paged_attention` (decode, Q=1), cuDNN through
`jax.nn.dot_product_attention(implementation="cudnn")` on dense KV, and the plain
XLA reference. Times are marginal per call: jits of 32 and of 8 independent calls
(distinct q per call, so nothing is CSE'd), medians of repeats after warmup,
(t(32) - t(8)) / 24 (see `timeit`); `*_r8` columns are the older t(8) / 8.
GPU only (uses Triton-compiled Pallas kernels).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                   ragged_paged_attention_reference)

REPS_IN_JIT = 32  # distinct inputs made per case; timeit uses n and n // 4 of them
LOG = []
LAST = {}  # LAST["single"]: the previous method's t(n // 4) / (n // 4) of the last timeit


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG.append(s)
    print(s, flush=True)


def _median_wall(multi, qs, rest, repeats):
    jax.block_until_ready(multi(qs, *rest))
    for _ in range(2):
        jax.block_until_ready(multi(qs, *rest))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(multi(qs, *rest))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _calls(fn, chain):
    """calls(qs, *rest) -> [fn(q, *rest) for q in qs], each q passed through chain(q, previous
    output) after the first when chain is given (`timeit`)."""
    def calls(qs, *rest):
        outs = []
        for q in qs:
            outs.append(fn(q if chain is None or not outs else chain(q, outs[-1]), *rest))
        return outs
    return calls


def gpu_kernel_events(fn, args, runs: int = 1) -> list:
    """[(start_ns, duration_ns, name)] of the GPU kernels of `runs` calls fn(*args) (after one
    untraced call), from the XLA profiler's CUPTI trace, sorted by start; [] off the GPU."""
    import glob
    import tempfile
    jax.block_until_ready(fn(*args))
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(runs):
        jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    files = glob.glob(d + "/**/*.xplane.pb", recursive=True)
    if not files:
        return []
    evs = []
    for plane in jax.profiler.ProfileData.from_file(files[0]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not is_compute_stream(line.name):
                continue
            evs += [(ev.start_ns, ev.duration_ns, ev.name) for ev in line.events]
    return sorted(evs)


def is_compute_stream(name: str) -> bool:
    """Is a GPU plane's line a stream that runs kernels? Streams are named by what ran on
    them, e.g. "Stream #14(Compute)", "Stream #15(MemcpyH2D)", and one that also copied device
    to device "Stream #14(Memset,Compute,MemcpyD2D)" (the MoE layer's prefill
    program: a filter on "memcpy" alone would drop its kernels)."""
    name = name.lower()
    return "stream" in name and ("compute" in name or "memcpy" not in name)


def chained_gpu_time(fn, qs, rest, compiler_options=None, chain=None, runs: int = 3):
    """GPU time per call of the len(qs) calls of `timeit` (chained alike) in one jit, from the
    kernels' own timestamps: {"span_us": first kernel's start to last kernel's end, "busy_us":
    summed kernel time, "kernels": kernel count}, each per call, of the run with the median
    span among `runs`; None off the GPU. Host dispatch and launch latency stay outside the
    span; the gaps between the calls' kernels are inside it, as a model's layers pay them.
    Steadier than `timeit`'s wall-clock difference at tens of microseconds per call (for one
    V2-Lite MoE token `timeit` varied by almost 2x across runs; the kernels' span did not)."""
    evs = gpu_kernel_events(jax.jit(_calls(fn, chain), compiler_options=compiler_options),
                            (qs, *rest), runs)
    if len(evs) < runs:
        return None
    span, busy, n = median_run(evs, runs)
    return {"span_us": span / len(qs), "busy_us": busy / len(qs), "kernels": n / len(qs)}


def median_run(evs: list, runs: int) -> tuple[float, float, int]:
    """(span us, busy us, kernel count) of the run with the median span, of `runs` back-to-back
    runs' kernel events [(start_ns, duration_ns, name)] sorted by start. The runs are
    separated by host synchronisation, so they are split at the runs - 1 widest gaps."""
    gap = lambda i: evs[i][0] - (evs[i - 1][0] + evs[i - 1][1])           # noqa: E731
    cuts = [0] + sorted(sorted(range(1, len(evs)), key=gap)[len(evs) - runs:]) + [len(evs)]
    per_run = sorted(((e[-1][0] + e[-1][1] - e[0][0]) / 1e3, sum(x[1] for x in e) / 1e3, len(e))
                     for e in (evs[a:b] for a, b in zip(cuts, cuts[1:])))
    return per_run[len(per_run) // 2]


def timeit(fn, qs, rest, repeats=15, compiler_options=None, chain=None):
    """Seconds per fn(q, *rest) call inside a long jitted program.

    With n = len(qs) >= 8 distinct inputs: one jit runs n calls, another n // 4
    calls, and the result is the marginal time per call,
    (t(n) - t(n // 4)) / (n - n // 4) (medians of `repeats` wall-clock runs). This
    cancels the fixed per-jit cost (host dispatch, first-launch and sync latency),
    which is ~0.3 ms on the H100 machine and used to be spread over only 8 calls
    (the older method: t(8) / 8). It keeps the gaps between consecutive
    kernels, which a real step pays too. With n < 8 (slow XLA references), or when noise
    makes the difference <= 0: t(n) / n.
    compiler_options: XLA options of the jit (bench.moe passes the model's step options: its
    calls share one weight, and XLA's dot merger would otherwise fuse them into one dot).
    chain: None (independent calls), or chain(q, previous output) -> the q a call runs, so
    each call waits for the one before, as a model's layers do (bench.moe: with independent
    calls XLA interleaves the calls' layout ops, and the MoE layer's gather combine read
    much slower at 256 V2-Lite tokens than the same layer chained).
    """
    multi = jax.jit(_calls(fn, chain), compiler_options=compiler_options)
    out = multi(qs, *rest)
    jax.block_until_ready(out)
    t_n = _median_wall(multi, qs, rest, repeats)
    if len(qs) < 8:
        return t_n / len(qs), out[0]
    n1 = len(qs) // 4
    t_1 = _median_wall(multi, qs[:n1], rest, repeats)
    LAST["single"] = t_1 / n1
    marginal = (t_n - t_1) / (len(qs) - n1)
    # Noise larger than the calls themselves (a loaded 2-core CI machine) can make the
    # difference <= 0; the whole-jit average is then the honest (upper-bound) figure.
    return (marginal if marginal > 0 else t_n / len(qs)), out[0]


def copy_bandwidth():
    """Device-to-device copy bandwidth (bytes read + written per second).

    Two measurements, the larger is the reference: XLA `x + 1` over 4 x 256 MiB bf16
    buffers in one jit, and (if PyTorch with CUDA is importable) `dst.copy_(src)`
    of 1 GiB timed with CUDA events.
    """
    res = {}
    xs = [jax.random.normal(jax.random.key(i), (1 << 27,), jnp.bfloat16) for i in range(4)]
    f = jax.jit(lambda xs: [x + jnp.bfloat16(1) for x in xs])
    jax.block_until_ready(f(xs))
    ts = []
    for _ in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(f(xs))
        ts.append(time.perf_counter() - t0)
    res["xla_add"] = 2 * sum(x.nbytes for x in xs) / float(np.median(ts))
    del xs
    try:
        import torch
        if torch.cuda.is_available():
            src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            for _ in range(3):
                dst.copy_(src)
            times = []
            for _ in range(20):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dst.copy_(src)
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e-3)
            res["torch_copy"] = 2 * src.numel() * 2 / float(np.median(times))
            del src, dst
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        log("torch copy failed", repr(e)[:200])
    return max(res.values()), res


def matmul_rate(n=8192, reps=4, clock="wall"):
    """bf16 matrix-multiply FLOP/s: one jit of `reps` independent n^3 products (random).
    clock "wall": host wall time of the jit (its ~0.25 ms fixed dispatch and sync cost
    included); "gpu": the kernels' own span (`gpu_kernel_events`; wall off the GPU), the clock
    of `chained_gpu_time` and of the copy bandwidth's CUDA events."""
    if clock not in ("wall", "gpu"):
        raise ValueError(f"clock must be 'wall' or 'gpu', got {clock!r}")
    ks = jax.random.split(jax.random.key(7), 2 * reps)
    xs = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in ks]
    f = jax.jit(lambda xs: [xs[2 * i] @ xs[2 * i + 1] for i in range(reps)])
    if clock == "gpu":
        evs = gpu_kernel_events(f, (xs,), runs=3)
        if len(evs) >= 3:
            return 2 * n ** 3 * reps / (median_run(evs, 3)[0] * 1e-6)
    return 2 * n ** 3 * reps / _median_wall(f, xs, (), repeats=10)


def rel_err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def make_paged(key, b, q_len, h, kvh, d, ctx, page=16, dtype=jnp.bfloat16, extra_pages=8):
    """Random KV cache with permuted block tables; every request has kv_len = ctx."""
    m = ctx // page
    p = b * m + extra_pages
    ks = jax.random.split(key, 4)
    k_pages = jax.random.normal(ks[0], (kvh, p, page, d), dtype)
    v_pages = jax.random.normal(ks[1], (kvh, p, page, d), dtype)
    bt = jax.random.permutation(ks[2], p)[: b * m].reshape(b, m).astype(jnp.int32)
    kv_lens = jnp.full((b,), ctx, jnp.int32)
    qs = [jax.random.normal(k, (b, q_len, h, d), dtype)
          for k in jax.random.split(ks[3], REPS_IN_JIT)]
    return qs, k_pages, v_pages, bt, kv_lens


def dense_kv(k_pages, bt):
    kvh, _, page, d = k_pages.shape
    b, m = bt.shape
    return jnp.transpose(k_pages[:, bt].reshape(kvh, b, m * page, d), (1, 2, 0, 3))


def time_decode(b, q_len, h, kvh, ctx, copy_bw, peers=True, **tuning):
    d = 128
    qs, kp, vp, bt, kl = make_paged(jax.random.key(b * 7 + ctx + q_len), b, q_len, h, kvh, d, ctx)
    kv_bytes = 2 * b * ctx * kvh * d * 2
    row = dict(B=b, Q=q_len, H=h, KVH=kvh, ctx=ctx)
    t, out = timeit(functools.partial(paged_attention, **tuning), qs, (kp, vp, bt, kl))
    row["ours_us"] = t * 1e6
    row["ours_us_r8"] = LAST["single"] * 1e6
    row["ours_TBs"] = kv_bytes / t / 1e12
    row["ours_pct_copy"] = 100 * kv_bytes / t / copy_bw
    row["floor_us"] = kv_bytes / copy_bw * 1e6
    if not peers:
        return row
    try:
        ref = paged_attention_reference(qs[0], kp, vp, bt, kl)
        row["err"] = rel_err(out, ref)
        t, _ = timeit(paged_attention_reference, qs[:2], (kp, vp, bt, kl), repeats=5)
        row["xla_us"] = t * 1e6
    except Exception as e:  # noqa: BLE001  (OOM on the biggest shapes)
        row["xla_us"] = float("nan")
        log("xla ref failed", row, repr(e)[:200])
    if q_len == 1:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
        best = float("inf")
        m = bt.shape[1]
        for ks_, ppcb in ((16, 8), (8, 8), (4, 16), (1, 16)):
            if m % ks_ or (m // ks_) % min(ppcb, m // ks_):
                continue
            try:
                f = functools.partial(jax_pa.paged_attention, k_splits=ks_,
                                      pages_per_compute_block=ppcb)
                t, _ = timeit(lambda q, *r: f(q[:, 0], *r), qs, (kp, vp, bt, kl), repeats=7)
                if t < best:
                    best, best_r8 = t, LAST["single"]
            except Exception as e:  # noqa: BLE001
                log("jax paged_attention failed", ks_, ppcb, repr(e)[:200])
        row["jax_pa_us"] = best * 1e6
        row["speedup_vs_jax"] = best / (row["ours_us"] * 1e-6)
        row["speedup_vs_jax_r8"] = best_r8 / (row["ours_us_r8"] * 1e-6)
    try:
        kd, vd = dense_kv(kp, bt), dense_kv(vp, bt)
        f = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
        t, _ = timeit(lambda q, k, v: f(q, k, v), qs, (kd, vd), repeats=7)
        row["cudnn_us"] = t * 1e6
        del kd, vd
    except Exception as e:  # noqa: BLE001
        row["cudnn_us"] = float("nan")
        log("cudnn failed", repr(e)[:300])
    return row


def make_ragged(key, q_lens, kv_lens, h=32, kvh=8, d=128, page=16, dtype=jnp.bfloat16):
    s = len(q_lens)
    m = max(-(-k // page) for k in kv_lens)
    p = s * m + 8
    ks = jax.random.split(key, 4)
    kp = jax.random.normal(ks[0], (kvh, p, page, d), dtype)
    vp = jax.random.normal(ks[1], (kvh, p, page, d), dtype)
    bt = jax.random.permutation(ks[2], p)[: s * m].reshape(s, m).astype(jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    t = int(sum(q_lens))
    qs = [jax.random.normal(k, (t, h, d), dtype) for k in jax.random.split(ks[3], REPS_IN_JIT)]
    return qs, kp, vp, bt, jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(s)


def causal_flops(q_lens, kv_lens, h, d):
    f = 0
    for ql, kl in zip(q_lens, kv_lens):
        f += sum(kl - ql + j + 1 for j in range(ql))
    return 4 * f * h * d


def time_prefill(n_chunks, chunk, h, kvh, copy_bw, peers=True, **tuning):
    d = 128
    q_lens = [chunk] * n_chunks
    args = make_ragged(jax.random.key(1), q_lens, q_lens, h, kvh, d)
    flops = causal_flops(q_lens, q_lens, h, d)
    row = dict(case=f"prefill {n_chunks}x{chunk}", H=h, KVH=kvh)
    t, out = timeit(functools.partial(ragged_paged_attention, **tuning), args[0], args[1:])
    row["ours_us"] = t * 1e6
    row["ours_us_r8"] = LAST["single"] * 1e6
    row["ours_TFLOPs"] = flops / t / 1e12
    if not peers:
        return row
    ref = ragged_paged_attention_reference(args[0][0], *args[1:])
    row["err"] = rel_err(out, ref)
    kd = dense_kv(args[1], args[3])
    vd = dense_kv(args[2], args[3])
    qd = [q.reshape(n_chunks, chunk, h, d) for q in args[0]]
    try:
        f = functools.partial(jax.nn.dot_product_attention, implementation="cudnn", is_causal=True)
        t, _ = timeit(lambda q, k, v: f(q, k, v), qd, (kd, vd))
        row["cudnn_us"] = t * 1e6
        row["cudnn_TFLOPs"] = flops / t / 1e12
        row["pct_of_cudnn"] = 100 * row["ours_TFLOPs"] / row["cudnn_TFLOPs"]
        row["pct_of_cudnn_r8"] = 100 * LAST["single"] / (row["ours_us_r8"] * 1e-6)
    except Exception as e:  # noqa: BLE001
        log("cudnn prefill failed", repr(e)[:300])
    f = functools.partial(jax.nn.dot_product_attention, implementation="xla", is_causal=True)
    t, _ = timeit(lambda q, k, v: f(q, k, v), qd[:2], (kd, vd), repeats=5)
    row["xla_dense_us"] = t * 1e6
    return row


def time_mixed(copy_bw, **tuning):
    """4 prefill chunks of 512 (fresh, kv 512) + 60 verify segments of 4 (kv 4096)."""
    h, kvh, d = 32, 8, 128
    q_lens = [512] * 4 + [4] * 60
    kv_lens = [512] * 4 + [4096] * 60
    args = make_ragged(jax.random.key(2), q_lens, kv_lens, h, kvh, d)
    t, out = timeit(functools.partial(ragged_paged_attention, **tuning), args[0], args[1:])
    ref = ragged_paged_attention_reference(args[0][0][2048:2048 + 40], args[1], args[2],
                                           args[3][4:14], args[4][4:14],
                                           args[5][4:15] - 2048, jnp.int32(10))
    row = dict(case="mixed 4x512 prefill + 60x4 verify (kv 4096)", ours_us=t * 1e6,
               err_verify_part=rel_err(out[2048:2088], ref))
    kv_bytes = 2 * 60 * 4096 * kvh * d * 2 + 2 * 4 * 512 * kvh * d * 2
    row["kv_TBs"] = kv_bytes / t / 1e12
    t2, _ = timeit(ragged_paged_attention_reference, args[0][:1], args[1:], repeats=3)
    row["xla_us"] = t2 * 1e6
    return row


def time_draft_roll(num_seg, seg_len, hd, n_new=4, dtype=jnp.bfloat16, copy_bw=None, **tuning):
    t = num_seg * seg_len
    key = jax.random.key(3)
    ks = jax.random.split(key, 8)
    tokens = jax.random.randint(ks[0], (t,), 0, 1000, jnp.int32)
    positions = jax.random.randint(ks[1], (t,), 0, 1000, jnp.int32)
    hiddens = [jax.random.normal(k, (t, hd), dtype) for k in jax.random.split(ks[2], REPS_IN_JIT)]
    lens = np.asarray(jax.random.randint(ks[3], (num_seg,), 1, 2 * seg_len))
    lens = (lens * t // lens.sum()).astype(np.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    nt = jax.random.randint(ks[4], (num_seg, n_new), 0, 1000, jnp.int32)
    npos = jax.random.randint(ks[5], (num_seg, n_new), 0, 1000, jnp.int32)
    nh = jax.random.normal(ks[6], (num_seg, n_new, hd), dtype)
    nn = jax.random.randint(ks[7], (num_seg,), 0, n_new + 1, jnp.int32)

    def ours(hid, *r):
        return draft_roll(r[0], r[1], hid, *r[2:], **tuning)

    def xla(hid, *r):
        return draft_roll_reference(r[0], r[1], hid, *r[2:])

    rest = (tokens, positions, cu, nt, npos, nh, nn)
    t1, o1 = timeit(ours, hiddens, rest)
    t1_r8 = LAST["single"]
    t2, o2 = timeit(xla, hiddens, rest)
    exact = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(o1, o2))
    nbytes = 2 * t * hd * jnp.dtype(dtype).itemsize
    return dict(case=f"draft_roll T={t} Hd={hd} S={num_seg}", ours_us=t1 * 1e6,
                xla_us=t2 * 1e6, ours_us_r8=t1_r8 * 1e6, xla_us_r8=LAST["single"] * 1e6,
                ours_TBs=nbytes / t1 / 1e12, pct_copy=100 * nbytes / t1 / copy_bw,
                exact=exact)


def table(title, rows, cols):
    log(f"\n## {title}")
    log("| " + " | ".join(cols) + " |")
    log("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        log("| " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="full", choices=["full", "tune", "check"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,8,64", help="decode batch sizes (full mode)")
    ap.add_argument("--no-extra", action="store_true",
                    help="full mode: decode table only (skip prefill, mixed, draft_roll)")
    a = ap.parse_args(argv)
    log(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    copy_bw, all_bw = copy_bandwidth()
    log("copy bandwidth (read+write) TB/s: "
        + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in all_bw.items())
        + f"; reference = {copy_bw / 1e12:.3f}")
    rows = {}
    if a.mode == "tune":
        res = []
        for b, q_len, ppb, splits, nw, st in (
            [(64, 1, ppb, 1, nw, st) for ppb in (4, 8, 16) for nw in (2, 4, 8) for st in (1, 2)]
            + [(64, 4, 8, 1, nw, st) for nw in (2, 4) for st in (1, 2)]):
            if True:
                if True:
                    try:
                        r = time_decode(b, q_len, 32, 8, 4096, copy_bw, peers=False,
                                        pages_per_block=ppb, num_warps=nw, num_stages=st,
                                        num_splits=splits)
                        r.update(ppb=ppb, ns=splits, nw=nw, st=st)
                        res.append(r)
                        log(json.dumps(r))
                    except Exception as e:  # noqa: BLE001
                        log("fail", b, q_len, splits, nw, st, repr(e)[:300])
        table("decode tuning ctx=4096 32/8", res,
              ["B", "Q", "ppb", "ns", "nw", "st", "ours_us", "ours_TBs", "ours_pct_copy"])
        res2 = []
        for bq in (16, 32):
            for ppb in (2, 4):
                for nw in (4,):
                    for st in (2, 3):
                        try:
                            r = time_prefill(4, 512, 32, 8, copy_bw, peers=False, block_q=bq,
                                             pages_per_block=ppb, num_warps=nw, num_stages=st)
                            r.update(bq=bq, ppb=ppb, nw=nw, st=st)
                            res2.append(r)
                            log(json.dumps(r))
                        except Exception as e:  # noqa: BLE001
                            log("fail prefill", bq, ppb, nw, st, repr(e)[:300])
        table("prefill tuning 4x512 32/8", res2,
              ["bq", "ppb", "nw", "st", "ours_us", "ours_TFLOPs"])
    else:
        dec = []
        bs = (64,) if a.mode == "check" else tuple(int(x) for x in a.batches.split(","))
        ctxs = (4096,) if a.mode == "check" else (1024, 4096, 16384)
        for b in bs:
            for ctx in ctxs:
                for h in (32, 64):
                    for q_len in (1, 2, 4):
                        try:
                            r = time_decode(b, q_len, h, 8, ctx, copy_bw)
                            dec.append(r)
                            log(json.dumps(r))
                        except Exception as e:  # noqa: BLE001
                            log("decode fail", b, ctx, h, q_len, traceback.format_exc()[-1500:])
        rows["decode"] = dec
        pre = []
        for h in (() if a.no_extra else (32, 64)):
            try:
                r = time_prefill(4, 512, h, 8, copy_bw)
                pre.append(r)
                log(json.dumps(r))
            except Exception:  # noqa: BLE001
                log("prefill fail", traceback.format_exc()[-1500:])
        try:
            if a.no_extra:
                raise RuntimeError("skipped")
            mixed = time_mixed(copy_bw)
            log(json.dumps(mixed))
        except Exception:  # noqa: BLE001
            mixed = {}
            log("mixed fail", traceback.format_exc()[-1500:])
        dr = []
        for ns, sl, hd in (() if a.no_extra else ((64, 8, 4096), (256, 16, 7168))):
            try:
                r = time_draft_roll(ns, sl, hd, copy_bw=copy_bw)
                dr.append(r)
                log(json.dumps(r))
            except Exception:  # noqa: BLE001
                log("draft_roll fail", traceback.format_exc()[-1500:])
        # Verify-vs-decode ratio on the same KV.
        by = {(r["B"], r["ctx"], r["H"], r["Q"]): r for r in dec}
        for r in dec:
            base = by.get((r["B"], r["ctx"], r["H"], 1))
            if base:
                r["t_over_Q1"] = r["ours_us"] / base["ours_us"]
        table("paged_attention (decode / verify), bf16, page 16, d 128, KVH 8", dec,
              ["B", "ctx", "H", "Q", "ours_us", "ours_us_r8", "ours_TBs", "ours_pct_copy",
               "floor_us", "t_over_Q1", "jax_pa_us", "speedup_vs_jax", "speedup_vs_jax_r8",
               "cudnn_us", "xla_us", "err"])
        table("ragged_paged_attention prefill (fresh 512-token chunks, causal)", pre,
              ["case", "H", "ours_us", "ours_us_r8", "ours_TFLOPs", "cudnn_us", "cudnn_TFLOPs",
               "pct_of_cudnn", "pct_of_cudnn_r8", "xla_dense_us", "err"])
        table("ragged_paged_attention mixed batch (H 32, KVH 8)", [mixed],
              ["case", "ours_us", "kv_TBs", "xla_us", "err_verify_part"])
        table("draft_roll (bf16)", dr, ["case", "ours_us", "xla_us", "ours_TBs", "pct_copy",
                                        "exact", "ours_us_r8", "xla_us_r8"])
    tag = a.mode + ("" if a.mode != "full" else "_b" + a.batches.replace(",", "-"))
    with open(os.path.join(a.out, f"bench_{tag}.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    sys.exit(main())
