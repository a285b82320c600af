"""GPU-time peer of the one-token MoE layer: XLA's own GEMV over the k touched experts'
weights, stored contiguously (no ids, no gathers), timed as calls chained inside one jit
(`bench.kernels.timeit`: the marginal time per call, host dispatch cancelled).

    python -u -m mtpjax.bench.gemv_peer [--shapes v2-lite,v3-slice] [--repeats 15]

Per shape: the gate/up GEMV ([k, E] x [k, E, 2I]) and the down GEMV ([k, I] x [k, I, E]),
their bytes, microseconds and TB/s against the same run's copy bandwidth. bench moe's
one-token floor is the same bytes over that bandwidth; this is what a library GEMV reaches
on them (docs/benchmarks.md, kernels).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from mtpjax.bench import kernels as kb
from mtpjax.bench.moe import SHAPES


def gemv_rows(shape: str, repeats: int, n_calls: int = 16) -> list[dict]:
    """[{"matrix", "MB", "us", "TBs"}] for the shape's gate/up and down GEMVs."""
    s = SHAPES[shape]
    k, E, I = s["k"], s["hidden"], s["width"]
    key = jax.random.PRNGKey(0)
    rows = []
    for name, (K, N) in (("gate/up", (E, 2 * I)), ("down", (I, E))):
        w = (0.02 * jax.random.normal(key, (k, K, N), jnp.float32)).astype(jnp.bfloat16)
        xs = [jax.random.normal(jax.random.fold_in(key, i), (k, K)).astype(jnp.bfloat16)
              for i in range(n_calls)]
        # chained: each call's input depends on the one before, as a model's layers do
        seconds, _ = kb.timeit(lambda x, w: jnp.einsum("ek,ekn->en", x, w), xs, (w,),
                               repeats=repeats,
                               chain=lambda x, prev: x + prev[:, :1].astype(x.dtype))
        rows.append({"matrix": name, "MB": w.nbytes / 1e6, "us": seconds * 1e6,
                     "TBs": w.nbytes / seconds / 1e12})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="v2-lite,v3-slice")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)
    shapes = a.shapes.split(",")
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        raise SystemExit(f"--shapes takes {sorted(SHAPES)}, got {bad}")
    copy_bw, _ = kb.copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}; copy {copy_bw / 1e12:.3f} TB/s", flush=True)
    print("| shape | matrix | MB | us | TB/s | of copy |\n|---|---|---|---|---|---|")
    for shape in shapes:
        for r in gemv_rows(shape, a.repeats):
            print(f"| {shape} | {r['matrix']} | {r['MB']:.1f} | {r['us']:.1f} | "
                  f"{r['TBs']:.2f} | {r['TBs'] * 1e12 / copy_bw:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
