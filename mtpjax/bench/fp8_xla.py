"""XLA's own FP8 weight matmuls at decode sizes, beside its bf16 matmul: does XLA read e4m3
weights faster than bf16 ones without a kernel of ours?

    python -u -m mtpjax.bench.fp8_xla [--shapes 4096x14336,14336x4096,4096x6144]
        [--tokens 1,8,32] [--chain 16] [--out DIR]

Two forms, both with the e4m3 weight converted inside the dot's fusion (XLA:GPU fuses a convert
of a dot operand), none materialising a widened weight:
- `per_channel`: (x @ convert(w)) * scale[n], one scale per output column;
- `block_batched`: DeepSeek's 128 x 128 block scales as a dot batched over the K blocks
  (x [T, K/128, 128] with w [K/128, 128, N] -> float32 partials [K/128, T, N]), each partial
  times its blocks' scales, summed over K blocks.
Each is timed as a chain of `--chain` distinct weights in one program (no weight is read twice,
nothing is hoisted), microseconds per matmul = wall / chain; floor = weight bytes / the same
process's copy rate. `--out` keeps the compiled HLO of each form at the first shape and one
token (did the convert fuse into the dot?).
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from mtpjax.bench.e2e import copy_bandwidth
from mtpjax.bench.fp8_linear import wall

BLOCK = 128


def per_channel(x, w, scale):
    """x [T, K] bf16, w [K, N] e4m3, scale [N] f32 -> [T, N] f32."""
    y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return y * scale[None, :]


def block_batched(x, w, scale):
    """x [T, K] bf16, w [K, N] e4m3, scale [K/128, N/128] f32 (DeepSeek's weight_scale_inv
    layout, applied as a multiply) -> [T, N] f32."""
    T, K = x.shape
    N = w.shape[1]
    kb = K // BLOCK
    part = jnp.einsum("tbk,bkn->btn", x.reshape(T, kb, BLOCK),
                      w.reshape(kb, BLOCK, N).astype(x.dtype),
                      preferred_element_type=jnp.float32)            # [K/128, T, N]
    return (part * jnp.repeat(scale, BLOCK, axis=1)[:, None, :]).sum(0)


def dequantized(x, w, scale):
    """The reference: the weight widened with its scales (per column or per block), then bf16."""
    if scale.ndim == 1:
        full = w.astype(jnp.float32) * scale[None, :]
    else:
        full = w.astype(jnp.float32) * jnp.repeat(jnp.repeat(scale, BLOCK, 0), BLOCK, 1)
    return jnp.dot(x.astype(jnp.float32), full.astype(x.dtype).astype(jnp.float32))


def _chain(fn, chain: int):
    def run(x, ws, scales):
        acc = None
        for i in range(chain):
            y = fn(x, ws[i], scales[i]).astype(jnp.float32)
            acc = y if acc is None else acc + y
        return acc
    return jax.jit(run)


def _us_per_call(f, args, chain: int, repeats: int = 20) -> float:
    return wall(f, args, repeats) / chain * 1e6


def measure(K: int, N: int, T: int, chain: int, seed: int = 0, hlo_dir: str | None = None):
    """One row: microseconds per matmul of bf16 and the two FP8 forms, and the floors."""
    key = jax.random.PRNGKey(seed)
    w = jax.random.normal(key, (chain, K, N), jnp.bfloat16) * 0.02
    wq = w.astype(jnp.float8_e4m3fn)
    s_col = jnp.full((chain, N), 0.5, jnp.float32)
    s_blk = jnp.full((chain, K // BLOCK, N // BLOCK), 0.5, jnp.float32)
    x = jax.random.normal(key, (T, K), jnp.bfloat16)
    bf16 = _chain(lambda x, w, s: jnp.dot(x, w, preferred_element_type=jnp.float32), chain)
    col, blk = _chain(per_channel, chain), _chain(block_batched, chain)
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        for name, f, args in (("per_channel", col, (x, wq, s_col)),
                              ("block_batched", blk, (x, wq, s_blk))):
            with open(os.path.join(hlo_dir, f"{name}_{K}x{N}_t{T}.hlo"), "w") as fh:
                fh.write(f.lower(*args).compile().as_text())
    return dict(K=K, N=N, T=T,
                bf16_us=_us_per_call(bf16, (x, w, s_col), chain),
                per_channel_us=_us_per_call(col, (x, wq, s_col), chain),
                block_batched_us=_us_per_call(blk, (x, wq, s_blk), chain))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x14336,14336x4096,4096x6144")
    ap.add_argument("--tokens", default="1,8,32")
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--out", default=None, help="folder for the compiled HLO")
    args = ap.parse_args(argv)
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    for K, N in shapes:
        if K % BLOCK or N % BLOCK:
            ap.error(f"--shapes: K and N must be multiples of {BLOCK}, got {K}x{N}")
    tokens = [int(t) for t in args.tokens.split(",")]
    bw = copy_bandwidth(args.copy_mib)
    print(f"device {jax.devices()[0].device_kind}, JAX {jax.__version__}; copy "
          f"{bw / 1e12:.3f} TB/s", flush=True)
    rows = []
    for i, (K, N) in enumerate(shapes):
        for j, T in enumerate(tokens):
            r = measure(K, N, T, args.chain,
                        hlo_dir=args.out if (i == 0 and j == 0 and args.out) else None)
            r["floor_bf16_us"] = 2 * K * N / bw * 1e6
            r["floor_fp8_us"] = K * N / bw * 1e6
            rows.append(r)
            print(r, flush=True)
    print("| K x N | tokens | XLA bf16 us (x its floor) | FP8 per-channel | FP8 block, batched "
          "| FP8 floor us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f8 = r["floor_fp8_us"]
        print(f"| {r['K']} x {r['N']} | {r['T']} | {r['bf16_us']:.1f} "
              f"({r['bf16_us'] / r['floor_bf16_us']:.2f}) | {r['per_channel_us']:.1f} "
              f"({r['per_channel_us'] / f8:.2f}) | {r['block_batched_us']:.1f} "
              f"({r['block_batched_us'] / f8:.2f}) | {f8:.1f} |")
    return rows


if __name__ == "__main__":
    main()
