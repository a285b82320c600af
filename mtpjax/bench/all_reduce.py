"""What one tensor-parallel all-reduce costs inside a decode step, on the devices at hand.

    python -u -m mtpjax.bench.all_reduce [--tensor-parallel 2] [--tokens 1,32] [--layers 32]
        [--hidden 4096] [--ffn 14336] [--dtypes float32,bfloat16] [--repeats 20]

A tensor-parallel step all-reduces the hidden state twice a layer (attention out-projection,
MLP down-projection). This times a Megatron MLP stack as one program on a `(1, m)` mesh:
`--layers` layers of x + psum(silu(x @ w_up) @ w_down), w_up's columns and w_down's rows split
over the model axis, each layer its own weights (nothing is re-read or hoisted). The same stack
runs again with the psum left out (each device keeps its partial sum: wrong numbers, the same
matmuls), and once on a single device with the whole weights. So per layer:

    all-reduce cost = (sharded - sharded without psum) / layers
    compute at m    = (sharded without psum) / layers, against one device's / layers

`--dtypes` is the dtype the partial sums are reduced in (the model's steps reduce float32
today). XLA flags are read once per process: run it again under another `XLA_FLAGS` to compare
all-reduce implementations (one-shot kernel, command buffers with collectives, ...). The last
lines are a table; `--out DIR` keeps the sharded program's optimized HLO.
"""
from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpjax.bench.fp8_linear import pipelined_wall
from mtpjax.parallel.kernels import shard_map_compat
from mtpjax.parallel.mesh import make_mesh


def mlp_stack(x, w_up, w_down, *, reduce: bool, reduce_dtype):
    """x [T, E] bf16 (replicated), w_up [L, E, F/m], w_down [L, F/m, E] (this device's
    slices) -> [T, E] bf16. `reduce=False` drops the psum (per-device partial sums)."""
    for layer in range(w_up.shape[0]):
        h = jax.nn.silu(jnp.dot(x, w_up[layer], preferred_element_type=jnp.float32))
        y = jnp.dot(h.astype(x.dtype), w_down[layer], preferred_element_type=jnp.float32)
        y = y.astype(reduce_dtype)
        if reduce:
            y = jax.lax.psum(y, "model")
        x = (x.astype(jnp.float32) + y.astype(jnp.float32)).astype(x.dtype)
    return x


def best_wall(fn, args, repeats: int) -> float:
    """Seconds per call: the best of three `fp8_linear.pipelined_wall` runs (calls dispatched
    back to back, waited for once)."""
    return min(pipelined_wall(fn, args, repeats) for _ in range(3))


SPEC_UP, SPEC_DOWN = P(None, None, "model"), P(None, "model", None)


def build(mesh, *, reduce: bool, reduce_dtype):
    """The jitted stack on `mesh`. Without the psum each device's output is its own partial
    sum, so it leaves split over the model axis (one row per device), not replicated."""
    def body(x, wu, wd):
        y = mlp_stack(x, wu, wd, reduce=reduce, reduce_dtype=reduce_dtype)
        return y if reduce else y[None]
    return jax.jit(shard_map_compat(body, mesh=mesh, in_specs=(P(), SPEC_UP, SPEC_DOWN),
                                    out_specs=P() if reduce else P("model")))


def measure(m: int, T: int, L: int, E: int, F: int, dtypes, repeats: int, out_dir=None):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, E)) * 0.1, jnp.bfloat16)
    w_up = jnp.asarray(rng.standard_normal((L, E, F), np.float32) * E ** -0.5, jnp.bfloat16)
    w_down = jnp.asarray(rng.standard_normal((L, F, E), np.float32) * F ** -0.5, jnp.bfloat16)
    one = jax.jit(lambda x, wu, wd: mlp_stack(x, wu, wd, reduce=False,
                                                 reduce_dtype=jnp.float32))
    rows = [dict(T=T, form="one device", us_layer=best_wall(one, (x, w_up, w_down),
                                                                 repeats) / L * 1e6)]
    if m > 1:
        mesh = make_mesh(tensor_parallel=m, devices=jax.devices()[:m])
        args = tuple(jax.device_put(a, NamedSharding(mesh, spec))
                     for a, spec in zip((x, w_up, w_down), (P(), SPEC_UP, SPEC_DOWN)))
        fn = build(mesh, reduce=False, reduce_dtype=jnp.float32)
        base = best_wall(fn, args, repeats) / L * 1e6
        rows.append(dict(T=T, form=f"TP={m}, no psum", us_layer=base))
        for name in dtypes:
            fn = build(mesh, reduce=True, reduce_dtype=jnp.dtype(name))
            if out_dir and T == 1:
                with open(os.path.join(out_dir, f"all_reduce_{name}.hlo"), "w") as f:
                    f.write(fn.lower(*args).compile().as_text())
            t = best_wall(fn, args, repeats) / L * 1e6
            rows.append(dict(T=T, form=f"TP={m}, psum {name}", us_layer=t,
                             us_all_reduce=t - base))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor-parallel", type=int, default=2)
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    m = args.tensor_parallel
    if m < 1 or m > len(jax.devices()):
        raise SystemExit(f"--tensor-parallel {m}: expected 1..{len(jax.devices())} "
                         f"(the devices here)")
    if args.ffn % m:
        raise SystemExit(f"--ffn {args.ffn} is not divisible by --tensor-parallel {m}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        rows += measure(m, T, args.layers, args.hidden, args.ffn, dtypes, args.repeats,
                        args.out)
    print(f"# {jax.devices()[0].device_kind} x{m}, L={args.layers} E={args.hidden} "
          f"F={args.ffn}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| tokens | program | us per layer | us per all-reduce |")
    print("|---|---|---|---|")
    for r in rows:
        ar = f"{r['us_all_reduce']:.1f}" if "us_all_reduce" in r else ""
        print(f"| {r['T']} | {r['form']} | {r['us_layer']:.1f} | {ar} |")
    return rows


if __name__ == "__main__":
    main()
