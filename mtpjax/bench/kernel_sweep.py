"""Targeted sweeps for the kernel targets (one device call; GPU only).

    python3 -m mtpjax.bench.kernel_sweep --out $OUT [--sections decode,verify,prefill,roll]
    python3 -m mtpjax.bench.kernel_sweep --ncu-target 1,32   # decode launches, for ncu
    ncu --profile-from-start off ... python3 -m mtpjax.bench.kernel_sweep \
        --ncu-target prefill:64,cudnn:64,roll,roll_xla   # one call of each, see ncu_target

Same timing method as `mtpjax.bench.kernels` (marginal time per call between
jits of 32 and 8 independent calls; `us_r8` = the pre-round-2 method, t(8) / 8), same inputs
(random, permuted block tables). Every variant's output is compared with the jnp reference
(`err`) or with the XLA path bit for bit (`exact`). Prints one short table last; the JSON
rows go to $OUT/sweep.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import traceback

import jax
import jax.numpy as jnp

from mtpjax.bench import kernels as bench
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

ROWS = []


def add(row):
    ROWS.append(row)
    bench.log(json.dumps(row))


def decode_variants(copy_bw, b, q_len, h, ctx, variants, jax_peer=False):
    kvh, d = 8, 128
    qs, kp, vp, bt, kl = bench.make_paged(jax.random.key(b * 7 + ctx + q_len), b, q_len, h, kvh,
                                          d, ctx)
    kv_bytes = 2 * b * ctx * kvh * d * 2
    ref = paged_attention_reference(qs[0], kp, vp, bt, kl)
    for name, tuning in variants:
        try:
            t, out = bench.timeit(functools.partial(paged_attention, **tuning), qs,
                                  (kp, vp, bt, kl))
            add(dict(sec="decode", B=b, Q=q_len, H=h, ctx=ctx, var=name, us=t * 1e6,
                     us_r8=bench.LAST["single"] * 1e6, pct_copy=100 * kv_bytes / t / copy_bw,
                     err=bench.rel_err(out, ref)))
        except Exception:  # noqa: BLE001
            bench.log("fail", name, traceback.format_exc()[-1200:])
    if jax_peer:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
        m = bt.shape[1]
        for ks_, ppcb in ((16, 8), (8, 8), (4, 16), (1, 16)):
            if m % ks_ or (m // ks_) % min(ppcb, m // ks_):
                continue
            f = functools.partial(jax_pa.paged_attention, k_splits=ks_,
                                  pages_per_compute_block=ppcb)
            t, _ = bench.timeit(lambda q, *r: f(q[:, 0], *r), qs, (kp, vp, bt, kl), repeats=7)
            add(dict(sec="decode", B=b, Q=q_len, H=h, ctx=ctx, var=f"jax_pa ks{ks_} ppcb{ppcb}",
                     us=t * 1e6, pct_copy=100 * kv_bytes / t / copy_bw))


def sec_decode(copy_bw):
    v = [("default", {}),
         ("old path (search+memset)", dict(direct_items=False)),
         ("ppb2", dict(pages_per_block=2)), ("ppb8", dict(pages_per_block=8)),
         ("nw2", dict(num_warps=2)), ("nw8", dict(num_warps=8)),
         ("ppb8 nw8", dict(pages_per_block=8, num_warps=8)),
         ("ppb2 nw2", dict(pages_per_block=2, num_warps=2)),
         ("splits2", dict(num_splits=2))]
    decode_variants(copy_bw, 64, 1, 32, 4096, v, jax_peer=True)
    for ctx in (1024, 2048, 8192, 16384):
        decode_variants(copy_bw, 64, 1, 32, ctx, [("default", {})])
    decode_variants(copy_bw, 32, 1, 32, 8192, [("default", {})])
    decode_variants(copy_bw, 128, 1, 32, 2048, [("default", {})])


def sec_verify(copy_bw):
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention

    def split_items(q, kp, vp, bt, kl, **tuning):
        # Q=4 as two 2-token items per request (16-row tiles at G=8) via the ragged path.
        b, q_len, h, d = q.shape
        cu = jnp.arange(b + 1, dtype=jnp.int32) * q_len
        out = ragged_paged_attention(q.reshape(b * q_len, h, d), kp, vp, bt, kl, cu,
                                     jnp.int32(b), **tuning)
        return out.reshape(q.shape)

    decode_variants(copy_bw, 64, 1, 64, 4096, [("default", {})])
    decode_variants(copy_bw, 64, 4, 64, 4096, [
        ("default", {}), ("ppb2", dict(pages_per_block=2)),
        ("st2", dict(num_stages=2)), ("ppb8 nw8", dict(pages_per_block=8, num_warps=8))])
    global paged_attention
    keep = paged_attention
    paged_attention = split_items
    try:
        decode_variants(copy_bw, 64, 4, 64, 4096, [
            ("2 items of 2 tokens", dict(small_q=2, block_q=2, pages_per_block=4, num_stages=1))])
    finally:
        paged_attention = keep


def sec_prefill(copy_bw):
    for bq, ppb, nw, st in ((8, 4, 4, 2), (8, 4, 4, 3), (16, 4, 4, 3), (16, 2, 4, 3),
                            (8, 8, 4, 2), (8, 8, 8, 2), (8, 4, 4, 1)):
        try:
            r = bench.time_prefill(4, 512, 64, 8, copy_bw, peers=False, block_q=bq,
                                   pages_per_block=ppb, num_warps=nw, num_stages=st)
            r.update(sec="prefill", var=f"bq{bq} ppb{ppb} nw{nw} st{st}")
            add(r)
        except Exception:  # noqa: BLE001
            bench.log("fail prefill", bq, ppb, nw, st, traceback.format_exc()[-800:])


def sec_roll(copy_bw):
    cfgs = [(4, 1024, 1, 4), (4, 1024, 1, 8), (4, 512, 1, 4), (2, 1024, 1, 4), (2, 512, 1, 2),
            (2, 2048, 1, 8), (4, 2048, 1, 8), (8, 1024, 1, 8), (1, 1024, 1, 4)]
    for bt_, bh, hl, nw in cfgs:
        try:
            r = bench.time_draft_roll(256, 16, 7168, copy_bw=copy_bw, block_t=bt_, block_h=bh,
                                      h_loop=hl, num_warps=nw)
            r.update(sec="roll", var=f"bt{bt_} bh{bh} hl{hl} nw{nw}")
            add(r)
        except Exception:  # noqa: BLE001
            bench.log("fail roll", bt_, bh, hl, nw, traceback.format_exc()[-800:])


def _marginal(fn, qs, rest):
    """Returns once(repeats): marginal seconds per call, as bench.timeit, but with the
    two jits built once so that variants can be timed in interleaved rounds."""
    multi = jax.jit(lambda qs, *rest: [fn(q, *rest) for q in qs])
    n, n1 = len(qs), len(qs) // 4
    jax.block_until_ready(multi(qs, *rest))
    jax.block_until_ready(multi(qs[:n1], *rest))

    def once(repeats=15):
        t_n = bench._median_wall(multi, qs, rest, repeats)
        t_1 = bench._median_wall(multi, qs[:n1], rest, repeats)
        return (t_n - t_1) / (n - n1)
    return once


def _rounds(group, variants, rounds=3, **extra):
    """Times the variants in `rounds` interleaved rounds (A B C A B C ...)."""
    ts = {name: [] for name in variants}
    for _ in range(rounds):
        for name, once in variants.items():
            ts[name].append(once() * 1e6)
    for name, v in ts.items():
        v = sorted(v)
        add(dict(sec="final", case=group, var=name, us=v[len(v) // 2], us_min=v[0], us_max=v[-1],
                 **extra))


def sec_final(copy_bw):
    """Target comparisons, each variant timed in 3 interleaved rounds (median, min, max)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    # 1. decode B=64 ctx 4k 32/8 vs JAX's Pallas paged_attention.
    qs, kp, vp, bt, kl = bench.make_paged(jax.random.key(11), 64, 1, 32, 8, 128, 4096)
    rest = (kp, vp, bt, kl)
    v = {"ours": _marginal(paged_attention, qs, rest)}
    for ks_, ppcb in ((4, 16), (1, 16), (8, 8)):
        f = functools.partial(jax_pa.paged_attention, k_splits=ks_, pages_per_compute_block=ppcb)
        v[f"jax_pa ks{ks_} ppcb{ppcb}"] = _marginal(lambda q, *r, f=f: f(q[:, 0], *r), qs, rest)
    _rounds("decode B64 4k 32/8 Q1", v, floor_us=2 * 64 * 4096 * 8 * 128 * 2 / copy_bw * 1e6)


def sec_final_q4(copy_bw):
    # 2. 64/8: Q=4 vs Q=1 on the same KV.
    qs1, kp, vp, bt, kl = bench.make_paged(jax.random.key(12), 64, 1, 64, 8, 128, 4096)
    qs4 = [jax.random.normal(k, (64, 4, 64, 128), jnp.bfloat16)
           for k in jax.random.split(jax.random.key(13), len(qs1))]
    rest = (kp, vp, bt, kl)
    ref = paged_attention_reference(qs4[0], *rest)
    bench.log("Q4 default err", bench.rel_err(paged_attention(qs4[0], *rest), ref))
    v = {"Q1 default": _marginal(paged_attention, qs1, rest),
         "Q4 default": _marginal(paged_attention, qs4, rest),
         "Q4 ppb4 nw4 (round-1 default)": _marginal(
             functools.partial(paged_attention, pages_per_block=4, num_warps=4), qs4, rest)}
    _rounds("decode B64 4k 64/8", v)


def sec_final_roll(copy_bw):
    from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
    # 3. draft_roll T=4096 Hd=7168 vs XLA.
    t, hd, ns = 4096, 7168, 256
    ks = jax.random.split(jax.random.key(3), 8)
    hiddens = [jax.random.normal(k, (t, hd), jnp.bfloat16) for k in jax.random.split(ks[2], 32)]
    lens = jax.random.randint(ks[3], (ns,), 1, 32)
    lens = (lens * t // lens.sum()).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens).astype(jnp.int32)])
    rest = (jax.random.randint(ks[0], (t,), 0, 1000, jnp.int32),
            jax.random.randint(ks[1], (t,), 0, 1000, jnp.int32), cu,
            jax.random.randint(ks[4], (ns, 4), 0, 1000, jnp.int32),
            jax.random.randint(ks[5], (ns, 4), 0, 1000, jnp.int32),
            jax.random.normal(ks[6], (ns, 4, hd), jnp.bfloat16),
            jax.random.randint(ks[7], (ns,), 0, 5, jnp.int32))

    def roll(f, **kw):
        return lambda h, *r: f(r[0], r[1], h, *r[2:], **kw)
    v = {"ours bt4 bh1024 (default)": _marginal(roll(draft_roll), hiddens, rest),
         "ours bt2 bh1024": _marginal(roll(draft_roll, block_t=2), hiddens, rest),
         "xla": _marginal(roll(draft_roll_reference), hiddens, rest)}
    _rounds("draft_roll T4096 Hd7168", v, floor_us=2 * t * hd * 2 / copy_bw * 1e6)


def _ragged_variant(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                    tail):
    """The prefill path of `ragged_paged_attention` at default tuning, for A/B timing:
    tail=False is the older zero-filled output buffer (no tail items)."""
    from pallas_kernels._paged_core import pad_group, paged_core, unpad_group
    from pallas_kernels.ragged_paged_attention.ragged_paged_attention import _work_items
    t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    g_p = 1 << (h // kvh - 1).bit_length()
    s = block_tables.shape[0]
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    qp = pad_group(q, kvh)
    common = dict(group=h // kvh, sm_scale=1.0 / d ** 0.5, soft_cap=None, interpret=False)
    tb = jnp.stack([jnp.clip(cu_q_lens[jnp.minimum(num_seqs, s)], 0, t), jnp.int32(t)])
    ends, w_max = _work_items(q_lens, t, 64 // g_p, q_lens > 8)
    out = paged_core(qp, k_pages, v_pages, block_tables, kv_lens, q_lens, cu_q_lens, ends,
                     w_max + 1, block_q=64 // g_p, pages_per_block=64 // page_size, num_splits=1,
                     num_warps=4, num_stages=2, tail_bounds=tb if tail else None, **common)
    ends, _ = _work_items(q_lens, t, 8, q_lens <= 8)
    out = paged_core(qp, k_pages, v_pages, block_tables, kv_lens, q_lens, cu_q_lens, ends,
                     min(s, t), block_q=8, pages_per_block=64 // page_size, num_splits=1,
                     num_warps=4, num_stages=1, out_init=out, **common)
    return unpad_group(out, h)


def sec_final_roll_chain(copy_bw):
    """draft_roll T=4096 Hd=7168 as a dependent chain: call i rolls call i-1's output,
    so XLA cannot fuse the calls horizontally into one kernel (it does with the 32
    independent calls of sec_final_roll: ncu shows one loop_select_fusion for all 32
    reference calls). Marginal time per call, (t(32) - t(8)) / 24, 3 interleaved rounds."""
    from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
    args = _roll_inputs()
    tok, pos, h0, rest = args[0], args[1], args[2], args[3:]

    def chain(f, n):
        def run(tok, pos, h, *rest):
            for _ in range(n):
                tok, pos, h = f(tok, pos, h, *rest)
            return tok, pos, h
        return jax.jit(run)

    def once_for(f):
        long, short = chain(f, 32), chain(f, 8)
        for g in (long, short):
            jax.block_until_ready(g(tok, pos, h0, *rest))

        def once(repeats=15):
            wrap = lambda g: (lambda qs, *r: g(*qs, *r))  # noqa: E731
            t_n = bench._median_wall(wrap(long), (tok, pos, h0), rest, repeats)
            t_1 = bench._median_wall(wrap(short), (tok, pos, h0), rest, repeats)
            return (t_n - t_1) / 24
        return once, long
    v, outs = {}, {}
    for name, f in (("ours (default)", draft_roll), ("xla", draft_roll_reference)):
        v[name], g = once_for(f)
        outs[name] = g(tok, pos, h0, *rest)
    bench.log("chain outputs equal:", all(bool(jnp.array_equal(a, b))
                                          for a, b in zip(*outs.values())))
    _rounds("draft_roll T4096 Hd7168 dependent chain", v,
            floor_us=2 * 4096 * 7168 * 2 / copy_bw * 1e6)


def _device_timeline(fn, args, label):
    """Runs fn(*args) once under jax.profiler and returns the GPU kernel timeline of
    that call (CUPTI activity through the XLA profiler): kernel count, summed kernel
    time, span from first start to last end, and the idle gaps between kernels."""
    evs = bench.gpu_kernel_events(fn, args)
    if not evs:
        bench.log(label, "no GPU events")
        return
    gaps = sorted(b[0] - (a[0] + a[1]) for a, b in zip(evs, evs[1:]))
    names = {}
    for _, dur, n in evs:
        names.setdefault(n[:40], []).append(dur)
    add(dict(sec="trace", case=label, kernels=len(evs),
             busy_us=sum(e[1] for e in evs) / 1e3,
             span_us=(evs[-1][0] + evs[-1][1] - evs[0][0]) / 1e3,
             gap_med_us=gaps[len(gaps) // 2] / 1e3 if gaps else 0,
             gap_max_us=gaps[-1] / 1e3 if gaps else 0,
             by_kernel="; ".join(f"{n} x{len(v)} {sum(v) / len(v) / 1e3:.1f}us"
                                 for n, v in names.items())[:300]))


def sec_trace_roll(copy_bw):
    """GPU timelines of the draft_roll benchmark jits (32 independent calls, and a
    dependent chain of 32), ours and XLA's: where the time between kernels goes."""
    from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
    base = _roll_inputs()
    hs = [jax.random.normal(k, base[2].shape, base[2].dtype)
          for k in jax.random.split(jax.random.key(5), bench.REPS_IN_JIT)]
    rest = base[:2] + base[3:]
    for name, f in (("ours", draft_roll), ("xla", draft_roll_reference)):
        multi = jax.jit(lambda hs, *r, f=f: [f(r[0], r[1], h, *r[2:]) for h in hs])
        _device_timeline(multi, (hs,) + rest, f"roll {name} 32 independent calls")

        def run(tok, pos, h, *r, f=f):
            for _ in range(32):
                tok, pos, h = f(tok, pos, h, *r)
            return tok, pos, h
        _device_timeline(jax.jit(run), base, f"roll {name} chain of 32")


def sec_final_prefill(copy_bw):
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    # 4. prefill 4 x 512 vs cuDNN.
    for h in (64, 32):
        q_lens = [512] * 4
        args = bench.make_ragged(jax.random.key(1), q_lens, q_lens, h, 8, 128)
        kd, vd = bench.dense_kv(args[1], args[3]), bench.dense_kv(args[2], args[3])
        qd = [q.reshape(4, 512, h, 128) for q in args[0]]
        cud = functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                is_causal=True)
        ref = ragged_paged_attention_reference(args[0][0], *args[1:])
        cur = ragged_paged_attention(args[0][0], *args[1:])
        v = {"ours default": _marginal(ragged_paged_attention, args[0], args[1:])}
        for name, kw in (("ours round-2 (zero-filled out)", dict(tail=False)),):
            f = jax.jit(functools.partial(_ragged_variant, **kw))
            o = f(args[0][0], *args[1:])
            diff = float(jnp.max(jnp.abs(o.astype(jnp.float32) - cur.astype(jnp.float32))))
            bench.log(f"prefill {h}/8 {name}: err {bench.rel_err(o, ref):.2e} "
                      f"(default {bench.rel_err(cur, ref):.2e}), max |diff| vs default "
                      f"{diff:.3g}")
            v[name] = _marginal(f, args[0], args[1:])
        v.update({
            "cudnn": _marginal(lambda q, k, vv: cud(q, k, vv), qd, (kd, vd))})
        _rounds(f"prefill 4x512 {h}/8", v)


def sec_try_prefill(copy_bw):
    """Prefill 4 x 512: 128-row tiles with 8 warps (two warpgroups) vs the 64-row
    4-warp default vs cuDNN, interleaved rounds; err of each variant vs the reference."""
    from pallas_kernels.ragged_paged_attention import (ragged_paged_attention,
                                                       ragged_paged_attention_reference)
    for h, variants in ((64, {"bq16 nw8": dict(block_q=16, num_warps=8),
                              "bq16 nw8 st3": dict(block_q=16, num_warps=8, num_stages=3)}),
                        (32, {"bq32 nw8": dict(block_q=32, num_warps=8)})):
        q_lens = [512] * 4
        args = bench.make_ragged(jax.random.key(1), q_lens, q_lens, h, 8, 128)
        ref = ragged_paged_attention_reference(args[0][0], *args[1:])
        kd, vd = bench.dense_kv(args[1], args[3]), bench.dense_kv(args[2], args[3])
        qd = [q.reshape(4, 512, h, 128) for q in args[0]]
        cud = functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                is_causal=True)
        v = {"ours default": _marginal(ragged_paged_attention, args[0], args[1:])}
        for name, tuning in variants.items():
            f = functools.partial(ragged_paged_attention, **tuning)
            bench.log(f"prefill {h}/8 {name} err", bench.rel_err(f(args[0][0], *args[1:]), ref))
            v["ours " + name] = _marginal(f, args[0], args[1:])
        v["cudnn"] = _marginal(lambda q, k, vv: cud(q, k, vv), qd, (kd, vd))
        _rounds(f"prefill 4x512 {h}/8", v)


def _profiler_range():
    """cuProfilerStart/Stop on the primary CUDA context (the one JAX/XLA uses), for
    `ncu --profile-from-start off`: only the launches inside the range are profiled.
    No-op (profile everything, select launches with -k / --launch-skip) when
    MTPJAX_NCU_RANGE=0 or libcuda cannot be loaded."""
    import contextlib
    import ctypes
    if os.environ.get("MTPJAX_NCU_RANGE", "1") == "0":
        return contextlib.nullcontext
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        ctx = ctypes.c_void_p()
        dev = ctypes.c_int()
        assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    except Exception as e:  # noqa: BLE001
        bench.log("no profiler range:", repr(e)[:200])
        return contextlib.nullcontext

    @contextlib.contextmanager
    def rng():
        cu.cuCtxPushCurrent(ctx)
        cu.cuProfilerStart()
        try:
            yield
        finally:
            cu.cuProfilerStop()
            cu.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))
    return rng


def _roll_inputs(t=4096, hd=7168, ns=256, n_new=4):
    ks = jax.random.split(jax.random.key(3), 8)
    lens = jax.random.randint(ks[3], (ns,), 1, 32)
    lens = (lens * t // lens.sum()).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens).astype(jnp.int32)])
    return (jax.random.randint(ks[0], (t,), 0, 1000, jnp.int32),
            jax.random.randint(ks[1], (t,), 0, 1000, jnp.int32),
            jax.random.normal(ks[2], (t, hd), jnp.bfloat16), cu,
            jax.random.randint(ks[4], (ns, n_new), 0, 1000, jnp.int32),
            jax.random.randint(ks[5], (ns, n_new), 0, 1000, jnp.int32),
            jax.random.normal(ks[6], (ns, n_new, hd), jnp.bfloat16),
            jax.random.randint(ks[7], (ns,), 0, n_new + 1, jnp.int32))


def ncu_target(spec):
    """One measured call per target, for Nsight Compute. `spec` is a comma list:
      Q,H           (two ints; round-2 form) decode B=64 ctx 4k, 3 calls, no range
      prefill:H     ragged prefill 4 x 512 (ctx 512, causal), H/8, d 128, bf16, page 16
      cudnn:H       cuDNN dense causal attention on the same shape (the peer)
      roll[:k=v..]  draft_roll T=4096 Hd=7168 bf16 (tuning as k=v, e.g. roll:block_t=2)
      roll_xla      draft_roll_reference (XLA's fusions) on the same inputs
      roll_multi, roll_xla_multi   the benchmark's jit: 32 calls on distinct hidden buffers
      mla:H[:Q]     MLA paged attention (bench.mla's case): B=64, ctx 4096, page 64, H heads,
                    Q query tokens per sequence (default 1: decode; 4: verify), default tuning
      moe:N[:SHAPE] the MoE expert layer the model runs on one GPU (routing + grouped SwiGLU
                    on the Pallas kernels; bench.moe) at N tokens, SHAPE v2-lite (default) or
                    v3-slice; moe3:N[:SHAPE] the same with three grouped-matmul calls
    Each target is compiled and run twice outside the profiler range, then once
    inside it (cuProfilerStart/Stop), so `ncu --profile-from-start off` sees exactly
    the kernels of one call of each target, in this order.
    """
    parts = spec.split(",")
    if all(p.strip().lstrip("-").isdigit() for p in parts):
        q_len, h = (int(x) for x in parts)
        qs, kp, vp, bt, kl = bench.make_paged(jax.random.key(1), 64, q_len, h, 8, 128, 4096)
        f = jax.jit(paged_attention)
        for _ in range(3):
            jax.block_until_ready(f(qs[0], kp, vp, bt, kl))
        return 0
    from pallas_kernels.draft_roll import draft_roll, draft_roll_reference
    from pallas_kernels.mla_paged_attention import mla_paged_attention
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention
    rng = _profiler_range()
    for p in parts:
        name, _, arg = p.partition(":")
        if name in ("prefill", "cudnn"):
            h = int(arg or 64)
            q_lens = [512] * 4
            args = bench.make_ragged(jax.random.key(1), q_lens, q_lens, h, 8, 128)
            args = (args[0][0],) + tuple(args[1:])
            if name == "prefill":
                fn = jax.jit(ragged_paged_attention)
            else:
                kd, vd = bench.dense_kv(args[1], args[3]), bench.dense_kv(args[2], args[3])
                args = (args[0].reshape(4, 512, h, 128), kd, vd)
                fn = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn",
                                               is_causal=True))
        elif name in ("roll", "roll_xla"):
            args = _roll_inputs()
            kw = {k: int(v) for k, v in (x.split("=") for x in arg.split(":") if x)}
            fn = draft_roll_reference if name == "roll_xla" else functools.partial(draft_roll, **kw)
        elif name in ("roll_multi", "roll_xla_multi"):
            # The benchmark's jit: 32 independent calls on distinct hidden buffers.
            base = _roll_inputs()
            hs = [jax.random.normal(k, base[2].shape, base[2].dtype)
                  for k in jax.random.split(jax.random.key(5), bench.REPS_IN_JIT)]
            f = draft_roll_reference if name == "roll_xla_multi" else draft_roll
            fn = jax.jit(lambda hs, *r, f=f: [f(r[0], r[1], h, *r[2:]) for h in hs])
            args = (hs,) + base[:2] + base[3:]
        elif name == "mla":
            from mtpjax.bench import mla as mla_bench
            h, _, q = arg.partition(":")
            q_len = int(q or 1)
            qs, rest = mla_bench.make_case(jax.random.key(3), [q_len] * 64, [4096] * 64,
                                           int(h or 16), 64)
            fn = jax.jit(functools.partial(mla_paged_attention, kv_lora_rank=mla_bench.RANK))
            args = (qs[0],) + rest
        elif name in ("moe", "moe3"):
            from mtpjax.bench import moe as moe_bench
            n, _, shape_name = arg.partition(":")
            shape = moe_bench.SHAPES[shape_name or "v2-lite"]
            ids, w = moe_bench.make_routing(shape, int(n or 1), seed=7)
            x = 0.5 * jax.random.normal(jax.random.key(8), (int(n or 1), shape["hidden"]),
                                        jnp.bfloat16)
            layer = moe_bench.experts_pallas_ffn if name == "moe" else moe_bench.experts_pallas
            fn = jax.jit(layer)
            args = (x, moe_bench.make_weights(shape), ids, w)
        else:
            raise ValueError(f"unknown ncu target {p!r}")
        for _ in range(2):
            jax.block_until_ready(fn(*args))
        with rng():
            jax.block_until_ready(fn(*args))
        bench.log(f"ncu target {p}: one call in the profiler range")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", default="verify,prefill,roll")
    ap.add_argument("--ncu-target", default="",
                    help="Q,H (decode) or prefill:H,cudnn:H,roll,roll_xla,mla:H[:Q],moe:N,"
                         "moe3:N: see ncu_target")
    a = ap.parse_args(argv)
    if a.ncu_target:
        return ncu_target(a.ncu_target)
    bench.log(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    copy_bw, all_bw = bench.copy_bandwidth()
    bench.log("copy TB/s " + ", ".join(f"{k} {v / 1e12:.3f}" for k, v in all_bw.items()))
    for sec in a.sections.split(","):
        try:
            globals()["sec_" + sec](copy_bw)
        except Exception:  # noqa: BLE001
            bench.log("section fail", sec, traceback.format_exc()[-1500:])
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    cols = ["sec", "B", "Q", "H", "ctx", "case", "var", "us", "us_min", "us_max", "floor_us",
            "kernels", "busy_us", "span_us", "gap_med_us", "gap_max_us",
            "us_r8", "ours_us", "ours_us_r8",
            "pct_copy",
            "ours_TFLOPs", "pct_of_cudnn", "cudnn_us", "xla_us", "err", "exact"]
    used = [c for c in cols if any(c in r for r in ROWS)]
    bench.table(f"sweep (copy {copy_bw / 1e12:.3f} TB/s)", ROWS, used)
    with open(os.path.join(a.out, "sweep.log"), "w") as f:
        f.write("\n".join(bench.LOG) + "\n")


if __name__ == "__main__":
    sys.exit(main())
