"""FP8 weight-only projections against bf16: the model's `linear` over a chain of MLP layers.

    python -u -m mtpjax.bench.fp8_linear [--tokens 1,8,32,128] [--layers 8] [--out DIR]

Each layer is an up ([E, I]) and a down ([I, E]) projection through `model.linear.linear`, the
function every dense projection of the model calls, with its own weights (8B shape: E 4096,
I 14336), so no weight is read from L2 twice. Rows: bf16 weights, FP8 with 128 x 128 block
scales (DeepSeek-V3's layout), FP8 with one scale per output channel. Time per layer is the
marginal wall time between an L-layer and an L/4-layer jit (host dispatch cancelled); the floor
is the layer's weight bytes (FP8: values + float32 scales) / the copy bandwidth of the same
run. FP8 rows go through the FP8 kernel where `model/fp8_matmul.py` picks it (decode-sized
batches on one GPU); `fp8-block-xla` forces XLA's dequantize-then-GEMM on the same weights,
the kernel's same-run peer; `-act8` rows run the kernel with x quantized to e4m3 per 128
columns and e4m3 x e4m3 dots (MTPJAX_FP8_ACTIVATIONS=fp8), the others with x as it is;
`-stream` rows run the kernel's stream variant (MTPJAX_FP8_KERNEL=stream, stream.py).
The optimized HLO of each FP8 program is checked for a separate dequantization: a fusion that
writes a bf16 weight-sized array means the FP8 bytes are read, widened and written back before
the GEMM reads them again (three passes instead of one).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp

from mtpjax.model.fp8_matmul import (forced_fp8_activations, forced_fp8_kernel,
                                     forced_fp8_matmul)
from mtpjax.model.linear import linear
from mtpjax.model.quantize import quantize_fp8

# "-xla": the same weights through XLA's dequantize-then-GEMM (the kernel's peer);
# "-act8": the kernel with e4m3 activations; "-stream": the kernel's stream variant
SWEEP_VARIANTS = ("bf16", "probe", "tiles", "stream")   # --sweep's rows
VARIANTS = ("bf16", "fp8-block", "fp8-channel", "fp8-block-xla", "fp8-block-act8",
            "fp8-channel-act8", "fp8-block-stream", "fp8-channel-stream")


@contextlib.contextmanager
def variant_paths(variant: str):
    """The variant's FP8 path (forced to XLA for "-xla"), the kernel's activations mode and
    its variant (MTPJAX_FP8_KERNEL) inside the block."""
    with forced_fp8_matmul("xla" if variant.endswith("-xla") else None), \
            forced_fp8_activations("fp8" if variant.endswith("-act8") else "bf16"), \
            forced_fp8_kernel("stream" if variant.endswith("-stream") else "tiles"):
        yield


def layer_weights(key, n: int, E: int, I: int, variant: str) -> list[dict]:
    """n layers of {"w_up": [E, I], "w_down": [I, E]} in the variant's storage."""
    layers = []
    for i in range(n):
        k1, k2 = jax.random.split(jax.random.fold_in(key, i))
        p = {"w_up": (0.02 * jax.random.normal(k1, (E, I), jnp.float32)).astype(jnp.bfloat16),
             "w_down": (0.02 * jax.random.normal(k2, (I, E), jnp.float32)).astype(jnp.bfloat16)}
        if variant != "bf16":
            p = quantize_fp8(p, "channel" if variant.startswith("fp8-channel") else (128, 128),
                             include=["w_up", "w_down"])
        layers.append(jax.block_until_ready(p))
    return layers


def mlp_chain(x, layers):
    for p in layers:
        h = linear(x, p["w_up"])
        x = x + linear(jax.nn.silu(h), p["w_down"])
    return x


def layer_bytes(p: dict) -> int:
    return sum(w.nbytes for w in p.values())


def wall(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def separate_dequant(hlo: str, E: int, I: int) -> list[str]:
    """Top-level fusions of the entry computation whose output is a bf16 weight-sized array
    ([E, I] or [I, E]): a dequantization written back to memory."""
    entry = hlo[hlo.find("ENTRY"):]
    out = []
    for line in entry.splitlines():
        m = re.search(r"= (bf16|f32)\[(\d+),(\d+)\][^ ]* fusion\(", line)
        if m and {int(m.group(2)), int(m.group(3))} == {E, I}:
            out.append(line.strip()[:160])
    return out


def pipelined_wall(fn, args, repeats: int) -> float:
    """Seconds per call of `repeats` calls dispatched back to back and waited for once: the
    host's dispatch overlaps the device's work, so a call of a few hundred us is timed as the
    device runs it (launch gaps inside the program included)."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    out = None
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeats


def stream_configs(M: int) -> list[dict]:
    """The stream variant's sweep around its defaults (dot, bf16 x, prefetch 1, 8 warps,
    default splits): prefetch depth, warps, Triton's own pipelining instead of the prefetch,
    narrower programs, fewer / more splits, one split (the kernel then writes the bf16 output
    itself: no XLA op before or after it), f16 x; fma mode for a few rows. Most telling
    first: a spent --sweep-budget-s cuts the last. (compute=float16 at the default prefetch
    runs in the first pass, `sweep`.)"""
    base = dict(variant="stream")
    configs = [dict(base, prefetch=2),
               dict(base, prefetch=0, num_stages=3),      # Triton's pipeliner: byte reads back
               dict(base, splits=1, block_n=64, prefetch=2),          # one launch in all
               dict(base, prefetch=0), dict(base, num_warps=4), dict(base, block_n=64),
               dict(base, splits=2), dict(base, splits=8),
               dict(base, compute="float16", prefetch=2), dict(base, num_warps=4, prefetch=2)]
    if M <= 4:
        configs += [dict(base, mode="fma", prefetch=2), dict(base, mode="fma", num_warps=4)]
    return configs


def _config_name(c: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in c.items()
                    if k not in ("variant", "interpret", "activations")) or "default"


def sweep(a, bw) -> None:
    """The kernel alone on each K x N of --sweep-shapes at each token count: microseconds per
    call (8 distinct weights and x's in one jit, so x's preparation is not shared; 20 such
    calls dispatched back to back: device time, launch gaps inside the program included;
    the XLA ops around the pallas_call, x's f16 scaling and the split-K sum, included),
    as a multiple of the weight bytes' floor, and
    against XLA's bf16 matmul on the same shape (`bf16`: its own, twice as large, floor).
    Rows of --sweep-variants: `bf16` the XLA peer; `probe` a kernel that only reads the e4m3
    bytes along the stream kernel's load path (`weight_read_probe.py`, the stream's default
    splits at 1 row, its values' bytes only: the path's ceiling); `tiles` kernel.py's kernel in each
    --sweep-activations mode (default config; its old block / split / warp / stage grid with
    --sweep-tiles-grid); `stream` stream.py's decode GEMV (`stream-fma` its fma mode): the
    defaults (and stream with compute=float16: x scaled per row into f16 by XLA, as the
    tiles kernel takes it) first, for every shape and token count, then the variations of `stream_configs`
    while --sweep-budget-s lasts (compiles dominate). Ends with each variant's best."""
    import itertools
    from mtpjax.bench.weight_read_probe import read_probe
    from mtpjax.model.fp8_weight import quantize
    from pallas_kernels._device import num_sms
    from pallas_kernels.fp8_matmul import fp8_weight_matmul
    from pallas_kernels.fp8_matmul.stream import stream_splits
    t_start = time.perf_counter()
    key = jax.random.PRNGKey(1)
    variants = a.sweep_variants.split(",")
    bad = [v for v in variants if v not in SWEEP_VARIANTS]
    if bad:
        raise SystemExit(f"--sweep-variants takes {SWEEP_VARIANTS}; got {bad}")
    shapes = [tuple(int(d) for d in kn.split("x")) for kn in a.sweep_shapes.split(",")]
    tokens = [int(t) for t in a.tokens.split(",")]
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}; copy "
          f"{bw / 1e12:.3f} TB/s; floor = weight bytes / copy rate", flush=True)
    print("| K x N | tokens | variant | config | us | x floor | vs bf16 |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    weights, results = {}, {}

    def fp8_weights(K, N):
        if (K, N) not in weights:
            weights[(K, N)] = [quantize((0.02 * jax.random.normal(
                jax.random.fold_in(key, i), (K, N))).astype(jnp.bfloat16), (128, 128))
                for i in range(8)]
        return weights[(K, N)]

    def bf16_calls(xs, ws):
        return sum((x @ w).astype(jnp.float32).sum() for x, w in zip(xs, ws))

    def run(K, N, M, label, config):
        """Times one row and prints it; None where the config does not compile."""
        xs = [jax.random.normal(jax.random.fold_in(key, 200 + i), (M, K)).astype(jnp.bfloat16)
              for i in range(8)]
        if label == "bf16":
            ws = [jax.random.normal(jax.random.fold_in(key, 100 + i), (K, N), jnp.bfloat16)
                  for i in range(8)]
            fn, floor = jax.jit(bf16_calls), ws[0].nbytes / bw
        elif label == "probe":
            ws = fp8_weights(K, N)
            floor = ws[0].values.nbytes / bw
            kw = dict(config, interpret=True) if a.sweep_interpret else config

            def reads(xs, ws, kw=kw):
                del xs
                return sum(read_probe(w.values, **kw).sum() for w in ws)
            fn = jax.jit(reads)
        else:
            ws = fp8_weights(K, N)
            floor = ws[0].nbytes / bw

            if a.sweep_interpret:
                config = dict(config, interpret=True)

            def calls(xs, ws, kw=config):
                return sum(fp8_weight_matmul(x, w.values, w.scale, block=w.block, **kw)
                           .astype(jnp.float32).sum() for x, w in zip(xs, ws))
            fn = jax.jit(calls)
        try:
            t = pipelined_wall(fn, (xs, ws), 20) / len(ws)
        except Exception as e:                          # a config Triton cannot take
            print(f"  {label} {_config_name(config)}: {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:160]}", flush=True)
            return None
        base = results.get((K, N, M, "bf16"), [(None, None)])[0][0]
        vs = f"{base / t:.2f}x" if base else ""
        print(f"| {K} x {N} | {M} | {label} | {_config_name(config)} | {t * 1e6:.1f} | "
              f"{t / floor:.2f} | {vs} |", flush=True)
        results.setdefault((K, N, M, label), []).append((t, config, floor))
        return t

    first, rests = [], []
    for K, N in shapes:
        for M in tokens:
            rest = []
            rests.append(rest)
            if "bf16" in variants:
                first.append((K, N, M, "bf16", {}))
            if "probe" in variants and M == tokens[0]:     # reads only: no rows
                splits = stream_splits(N // 128, K // 128, 1, K, num_sms())
                first += [(K, N, M, "probe", dict(splits=splits, prefetch=p)) for p in (1, 2)]
            if "tiles" in variants:
                for act in a.sweep_activations.split(","):
                    label = "tiles" if act == "bf16" else f"tiles-{act}"
                    first.append((K, N, M, label, dict(activations=act)))
                    if a.sweep_tiles_grid and not a.sweep_defaults_only:
                        computes = ("float16", "bfloat16") if act == "bf16" else (None,)
                        rest += [(K, N, M, label, dict(
                            block_n=n, block_k=k, splits=sp, num_warps=w, num_stages=st,
                            activations=act, **({"compute": c} if c else {})))
                            for n, k, sp, w, st, c in itertools.product(
                                (64, 128), (128, 256), (2, 4), (4, 8), (3, 4), computes)]
            if "stream" in variants:
                first.append((K, N, M, "stream", dict(variant="stream")))
                first.append((K, N, M, "stream", dict(variant="stream", compute="float16")))
                if M <= 4:
                    first.append((K, N, M, "stream-fma", dict(variant="stream", mode="fma")))
                if not a.sweep_defaults_only:
                    rest += [(K, N, M, "stream-fma" if c.get("mode") == "fma" else "stream", c)
                             for c in stream_configs(M)]
    # the variations round-robin over the shapes and token counts, so a spent budget cuts
    # the least important variation of each, not a whole shape
    rest = [r[j] for j in range(max(map(len, rests), default=0)) for r in rests if j < len(r)]
    for i, (K, N, M, label, config) in enumerate(first + rest):
        if i >= len(first) and time.perf_counter() - t_start > a.sweep_budget_s:
            print(f"  budget of {a.sweep_budget_s:.0f} s spent: {len(first) + len(rest) - i} "
                  f"configs not run", flush=True)
            break
        run(K, N, M, label, config)
    print("\nbest of each variant:\n| K x N | tokens | variant | config | us | x floor | "
          "vs bf16 |\n|---|---|---|---|---|---|---|")
    for (K, N, M, label), rows in results.items():
        t, config, floor = min(rows, key=lambda r: r[0])
        base = results.get((K, N, M, "bf16"), [(None, None)])[0][0]
        vs = f"{base / t:.2f}x" if base else ""
        print(f"| {K} x {N} | {M} | {label} | {_config_name(config)} | {t * 1e6:.1f} | "
              f"{t / floor:.2f} | {vs} |")
    print(f"sweep took {time.perf_counter() - t_start:.0f} s", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,8,32,128")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="time the kernel alone over its block / split / stage choices")
    ap.add_argument("--sweep-shapes", default="4096x14336,14336x4096",
                    help="K x N of the swept weights (8B: MLP up 4096x14336, down 14336x4096)")
    ap.add_argument("--sweep-defaults-only", action="store_true",
                    help="--sweep times each variant's default config only")
    ap.add_argument("--sweep-activations", default="bf16",
                    help="the tiles kernel's activations modes to sweep (bf16: x as given; "
                         "fp8: x to e4m3 per 128 columns)")
    ap.add_argument("--sweep-variants", default=",".join(SWEEP_VARIANTS),
                    help="--sweep's rows: bf16 (XLA's matmul on bf16 weights, the peer), "
                         "probe (reads the e4m3 bytes only, along stream's load path), "
                         "tiles (kernel.py), stream (stream.py)")
    ap.add_argument("--sweep-tiles-grid", action="store_true",
                    help="--sweep also times the tiles kernel's block / split / warp / stage "
                         "grid (64 configs per shape and token count)")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0,
                    help="--sweep stops starting variations (not defaults) after this long")
    ap.add_argument("--sweep-interpret", action="store_true",
                    help="--sweep runs the kernels interpreted (a CPU smoke test; times "
                         "mean nothing)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    variants = a.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        raise SystemExit(f"--variants takes {VARIANTS}, got {bad}")
    if a.layers < 4:
        raise SystemExit(f"--layers must be >= 4 (the marginal needs L and L/4), got {a.layers}")
    from mtpjax.bench.e2e import copy_bandwidth
    bw = copy_bandwidth(1024)
    if a.sweep:
        sweep(a, bw)
        return 0
    E, I, L = a.hidden, a.intermediate, a.layers
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}; copy {bw / 1e12:.3f} "
          f"TB/s; E {E}, I {I}, {L} layers", flush=True)
    rows, hlos = [], {}
    key = jax.random.PRNGKey(0)
    for variant in variants:
        layers = layer_weights(key, L, E, I, variant)
        nbytes = layer_bytes(layers[0])
        for M in (int(t) for t in a.tokens.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(M), (M, E), jnp.float32).astype(jnp.bfloat16)
            # fresh functions: jit caches traces per function, and the FP8 path (kernel or
            # XLA) is read when tracing, so fp8-block and fp8-block-xla must not share one
            full = jax.jit(lambda x, ls: mlp_chain(x, ls))
            quarter = jax.jit(lambda x, ls: mlp_chain(x, ls))
            with variant_paths(variant):
                t_full = wall(full, (x, layers), a.repeats)
                t_quarter = wall(quarter, (x, layers[:L // 4]), a.repeats)
                hlo = full.lower(x, layers).compile().as_text()
            per_layer = (t_full - t_quarter) / (L - L // 4)
            err = float("nan")
            if variant != "bf16":       # the path's one projection against float32 math
                w = layers[0]["w_up"]
                with variant_paths(variant):
                    y = jax.jit(lambda x, w: linear(x, w))(x, w).astype(jnp.float32)
                ref = x.astype(jnp.float32) @ w.dequantize(jnp.float32)
                err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
            deq = separate_dequant(hlo, E, I) if variant != "bf16" else []
            hlos[f"{variant}_M{M}"] = hlo
            floor = nbytes / bw
            rows.append(dict(variant=variant, tokens=M, layer_MB=nbytes / 1e6,
                             us=per_layer * 1e6, floor_us=floor * 1e6,
                             pct_floor=100 * floor / per_layer, separate_dequant=len(deq),
                             max_rel_err=err))
            print(f"{variant} M={M}: {per_layer * 1e6:.1f} us/layer, floor {floor * 1e6:.1f} us"
                  f" ({100 * floor / per_layer:.1f}%), max rel err {err:.2e}, separate dequant "
                  f"fusions {len(deq)}"
                  + (f": {deq[0]}" if deq else ""), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "fp8_linear.json"), "w") as f:
            json.dump(dict(copy_Bps=bw, rows=rows), f, indent=1)
        for name, text in hlos.items():
            with open(os.path.join(a.out, f"hlo_{name}.txt"), "w") as f:
                f.write(text)
    base = {r["tokens"]: r["us"] for r in rows if r["variant"] == "bf16"}
    print("\n| variant | tokens | MB/layer | us/layer | floor us | % floor | vs bf16 | "
          "separate dequant |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        speed = f"{base[r['tokens']] / r['us']:.2f}x" if r["tokens"] in base else ""
        print(f"| {r['variant']} | {r['tokens']} | {r['layer_MB']:.1f} | {r['us']:.1f} | "
              f"{r['floor_us']:.1f} | {r['pct_floor']:.1f} | {speed} | {r['separate_dequant']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
