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
columns and e4m3 x e4m3 dots (MTPJAX_FP8_ACTIVATIONS=fp8), the others with x as it is.
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

from mtpjax.model.fp8_matmul import forced_fp8_activations, forced_fp8_matmul
from mtpjax.model.linear import linear
from mtpjax.model.quantize import quantize_fp8

# "-xla": the same weights through XLA's dequantize-then-GEMM (the kernel's peer);
# "-act8": the kernel with e4m3 activations
VARIANTS = ("bf16", "fp8-block", "fp8-channel", "fp8-block-xla", "fp8-block-act8",
            "fp8-channel-act8")


@contextlib.contextmanager
def variant_paths(variant: str):
    """The variant's FP8 path (forced to XLA for "-xla") and the kernel's activations mode
    inside the block."""
    with forced_fp8_matmul("xla" if variant.endswith("-xla") else None), \
            forced_fp8_activations("fp8" if variant.endswith("-act8") else "bf16"):
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


def sweep(a, bw) -> None:
    """The kernel alone over its block / split / stage choices: for each K x N of
    --sweep-shapes and each token count, microseconds per call (8 distinct weights in one jit,
    wall / 8: launch gaps included) and % of the FP8 bytes' floor; prints each activations
    mode's (--sweep-activations) defaults row and best."""
    import itertools
    from pallas_kernels.fp8_matmul import fp8_weight_matmul
    from mtpjax.model.fp8_weight import quantize
    key = jax.random.PRNGKey(1)
    print("| K x N | tokens | config | us | % floor |\n|---|---|---|---|---|", flush=True)
    shapes = [tuple(int(d) for d in kn.split("x")) for kn in a.sweep_shapes.split(",")]
    for K, N in shapes:
        ws = [quantize((0.02 * jax.random.normal(jax.random.fold_in(key, i), (K, N))
                        ).astype(jnp.bfloat16), (128, 128)) for i in range(8)]
        floor = ws[0].nbytes / bw
        for M in (int(t) for t in a.tokens.split(",")):
            x = jax.random.normal(key, (M, K)).astype(jnp.bfloat16)
            configs = []
            for act in a.sweep_activations.split(","):
                configs.append(dict(activations=act))                   # the defaults
                if a.sweep_defaults_only:
                    continue
                # `compute` is the widened dot's dtype: the fp8 mode widens nothing
                computes = ("float16", "bfloat16") if act == "bf16" else (None,)
                configs += [dict(block_n=n, block_k=k, splits=sp, num_warps=w, num_stages=st,
                                 activations=act, **({"compute": c} if c else {}))
                            for n, k, sp, w, st, c in itertools.product(
                                (64, 128), (128, 256), (2, 4), (4, 8), (3, 4), computes)]
            results = []
            for c in configs:
                kw = c

                def calls(x, ws, kw=kw):
                    return sum(fp8_weight_matmul(x, w.values, w.scale, block=w.block, **kw)
                               .astype(jnp.float32).sum() for w in ws)
                try:
                    t = wall(jax.jit(calls), (x, ws), 10) / len(ws)
                except Exception as e:                  # a config Triton cannot take
                    print(f"  {c}: {type(e).__name__}", flush=True)
                    continue
                results.append((t, c))
                if len(c) == 1:
                    print(f"| {K} x {N} | {M} | default {c['activations']} | {t * 1e6:.1f} | "
                          f"{100 * floor / t:.1f} |", flush=True)
            for act in a.sweep_activations.split(","):
                ours = sorted((r for r in results if r[1]["activations"] == act),
                              key=lambda r: r[0])
                if not ours:
                    continue
                t, c = ours[0]
                print(f"| {K} x {N} | {M} | best {c} | {t * 1e6:.1f} | "
                      f"{100 * floor / t:.1f} |", flush=True)
                for t, c in ours[:5]:
                    print(f"  top: {c} {t * 1e6:.1f} us", flush=True)


def main(argv=None) -> int:
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
                    help="--sweep times each activations mode's default config only (the "
                         "modes side by side, kernel alone, in seconds)")
    ap.add_argument("--sweep-activations", default="bf16,fp8",
                    help="the kernel's activations modes to sweep (bf16: x as given; fp8: x "
                         "to e4m3 per 128 columns)")
    a = ap.parse_args(argv)
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
