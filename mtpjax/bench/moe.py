"""MoE expert layer speed: XLA's `jax.lax.ragged_dot` against JAX's Pallas Mosaic-GPU grouped matmul
(`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`) and a gather-the-touched-experts form, at
decode sizes (few tokens per expert: weight-read bound) and prefill sizes (compute bound).

    python -m mtpjax.bench.moe [--shapes v2-lite,v3-slice] [--tokens 1,32,256,4096] [--out DIR]
                               [--pad-to ROWS] [--independent] [--timeline] [--calls N]
                               [--variants ragged_dot,tiled,pallas,pallas:BM/BN/BK[/S],pallas_ffn,
                                           pallas_ffn_sorted,pallas_ffn:KEY=V/...,
                                           pallas_tiles:KEY=V/...,pallas_fused,
                                           pallas_fused:KEY=V/...,fused_shared,
                                           fused_shared_xla,mgpu,gather]

Shapes (bf16 random weights, routing uniform random top-k without repeats per token):
  v2-lite   DeepSeek-V2-Lite: 64 routed experts, 6 per token, hidden 2048, expert width 1408
  v3-slice  DeepSeek-V3: 8 per token, hidden 7168, width 2048, experts subsampled 256 -> 128 to
            fit one GPU beside the benchmark's buffers (the top-8 then touch a larger fraction)
Variants (each: gate, up, down grouped matmuls of the routed (token, expert) pairs + weighting):
  ragged_dot  `mtpjax.model.moe.routed_experts` with XLA's ragged_dot
  tiled       the same with `model.grouped_matmul.tiled_grouped_matmul` (exact tiles; what the
              model runs on GPU from 16 rows per expert)
  pallas      the same with mtpjax's Pallas (Triton) grouped-matmul kernel
              (`pallas_kernels.grouped_matmul`: each tile reads its expert's weights in place;
              interpreted off the GPU)
  pallas_ffn  the model's own path on one GPU, forced to the Pallas kernels: one or two
              tokens `fused_moe_ffn`, up to 16 `expert_tile_swiglu` (one tile per touched
              expert), beyond `moe_swiglu` (the tile layout without a sort: rows scattered in
              by a kernel, gate and up in one kernel, the weighted sum in one fused gather)
  pallas_ffn_sorted  the same with `moe_swiglu` from 1 token (no expert tiles)
  pallas_ffn:KEY=V/...  `moe_swiglu`'s kernels with explicit tuning, e.g.
              pallas_ffn:bm=128/bn=64/w=8/dbn=128/dw=8/st=4 (keys: `parse_ffn_tuning`)
  pallas_tiles:KEY=V/...  up to 16 tokens, the expert tiles with explicit tuning (the same
              keys but bm and cf), e.g. pallas_tiles:s=8/st=4
  pallas_fused  up to fused_moe_tokens() tokens: the model's path with `fused_expert_ffn` (the whole FFN in
              one kernel: each program a block of one expert's hidden columns, through down)
  pallas_fused:KEY=V/...  the same with explicit blocks, e.g.
              pallas_fused:bn=32/bk=128/be=256/w=4/st=3 (keys: FUSED_TUNING_KEYS)
  fused_shared  routed plus shared experts (the model's `moe_experts`, Pallas path; up to
              fused_moe_tokens() tokens): the shared ones as the fused kernel's extra pairs
  fused_shared_xla  the same with the shared ones as XLA's SwiGLU after the kernel
              (MTPJAX_FUSED_SHARED=0). These two take the shape's shared experts too (gate |
              up fused, as served), their own floor (floor_shared_us: the shared bytes and
              FLOPs added) and compare their outputs with each other only
  mgpu        the same sort/scatter with ragged_dot_mgpu (Hopper WGMMA + TMA) for the matmuls
  gather      w[ids] per (token, slot) and batched matvecs: reads each chosen expert once per
              token (duplicates at larger N); decode sizes only
Floors: decode = bytes of the distinct experts touched (3 matrices each) / same-run copy
bandwidth; prefill = FLOPs (2 * N * k * 3 * E * I) / same-run dense bf16 matmul rate
(max of the two is reported). Times: marginal per call in one jit of many calls
(`mtpjax.bench.kernels.timeit`), each call with its own routing, chained as a model's layers
are (a call's input is the previous call's output); with --timeline also the GPU time per
call from the kernels' timestamps (`kernels.chained_gpu_time`: at one token, steadier than
the wall-clock difference), whose x-floor ratios take the matmul rate on the same clock
(`matmul_rate(clock="gpu")`; `floor_gpu_us` in moe.json). GPU only for `mgpu`; the rest runs
anywhere (`--shapes tiny` is the CPU smoke test).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.bench.kernels import chained_gpu_time, copy_bandwidth, matmul_rate, rel_err, timeit
from mtpjax.model.grouped_matmul import tiled_grouped_matmul
from mtpjax.model.moe import routed_experts
from mtpjax.step_jit import STEP_COMPILER_OPTIONS

SHAPES = {
    "v2-lite": dict(experts=64, k=6, hidden=2048, width=1408, shared=2),
    "v3-slice": dict(experts=128, k=8, hidden=7168, width=2048, shared=1),
    "tiny": dict(experts=8, k=2, hidden=64, width=128, shared=1),
}
# variants of the routed and the shared experts together (their own weights, floor, reference)
SHARED_VARIANTS = ("fused_shared", "fused_shared_xla")


def log(*a):
    print(" ".join(str(x) for x in a), flush=True)


def make_weights(shape: dict, seed: int = 0) -> dict:
    X, E, I = shape["experts"], shape["hidden"], shape["width"]
    keys = jax.random.split(jax.random.key(seed), 3)

    @functools.partial(jax.jit, static_argnums=1)
    def normal(key, s):
        return (0.02 * jax.random.normal(key, s, jnp.float32)).astype(jnp.bfloat16)

    return {"w_gate": normal(keys[0], (X, E, I)), "w_up": normal(keys[1], (X, E, I)),
            "w_down": normal(keys[2], (X, I, E))}


def make_shared_weights(shape: dict, seed: int = 1) -> dict:
    """The shape's shared experts as served: shared_gate_up [E, 2S] (gate | up), shared_down
    [S, E], S = shared x width, bf16."""
    E, S = shape["hidden"], shape["shared"] * shape["width"]
    keys = jax.random.split(jax.random.key(seed), 2)
    normal = lambda key, s: (0.02 * jax.random.normal(key, s)).astype(jnp.bfloat16)  # noqa
    return {"shared_gate_up": normal(keys[0], (E, 2 * S)), "shared_down": normal(keys[1], (S, E))}


def _with_shared(fused: bool):
    """The model's routed + shared experts (`moe_experts`) on the Pallas path, the shared ones
    in the fused kernel (fused) or in XLA after it; rows routed only nowhere (`pad_routing`'s
    padding) are padding (valid False), as the model's padded steps pass them, and 0."""
    def fn(x, p, ids, w):
        from mtpjax.env_override import env_override
        from mtpjax.model.grouped_matmul import FUSED_SHARED_ENV, forced_path
        from mtpjax.model.moe import moe_experts, takes_fused_kernel
        valid = (ids < p["w_gate"].shape[0]).any(-1)
        with forced_path("pallas"), env_override(FUSED_SHARED_ENV, "1" if fused else "0"):
            if not takes_fused_kernel(p, x.shape[0]):
                raise ValueError(f"{x.shape[0]} tokens: past the fused kernel's limit")
            y = moe_experts(p, x, ids, w, valid, jax.nn.silu)
        # XLA's shared experts run on the padding rows too; zeroed (a select its add fuses)
        # as the kernel leaves them, so the two outputs compare
        return y if fused else jnp.where(valid[:, None], y, 0).astype(y.dtype)
    return fn


def make_routing(shape: dict, n: int, seed: int):
    """ids int32[n, k] (distinct per token), weights f32[n, k] summing to 1."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(shape["experts"], shape["k"], replace=False) for _ in range(n)])
    w = rng.random((n, shape["k"])).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(w / w.sum(-1, keepdims=True))


def _routed(matmul):
    """`routed_experts` with its three grouped matmuls done by `matmul`."""
    def fn(x, p, ids, w):
        return routed_experts(p, x, ids, w, jnp.ones(x.shape[0], bool), jax.nn.silu, matmul)
    return fn


experts_ragged = _routed(jax.lax.ragged_dot)
experts_tiled = _routed(tiled_grouped_matmul)


def experts_pallas(x, p, ids, w, blocks=None):
    """blocks: None (the kernel's defaults) or (block_m, block_n, block_k[, num_splits])."""
    from pallas_kernels.grouped_matmul import grouped_matmul
    tuning = {} if blocks is None else dict(zip(("block_m", "block_n", "block_k", "num_splits"),
                                                blocks))
    mm = functools.partial(grouped_matmul, interpret=jax.default_backend() != "gpu", **tuning)
    return _routed(mm)(x, p, ids, w)


def experts_pallas_ffn(x, p, ids, w):
    """The model's MoE path with the Pallas kernels forced while tracing: one row layout, gate
    and up in one kernel (`grouped_swiglu`)."""
    from mtpjax.model.grouped_matmul import forced_path
    with forced_path("pallas"):
        return routed_experts(p, x, ids, w, jnp.ones(x.shape[0], bool), jax.nn.silu)


def experts_pallas_ffn_sorted(x, p, ids, w):
    """`pallas_ffn` without the expert tiles of up to 16 tokens (`moe_swiglu`'s tile layout
    at every size)."""
    from mtpjax.model.grouped_matmul import forced_path
    with forced_path("pallas"):
        return routed_experts(p, x, ids, w, jnp.ones(x.shape[0], bool), jax.nn.silu,
                              expert_tiles=False)


FFN_TUNING_KEYS = {"bm": "block_m", "bn": 0, "bk": 1, "s": 2, "w": 3, "dbn": 0, "dbk": 1,
                   "ds": 2, "dw": 3, "st": "num_stages", "cf": "columns_fastest", "mg": "kernel",
                   "pe": "persistent", "bt": "band_tiles"}


def parse_ffn_tuning(spec: str) -> dict:
    """"bm=128/bn=64/w=8/st=4" -> grouped_swiglu keyword arguments. Keys: bm (block_m), bn /
    bk / s / w (gate-up block_n, block_k, splits, warps), dbn / dbk / ds / dw (the same for
    down), st (num_stages), cf (columns_fastest: 1 runs column blocks fastest), mg (1: the
    Mosaic-GPU kernels, 0: the Triton ones; bn, dbn and st apply to both), pe (with mg=1:
    1 for a persistent grid of one CTA per SM, or a CTA count), bt (with mg=1: the work
    items' band size, 1 for column blocks fastest)."""
    kw, gu, down = {}, [None] * 4, [None] * 4
    for item in filter(None, spec.split("/")):
        key, _, val = item.partition("=")
        if key not in FFN_TUNING_KEYS or not val.isdigit():
            raise ValueError(f"pallas_ffn tuning {item!r}: expected KEY=INT with KEY in "
                             f"{sorted(FFN_TUNING_KEYS)}")
        slot = FFN_TUNING_KEYS[key]
        if slot == "kernel":
            kw[slot] = "mosaic" if int(val) else "triton"
        elif slot == "persistent":
            kw[slot] = True if int(val) == 1 else int(val)
        elif isinstance(slot, str):
            kw[slot] = int(val)
        else:
            (down if key.startswith("d") else gu)[slot] = int(val)
    return dict(kw, gate_up_blocks=tuple(gu), down_blocks=tuple(down))


def experts_pallas_ffn_tuned(x, p, ids, w, tuning: dict):
    """The model's prefill layout (`moe_swiglu`: no sort, the rows scattered into the tile
    layout and the weighted sum read out of it) with the kernels given explicit tuning (a
    sweep of the prefill tiles)."""
    from pallas_kernels.grouped_matmul.routed_ffn import moe_swiglu
    return moe_swiglu(x, ids, w, p["w_gate"], p["w_up"], p["w_down"], activation=jax.nn.silu,
                      interpret=jax.default_backend() != "gpu", **tuning)


def experts_pallas_tiles_tuned(x, p, ids, w, tuning: dict):
    """The model's path with `expert_tile_swiglu` given explicit tuning (up to 16 tokens; a
    sweep of the decode tiles). Keys as `parse_ffn_tuning`'s but bm and cf (the tiles are 16
    rows, in one grid order)."""
    from mtpjax.model.grouped_matmul import forced_path
    from pallas_kernels.grouped_matmul.expert_tiles import expert_tile_swiglu
    tiles = functools.partial(expert_tile_swiglu, interpret=jax.default_backend() != "gpu",
                              **tuning)
    with forced_path("pallas"):
        return routed_experts(p, x, ids, w, jnp.ones(x.shape[0], bool), jax.nn.silu,
                              tile_swiglu=lambda *a: tiles(*a[:5], activation=a[5]))


FUSED_TUNING_KEYS = {"bn": "block_n", "bk": "block_k", "be": "block_e", "w": "num_warps",
                     "st": "num_stages"}


def parse_fused_tuning(spec: str) -> dict:
    """"bn=32/bk=128/w=4" -> fused_expert_ffn keyword arguments (FUSED_TUNING_KEYS)."""
    kw = {}
    for item in filter(None, spec.split("/")):
        key, _, val = item.partition("=")
        if key not in FUSED_TUNING_KEYS or not val.isdigit():
            raise ValueError(f"pallas_fused tuning {item!r}: expected KEY=INT with KEY in "
                             f"{sorted(FUSED_TUNING_KEYS)}")
        kw[FUSED_TUNING_KEYS[key]] = int(val)
    return kw


def experts_pallas_fused(x, p, ids, w, tuning=None):
    """The model's path with a token or two's experts in one kernel (`fused_expert_ffn`)."""
    from mtpjax.model.grouped_matmul import forced_path
    from pallas_kernels.grouped_matmul.fused_ffn import MAX_TOKENS, fused_expert_ffn
    if x.shape[0] > MAX_TOKENS:
        raise ValueError(f"pallas_fused takes at most {MAX_TOKENS} tokens, got {x.shape[0]}")
    fused = functools.partial(fused_expert_ffn, interpret=jax.default_backend() != "gpu",
                              **(tuning or {}))
    with forced_path("pallas"):
        return routed_experts(p, x, ids, w, jnp.ones(x.shape[0], bool), jax.nn.silu,
                              tile_swiglu=lambda *a: fused(*a[:5], activation=a[5]))


def pallas_variants(use) -> list:
    """("pallas", fn) and one ("pallas:BM/BN/BK[/S]", fn) per such entry of `use` (S: split-K);
    "pallas_ffn", "pallas_ffn_sorted", and one ("pallas_ffn:KEY=V/...", fn) or
    ("pallas_tiles:KEY=V/...", fn) per such entry (`parse_ffn_tuning`)."""
    out = [("pallas", experts_pallas)] if "pallas" in use else []
    if "pallas_ffn" in use:
        out.append(("pallas_ffn", experts_pallas_ffn))
    if "pallas_ffn_sorted" in use:
        out.append(("pallas_ffn_sorted", experts_pallas_ffn_sorted))
    if "pallas_fused" in use:
        out.append(("pallas_fused", experts_pallas_fused))
    out += [(v, _with_shared(v == "fused_shared")) for v in SHARED_VARIANTS if v in use]
    for v in use:
        if v.startswith("pallas_fused:"):
            out.append((v, functools.partial(experts_pallas_fused,
                                              tuning=parse_fused_tuning(v.split(":", 1)[1]))))
        if v.startswith("pallas_tiles:"):
            tuning = parse_ffn_tuning(v.split(":", 1)[1])
            if set(tuning) - {"gate_up_blocks", "down_blocks", "num_stages"}:
                raise ValueError(f"variant {v!r}: expert tiles take no bm or cf")
            out.append((v, functools.partial(experts_pallas_tiles_tuned, tuning=tuning)))
        if v.startswith("pallas_ffn:"):
            out.append((v, functools.partial(experts_pallas_ffn_tuned,
                                              tuning=parse_ffn_tuning(v.split(":", 1)[1]))))
        if v.startswith("pallas:"):
            blocks = tuple(int(b) for b in v.split(":", 1)[1].split("/"))
            if len(blocks) not in (3, 4):
                raise ValueError(f"variant {v!r}: expected pallas:BLOCK_M/BLOCK_N/BLOCK_K"
                                 "[/NUM_SPLITS]")
            out.append((v, functools.partial(experts_pallas, blocks=blocks)))
    return out


def experts_gather(x, p, ids, w):
    """x [N, E] -> [N, E]: each token's k experts gathered ([N, k, E, I]) and applied."""
    g = jnp.einsum("ne,nkei->nki", x, p["w_gate"][ids])
    u = jnp.einsum("ne,nkei->nki", x, p["w_up"][ids])
    h = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    y = jnp.einsum("nki,nkie->nke", h, p["w_down"][ids]).astype(jnp.float32)
    return (y * w[..., None]).sum(1).astype(x.dtype)


def _mgpu_dot(lhs, rhs, sizes, block_m):
    """ragged_dot_mgpu with block sizes that divide the operand dims."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    n = rhs.shape[2]
    bn = 128 if n % 128 == 0 else 64
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, group_sizes=sizes, block_m=block_m, block_n=bn,
                                      block_k=64, max_concurrent_steps=4, grid_block_n=1)


def experts_mgpu(x, p, ids, w, block_m=64):
    """`routed_experts` with the three grouped matmuls on ragged_dot_mgpu."""
    N, k = ids.shape
    X = p["w_gate"].shape[0]
    expert = ids.reshape(-1)
    order = jnp.argsort(expert, stable=True)
    token = order // k
    sizes = jnp.zeros(X, jnp.int32).at[expert].add(1)
    xs = x[token]
    dot = functools.partial(_mgpu_dot, sizes=sizes, block_m=block_m)
    h = (jax.nn.silu(dot(xs, p["w_gate"]).astype(jnp.float32))
         * dot(xs, p["w_up"]).astype(jnp.float32)).astype(x.dtype)
    y = dot(h, p["w_down"]).astype(jnp.float32) * w.reshape(-1)[order][:, None]
    return jnp.zeros((N, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


def floor_s(shape: dict, ids, n: int, copy_bw: float, flops: float,
            shared: bool = False) -> tuple[float, float, int]:
    """shared: the shared experts' bytes and FLOPs (shape["shared"] experts of width I) too."""
    E, I = shape["hidden"], shape["width"]
    touched = int(np.unique(np.asarray(ids)).size)
    matrices = touched + (shape["shared"] if shared else 0)
    bytes_ = matrices * 3 * E * I * 2 + 2 * n * E * 2
    fl = 2 * n * (shape["k"] + (shape["shared"] if shared else 0)) * 3 * E * I
    return max(bytes_ / copy_bw, fl / flops), bytes_, touched


def pad_routing(shape: dict, ids, w, pad_to: int):
    """The engine's padded step: rows past the n real tokens routed to no expert (id = the
    expert count, which `routed_experts` treats as none) with weight 0."""
    n, k = ids.shape
    if pad_to <= n:
        return ids, w
    none = jnp.full((pad_to - n, k), shape["experts"], jnp.int32)
    return jnp.concatenate([ids, none]), jnp.concatenate([w, jnp.zeros((pad_to - n, k))])


def run(shape_names, token_counts, out_dir=None,
        use=("ragged_dot", "tiled", "pallas", "pallas_ffn", "mgpu", "gather"), pad_to: int = 0,
        independent: bool = False, timeline: bool = False, calls: int = 0):
    """pad_to: run each token count in a batch of this many rows, the rest padding (as the
    engine's token buckets do; floors count the real tokens). `mgpu` and `gather` then skip.
    independent: time independent calls (the older method), not chained.
    timeline: also the GPU time per call from the kernels' own timestamps
    (`kernels.chained_gpu_time`: the span of the same calls, host dispatch excluded).
    calls: calls per timed jit; 0 for the defaults (on the GPU 16, 4 beyond 256 tokens; off it
    8). Fewer than 8 time the whole jit's average (`timeit`), one compile per variant: the
    CPU smoke test's tiny run."""
    if not isinstance(calls, int) or calls < 0:
        raise ValueError(f"calls must be an int >= 0 (0: the defaults), got {calls!r}")
    on_gpu = jax.default_backend() == "gpu"
    copy_bw, _ = copy_bandwidth() if on_gpu else (1e11, {})
    flops = matmul_rate(8192 if on_gpu else 256, reps=2 if on_gpu else 1)
    # The GPU-time rows' floor takes the matmul rate on the same clock (the kernels' span):
    # the wall clock's fixed dispatch cost would read the rate low.
    flops_gpu = matmul_rate(8192, reps=2, clock="gpu") if timeline and on_gpu else None
    log(f"device {jax.devices()[0].device_kind}; copy {copy_bw / 1e12:.3f} TB/s; "
        f"bf16 matmul {flops / 1e12:.1f} TFLOP/s (wall)"
        + (f", {flops_gpu / 1e12:.1f} (GPU span)" if flops_gpu else ""))
    rows = []
    for name in shape_names:
        shape = SHAPES[name]
        p = make_weights(shape)
        p_shared = (dict(p, **make_shared_weights(shape))
                    if any(v in use for v in SHARED_VARIANTS) else None)
        for n in token_counts:
            # off the GPU (interpreted kernels: a smoke test) the fewest calls timeit's
            # marginal method takes, and few repeats
            n_calls = calls or ((16 if n <= 256 else 4) if on_gpu else 8)
            # each call its own tokens and routing: with one routing shared by every call, XLA
            # computes routing-only work (the tiled path's weight gather) once for all calls
            routings = [make_routing(shape, n, seed=1000 * n + i) for i in range(n_calls)]
            ids, w = routings[0]
            rows_in = max(n, pad_to)
            xs = [(0.5 * jax.random.normal(jax.random.key(100 + i), (rows_in, shape["hidden"]),
                                           jnp.bfloat16), *pad_routing(shape, *routings[i], pad_to))
                  for i in range(n_calls)]
            fl, nbytes, touched = floor_s(shape, ids, n, copy_bw, flops)
            row = dict(shape=name, tokens=n, touched=touched, floor_us=fl * 1e6,
                       floor_bytes=nbytes, **({"padded_to": rows_in} if rows_in > n else {}))
            if flops_gpu:
                row["floor_gpu_us"] = floor_s(shape, ids, n, copy_bw, flops_gpu)[0] * 1e6
            fl_shared = floor_s(shape, ids, n, copy_bw, flops, shared=True)[0]
            if p_shared is not None:
                row["floor_shared_us"] = fl_shared * 1e6
                if flops_gpu:
                    row["floor_shared_gpu_us"] = floor_s(shape, ids, n, copy_bw, flops_gpu,
                                                         shared=True)[0] * 1e6
            refs = {}                   # the first output of each kind (routed, with shared)
            variants = [("ragged_dot", experts_ragged), ("tiled", experts_tiled),
                        *pallas_variants(use)]
            if on_gpu or name == "tiny":
                variants.append(("mgpu", experts_mgpu))
            if n <= 32:
                variants.append(("gather", experts_gather))
            variants = [v for v in variants if (v[0] in use or ":" in v[0])
                        and not (rows_in > n and v[0] in ("mgpu", "gather"))]
            for vname, fn in variants:
                try:
                    if vname == "mgpu" and not on_gpu:
                        continue
                    # the model's step options: every call here shares the weights, and
                    # XLA's dot merger (off in the model's steps) would merge the calls'
                    # dense ragged_dots into one that reads the experts once for all
                    # (ragged_dot measured 0.55x its floor on the H100 that way)
                    layer = lambda q, p: fn(q[0], p, q[1], q[2])          # noqa: E731
                    chain = None if independent else lambda q, y: (y, *q[1:])  # noqa: E731
                    kind = "shared" if vname in SHARED_VARIANTS else "routed"
                    weights = p_shared if kind == "shared" else p
                    t, out = timeit(layer, xs, (weights,), repeats=15 if on_gpu else 2,
                                    compiler_options=STEP_COMPILER_OPTIONS, chain=chain)
                    gpu = chained_gpu_time(layer, xs, (weights,), STEP_COMPILER_OPTIONS,
                                           chain) if timeline else None
                    if gpu:
                        row[f"{vname}_gpu_us"] = gpu["span_us"]
                        row[f"{vname}_gpu_kernels"] = gpu["kernels"]
                    err = rel_err(out, refs[kind]) if kind in refs else 0.0
                    refs.setdefault(kind, out)
                    row[f"{vname}_us"] = t * 1e6
                    row[f"{vname}_x_floor"] = t / (fl_shared if kind == "shared" else fl)
                    row[f"{vname}_err"] = err
                except Exception as e:  # noqa: BLE001
                    row[f"{vname}_error"] = repr(e)[:300]
                    log(f"{name} n={n} {vname} failed: {repr(e)[:300]}")
                    traceback.print_exc()
            log(json.dumps(row))
            rows.append(row)
            if out_dir:
                with open(os.path.join(out_dir, "moe.json"), "w") as f:
                    json.dump(dict(copy_bw=copy_bw, matmul_flops=flops,
                                   matmul_flops_gpu=flops_gpu, rows=rows), f, indent=1)
        del p, p_shared
    print(table(rows), flush=True)
    return rows


def table(rows) -> str:
    """One column per variant that ran (or failed) in any row, in the order first seen."""
    names = []
    for r in rows:
        for key in r:
            for suffix in ("_us", "_error"):
                if (key.endswith(suffix) and not key.startswith("floor")
                        and not key.endswith("_gpu_us")):
                    name = key[:-len(suffix)]
                    if name not in names:
                        names.append(name)

    def cell(r, v):
        if f"{v}_us" not in r:
            return "fail" if f"{v}_error" in r else "-"
        wall = f"{r[f'{v}_us']:.0f} ({r[f'{v}_x_floor']:.2f}x)"
        if f"{v}_gpu_us" not in r:
            return wall
        g = r[f"{v}_gpu_us"]
        floor = "floor_shared" if v in SHARED_VARIANTS else "floor"
        floor_us = r.get(f"{floor}_gpu_us", r[f"{floor}_us"])
        return (f"{wall}; GPU {g:.1f} ({g / floor_us:.2f}x, "
                f"{r[f'{v}_gpu_kernels']:.0f} kernels)")
    # floor us: wall-clock rates; the GPU cells' ratios are to the floor with the GPU-span
    # matmul rate (floor_gpu_us in the json) where it was measured.
    lines = ["| shape | tokens | experts touched | floor us | "
             + " | ".join(f"{v} us (x floor)" for v in names) + " |",
             "|---|---|---|---|" + "---|" * len(names)]
    for r in rows:
        tokens = f"{r['tokens']} of {r['padded_to']}" if "padded_to" in r else r["tokens"]
        lines.append(f"| {r['shape']} | {tokens} | {r['touched']} | {r['floor_us']:.0f} | "
                     + " | ".join(cell(r, v) for v in names) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="v2-lite,v3-slice")
    ap.add_argument("--tokens", default="1,32,256,4096")
    ap.add_argument("--variants", default="ragged_dot,tiled,pallas,pallas_ffn,mgpu,gather")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pad-to", type=int, default=0,
                    help="each token count in a batch of this many rows, the rest padding routed "
                         "nowhere (the engine pads a batch-1 decode step to 8 tokens)")
    ap.add_argument("--independent", action="store_true",
                    help="time independent calls, not each call on the previous one's output "
                         "(the older method; XLA then interleaves the "
                         "calls' layout ops)")
    ap.add_argument("--timeline", action="store_true",
                    help="also each variant's GPU time per call from its kernels' timestamps "
                         "(span of the chained calls, host dispatch excluded; GPU only)")
    ap.add_argument("--calls", type=int, default=0,
                    help="calls per timed jit (default 0: 16 on the GPU, 4 beyond 256 tokens, 8 "
                         "off it); fewer than 8 time the whole jit's average, one compile each")
    a = ap.parse_args(argv)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
    run(a.shapes.split(","), [int(t) for t in a.tokens.split(",")], a.out,
        tuple(a.variants.split(",")), a.pad_to, a.independent, a.timeline, a.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
