"""MLA paged attention (absorbed form, DeepSeek-V3 dims) against its roofline floor and XLA.

    python -m mtpjax.bench.mla [--sections decode,verify,mixed] [--pages 64,16] [--heads 16,128]
                               [--sweep] [--variants "k=v,k=v;..."] [--budget-s 240] [--out DIR]
                               [--no-xla-peer] [--flashmla DIR [--flashmla-build DIR]]

Shapes: B=64 requests at context 4096, latent 576 = kv_lora_rank 512 + rope 64, bf16, random
inputs and randomly permuted block tables. Decode = q_len 1, verify = q_len 4 (causal inside
the row), mixed = prefill chunks + verify rows in one ragged call.

Floor (same run): max(bytes that must move / copy bandwidth, FLOPs / bf16 matmul rate), where
bytes = the latent pages each request reads once + q + output, FLOPs = 2 * H * (576 + 512) per
visible (query, key) pair; copy bandwidth = `mtpjax.bench.kernels.copy_bandwidth` (read +
written), matmul rate = an 8192^3 bf16 `jnp.dot` timed here by its kernels' span. Times, two
clocks: `gpu_us`, the GPU span per call of 32 independent calls in one jit, from the kernels'
own timestamps (`kernels.chained_gpu_time`; the gaps between the calls' kernels included):
the clock of the floor's bandwidth (CUDA events, or XLA's own span), so `x_floor_gpu` is the
ratio to the floor and ranks the variants; `us`, the host wall-clock marginal per call between
jits of 32 and 8 calls (`kernels.timeit`), which also holds host work that grows with the
program's calls before its first kernel starts (docs/benchmarks.md has both clocks). Peer: the
model's plain-jnp paged attention (the MLA route's reference,
`mtpjax.model.attention_routes.mla_reference`: what the MLA layer runs without the kernel) under
XLA. `--sweep` also times tuning variants (best shown, all in $OUT/mla.json). GPU only. The default variant runs the wrapper's default
kernel (the Mosaic-GPU one on Hopper); `--variants "kernel=triton"` adds the Triton kernel as
a same-run peer; `--sweep`'s variants are the Triton kernel's options and name it.
`--flashmla DIR` builds FlashMLA's SM90 dense decode kernel from a checkout and times it on
the same arrays in the page-64 decode and verify cases (`mtpjax.bench.flashmla_peer`;
`fm_gpu_us` by CUDA events over 32 back-to-back calls, `x_vs_fm` = ours / FlashMLA's).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.bench import kernels as kb
from pallas_kernels.mla_paged_attention import mla_paged_attention, mla_paged_attention_reference

RANK, ROPE = 512, 64
WIDTH = RANK + ROPE
ROWS = []
T0 = time.time()


def make_case(key, q_lens, kv_lens, h, page, dtype=jnp.bfloat16):
    """Random latent pages [P, S, 576], permuted block tables, REPS_IN_JIT distinct q's."""
    s = len(q_lens)
    m = max(-(-k // page) for k in kv_lens)
    p = s * m + 8
    ks = jax.random.split(key, 3)
    lat = jax.random.normal(ks[0], (p, page, WIDTH), dtype)
    bt = jax.random.permutation(ks[1], p)[: s * m].reshape(s, m).astype(jnp.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    t = int(sum(q_lens))
    qs = [jax.random.normal(k, (t, h, WIDTH), dtype)
          for k in jax.random.split(ks[2], kb.REPS_IN_JIT)]
    return qs, (lat, bt, jnp.asarray(kv_lens, jnp.int32), cu, jnp.int32(s))


def floor_of(q_lens, kv_lens, h, page, copy_bw, mm_rate):
    lat_bytes = sum(-(-k // page) * page for k in kv_lens) * WIDTH * 2   # whole pages
    t = sum(q_lens)
    nbytes = lat_bytes + t * h * (WIDTH + RANK) * 2
    pairs = sum(kl - ql + j + 1 for ql, kl in zip(q_lens, kv_lens) for j in range(ql))
    flops = 2 * h * (WIDTH + RANK) * pairs
    return dict(bytes=nbytes, flops=flops, t_bw_us=nbytes / copy_bw * 1e6,
                t_mm_us=flops / mm_rate * 1e6,
                floor_us=max(nbytes / copy_bw, flops / mm_rate) * 1e6)


def xla_peer(q_len, b):
    """The model's reference path on a uniform batch (what MLA runs today without a kernel)."""
    from mtpjax.cache import PagedBatch
    from mtpjax.model.attention_routes import mla_reference
    from mtpjax.model.mla import LatentPages

    def f(q, lat, bt, kv_lens, cu, n):
        pos = kv_lens[:, None] - q_len + jnp.arange(q_len)[None, :]
        batch = PagedBatch.uniform(pos, bt)
        return mla_reference(q, LatentPages(lat, RANK), batch, sm_scale=WIDTH ** -0.5)
    return f


def run_case(name, q_lens, kv_lens, h, page, copy_bw, mm_rate, variants, budget, peer=None,
             flashmla=None):
    qs, rest = make_case(jax.random.key(len(q_lens) * 7 + h + page), q_lens, kv_lens, h, page)
    fl = floor_of(q_lens, kv_lens, h, page, copy_bw, mm_rate)
    ref = mla_paged_attention_reference(qs[0], *rest, kv_lora_rank=RANK, token_chunk=16)
    best = None
    for i, tuning in enumerate(variants):
        if i > 0 and time.time() - T0 > budget:
            kb.log(f"budget reached: {name} skips {len(variants) - i} variants")
            break
        try:
            fn = functools.partial(mla_paged_attention, kv_lora_rank=RANK, **tuning)
            t, out = kb.timeit(fn, qs, rest)
            row = dict(case=name, H=h, page=page, var=json.dumps(tuning, sort_keys=True),
                       us=t * 1e6, err=kb.rel_err(out, ref), **fl)
            row["x_floor"] = row["us"] / fl["floor_us"]
            gpu = kb.chained_gpu_time(fn, qs, rest)
            if gpu is not None:
                row["gpu_us"] = gpu["span_us"]
                row["x_floor_gpu"] = gpu["span_us"] / fl["floor_us"]
            row["TBs"] = fl["bytes"] / _time(row) / 1e6
            row["TFLOPs"] = fl["flops"] / _time(row) / 1e6
            ROWS.append(row)
            kb.log(json.dumps(row))
            if best is None or _time(row) < _time(best):
                best = row
        except Exception:  # noqa: BLE001
            kb.log("fail", name, tuning, traceback.format_exc()[-1500:])
    if best is not None and peer is not None:
        try:
            t, out = kb.timeit(peer, qs[:2], rest, repeats=5)
            best["xla_us"] = t * 1e6
            gpu = kb.chained_gpu_time(peer, qs[:2], rest)
            if gpu is not None:
                best["xla_gpu_us"] = gpu["span_us"]
            best["xla_err"] = kb.rel_err(out, ref)
        except Exception:  # noqa: BLE001
            kb.log("xla peer failed", name, traceback.format_exc()[-800:])
    if best is not None and flashmla is not None:
        flashmla_row(best, flashmla, qs, rest, ref, q_lens)
    return best


def flashmla_row(best, module, qs, rest, ref, q_lens):
    """FlashMLA's time, ratio to the same floor, and error on this case's arrays, into the
    case's best row (`fm_gpu_us`, `fm_x_floor`, `fm_err`); `x_vs_fm` = our time / its."""
    from mtpjax.bench import flashmla_peer
    lat, bt, kv_lens = rest[:3]
    try:
        peer = flashmla_peer.Peer(module, qs, lat, bt, kv_lens, q_len=q_lens[0], rank=RANK,
                                  sm_scale=WIDTH ** -0.5)
        best["fm_err"] = kb.rel_err(jnp.asarray(peer(0).float().cpu().numpy()), ref)
        best["fm_gpu_us"] = peer.gpu_us()
        best["fm_x_floor"] = best["fm_gpu_us"] / best["floor_us"]
        best["x_vs_fm"] = _time(best) / best["fm_gpu_us"]
        kb.log("flashmla", best["case"], best["H"], json.dumps(
            {k: best[k] for k in ("fm_gpu_us", "fm_x_floor", "fm_err", "x_vs_fm")}))
    except Exception:  # noqa: BLE001
        kb.log("flashmla peer failed", best["case"], traceback.format_exc()[-1500:])


def _time(row):
    """The time a row is ranked by: GPU span when measured (the floor's clock), else wall."""
    return row.get("gpu_us", row["us"])


def parse_variants(text: str) -> list[dict]:
    """"k=v,k=v;k=v" -> [{k: v, ...}, ...] with int values ("None" -> None, other text as
    text: kernel=mosaic)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        d = {}
        for kv in part.split(","):
            k, _, v = kv.partition("=")
            if not v:
                raise ValueError(f"--variants entry {kv!r}: expected key=value")
            v = v.strip()
            d[k.strip()] = None if v == "None" else int(v) if v.lstrip("-").isdigit() else v
        out.append(d)
    return out


def variants_for(q_len, h, page, b, ctx, sweep, extra=()):
    # Decode and verify batches are uniform: every row passes uniform_q_len, as the model's
    # dispatch does (`attention_routes.mla_kernel`), so the Mosaic kernel's default takes its tiles
    # by reshape, with no gathers. `compact=0` times the gather path instead. (A default row without
    # uniform_q_len would time gathers the model never runs.)
    out = [dict(block_q=q_len, uniform_q_len=q_len, **e) for e in ({},) + tuple(extra)]
    if not sweep or (h > 16 and page != 64):
        return out
    if q_len == 1 and h <= 16:
        alt = [dict(block_k=32), dict(block_k=32, num_stages=2), dict(block_k=32, num_stages=3),
               dict(block_k=16, num_stages=3), dict(block_k=32, num_stages=2, num_warps=8),
               dict(block_k=32, num_stages=2, num_splits=8),
               dict(block_k=32, num_stages=2, num_splits=2)]
    elif q_len == 1:
        alt = [dict(num_stages=2), dict(num_stages=3), dict(block_k=32, num_stages=2),
               dict(block_k=32, num_stages=3)]
    elif h <= 16:
        alt = [dict(num_stages=2), dict(num_stages=3), dict(block_k=32, num_stages=2),
               dict(block_k=32, num_stages=3), dict(num_stages=2, num_splits=2),
               dict(num_stages=2, num_splits=8)]
    else:
        alt = [dict(num_stages=2), dict(num_stages=3), dict(block_k=32, num_stages=2)]
    return out + [dict(block_q=q_len, kernel="triton", **a) for a in alt]   # Triton options


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="decode,verify,mixed")
    ap.add_argument("--pages", default="64,16")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--variants", default="",
                    help='tuning variants timed in every decode/verify case beside the default, '
                         'e.g. "value_split=2,qk_chunk=128;value_split=2,num_stages=2"')
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="after this many seconds, time only each case's default variant")
    ap.add_argument("--no-xla-peer", action="store_true",
                    help="skip the plain-jnp peer (slow at H=128): kernel rows only")
    ap.add_argument("--flashmla", default="",
                    help="a deepseek-ai/FlashMLA checkout (with csrc/cutlass): builds its SM90 "
                         "dense decode kernel and times it as a peer on the page-64 cases")
    ap.add_argument("--flashmla-build", default=os.path.join(tempfile.gettempdir(),
                                                             "mtpjax_flashmla_build"),
                    help="FlashMLA's build directory (kept between runs on one machine)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    fm_module = None
    if a.flashmla:
        from mtpjax.bench import flashmla_peer
        t0 = time.time()        # build() checks the checkout before it compiles anything
        fm_module = flashmla_peer.build(a.flashmla, a.flashmla_build)
        kb.log(f"FlashMLA built in {time.time() - t0:.0f} s")
    extra = parse_variants(a.variants)
    kb.log(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    copy_bw, all_bw = kb.copy_bandwidth()
    mm = kb.matmul_rate(clock="gpu")
    kb.log(f"copy TB/s (read+write): {', '.join(f'{k} {v / 1e12:.3f}' for k, v in all_bw.items())}"
           f"; bf16 matmul TFLOP/s: {mm / 1e12:.0f}")
    secs = a.sections.split(",")
    b, ctx = a.batch, a.ctx
    best = []
    for q_len, sec in ((1, "decode"), (4, "verify")):
        if sec not in secs:
            continue
        for h in (int(x) for x in a.heads.split(",")):
            for page in (int(x) for x in a.pages.split(",")):
                peer = xla_peer(q_len, b) if page == 64 and not a.no_xla_peer else None
                r = run_case(f"{sec} q{q_len}", [q_len] * b, [ctx] * b, h, page, copy_bw, mm,
                             variants_for(q_len, h, page, b, ctx, a.sweep, extra),
                             a.budget_s, peer, fm_module if page == 64 else None)
                if r:
                    best.append(r)
    if "mixed" in secs:
        # 4 prefill chunks of 512 tokens (the last 512 of 2048) + 32 verify rows of 4 (ctx 4096).
        q_lens = [512] * 4 + [4] * 32
        kv_lens = [2048] * 4 + [ctx] * 32
        for h in (int(x) for x in a.heads.split(",")):
            vs = [dict(block_q=4), dict(block_q=8)] if a.sweep else [dict(block_q=4)]
            vs += [dict(block_q=4, **e) for e in extra]
            r = run_case("mixed 4x512/2048 + 32x4", q_lens, kv_lens, h, 64, copy_bw, mm, vs,
                         a.budget_s)
            if r:
                best.append(r)
    by = {(r["case"], r["H"], r["page"]): r for r in best}
    for r in best:
        if r["case"].startswith("verify"):
            d = by.get(("decode q1", r["H"], r["page"]))
            if d:
                r["t_over_q1"] = _time(r) / _time(d)
    os.makedirs(a.out, exist_ok=True)            # a missing --out folder lost a whole run's table
    with open(os.path.join(a.out, "mla.json"), "w") as f:
        json.dump(dict(copy_bw=copy_bw, mm_rate=mm, rows=ROWS, best=best), f, indent=1)
    with open(os.path.join(a.out, "mla.log"), "w") as f:
        f.write("\n".join(kb.LOG) + "\n")
    kb.table(f"MLA paged attention, B={b} ctx={ctx}, 576/512, bf16 (best variant per case); "
             f"copy {copy_bw / 1e12:.2f} TB/s, matmul {mm / 1e12:.0f} TFLOP/s", best,
             ["case", "H", "page", "gpu_us", "x_floor_gpu", "us", "x_floor", "floor_us",
              "t_bw_us", "t_mm_us", "TBs", "TFLOPs", "t_over_q1", "xla_gpu_us", "xla_us",
              "fm_gpu_us", "fm_x_floor", "x_vs_fm", "fm_err", "err", "var"])


if __name__ == "__main__":
    sys.exit(main())
