"""Where the Mosaic-GPU MLA kernel's time goes per KV block, from Mosaic GPU's on-device
profiler (GPU only; a diagnostic, not a benchmark):

    python -m mtpjax.bench.mla_profile [--cases v128,d128,d16] [--ctx 512] [--page 64]
                                       [--events 19] [--out DIR]

Each case (d = decode q_len 1, v = verify q_len 4, then the number of heads) runs B=64
requests at context `--ctx` through `mla_tiles_mgpu` with its `profile` on, the queries
passed as the model's uniform decode / verify steps pass them (token-major, read in place;
`mosaic_tiles.uniform_tile_args`; one KV split). The profiler keeps its events in the
kernel's spare shared memory (~1 KiB at the default shapes): `--events` 19 holds two
regions a block on warpgroup 0 for 8 KV blocks, so the context stays short (<= 512). Per
case it prints, in SM clock cycles (medians over CTAs; blocks 3 .. n-1 for the per-block
phases, where the pipeline is steady):

- wg 0's period (one KV block) and its phases: "logits" (the slot wait and the QK product),
  "softmax", and the rest of the block (the P . V issue and wait, the P hand-over, the loop);
- each region's own median ("wait_p" on wg 1, "wait_slot" and "load" on the memory
  warpgroup: "load" is the KV block's copy latency, from the issue to the last byte).

The profile adds a few instructions per region and, for "load", a wait on the memory
warpgroup; compare the phases with each other, and time the kernel with `bench mla`.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import sys
import tempfile

import jax
import numpy as np

from mtpjax.bench import mla
from pallas_kernels.mla_paged_attention.kernel_mgpu import mla_tiles_mgpu
from pallas_kernels.mla_paged_attention.mla_paged_attention import mosaic_tuning
from pallas_kernels.mla_paged_attention.mosaic_tiles import uniform_tile_args

# wg 0 records two regions a KV block (logits, softmax) and Mosaic's own "Init" scopes (up
# to two a warpgroup, outside the loop).
REGIONS_PER_BLOCK, OTHER_REGIONS = 2, 2


def summarize(events):
    """Perfetto events (dicts with name, ph "B"/"E", ts in thousands of cycles, tid one per
    CTA and warpgroup) -> {"regions": {name: median cycles}, "phases": {name: median
    cycles}, "blocks": how many KV blocks the phases sample}. Phases are wg 0's per KV
    block, from blocks 3 to n-1 of each CTA: period (logits start to the next logits
    start), logits, softmax, rest."""
    spans = collections.defaultdict(lambda: collections.defaultdict(list))   # tid -> name
    for tid, evs in _by_tid(events).items():
        open_ = []
        for e in evs:
            if e["ph"] == "B":
                open_.append(e)
            else:
                b = open_.pop()
                if b["name"] != e["name"]:
                    raise ValueError(f"unbalanced profile regions: {b['name']} closed by "
                                     f"{e['name']}")
                spans[tid][b["name"]].append((b["ts"] * 1e3, e["ts"] * 1e3))
    regions = collections.defaultdict(list)
    phases = collections.defaultdict(list)
    for per in spans.values():
        for name, ss in per.items():
            regions[name] += [end - start for start, end in ss]
        logits, softmax = per.get("logits", []), per.get("softmax", [])
        for k in range(2, min(len(logits), len(softmax)) - 1):
            phases["period"].append(logits[k + 1][0] - logits[k][0])
            phases["logits"].append(softmax[k][0] - logits[k][0])
            phases["softmax"].append(softmax[k][1] - softmax[k][0])
            phases["rest"].append(logits[k + 1][0] - softmax[k][1])
    med = lambda d: {k: float(np.median(v)) for k, v in sorted(d.items())}
    return {"regions": med(regions), "phases": med(phases),
            "blocks": len(phases["period"])}


def _by_tid(events):
    out = collections.defaultdict(list)
    for e in events:
        out[e["tid"]].append(e)
    return out


def run_case(case, ctx, page, events, out_dir):
    """One profiled call of the Mosaic kernel on a uniform batch -> summarize(trace)."""
    q_len = 1 if case[0] == "d" else 4
    h = int(case[1:])
    blocks = -(-ctx // 64)
    need = REGIONS_PER_BLOCK * blocks + OTHER_REGIONS
    if need > events:
        raise ValueError(f"--ctx {ctx} is {blocks} KV blocks of 64, which need --events >= "
                         f"{need}; got {events} (the spare shared memory holds 19)")
    s = 64
    qs, (lat, bt, kv, _, _) = mla.make_case(jax.random.key(1), [q_len] * s, [ctx] * s, h,
                                            page)
    tun = mosaic_tuning(s * q_len, h, s, bt.shape[1], page, q_len)
    bh = tun["block_h"]
    trace_dir = os.path.join(out_dir, case)
    shutil.rmtree(trace_dir, ignore_errors=True)
    os.makedirs(trace_dir)
    f = jax.jit(lambda *a: mla_tiles_mgpu(
        *a, rank=mla.RANK, block_h=bh, sm_scale=mla.WIDTH ** -0.5,
        zero_masked=True, profile=(trace_dir, events)))
    q = qs[0].reshape(s, tun["block_q"], h, qs[0].shape[-1])          # token-major, in place
    args = (q, lat, bt, *uniform_tile_args(kv, s, tun["block_q"], h // bh))
    for _ in range(2):
        jax.block_until_ready(f(*args))
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json"), recursive=True),
                   key=os.path.getmtime)
    if not files:
        raise RuntimeError(f"the profiler wrote no trace into {trace_dir}")
    with open(files[-1]) as fh:
        return summarize(json.load(fh)["traceEvents"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="v128,d128,d16")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--events", type=int, default=19)
    ap.add_argument("--out", default=None, help="trace folder (default: a temporary one)")
    a = ap.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("mla_profile needs a GPU (Mosaic GPU's on-device profiler)")
    out = a.out or tempfile.mkdtemp(prefix="mla_profile_")
    print(f"{jax.devices()[0].device_kind}, ctx {a.ctx}, page {a.page}, traces in {out}")
    print("| case | period | logits | softmax | rest | wait_p (wg 1) | wait_slot | load "
          "| samples |")
    print("|---|---|---|---|---|---|---|---|---|")
    for case in a.cases.split(","):
        r = run_case(case, a.ctx, a.page, a.events, out)
        ph, rg = r["phases"], r["regions"]
        cells = [ph.get(k) for k in ("period", "logits", "softmax", "rest")] + [
            rg.get(k) for k in ("wait_p", "wait_slot", "load")]
        print(f"| {case} | " + " | ".join("-" if c is None else f"{c:.0f}" for c in cells)
              + f" | {r['blocks']} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
