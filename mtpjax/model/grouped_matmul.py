"""Grouped matmul of the MoE experts: a Pallas kernel on one GPU, `jax.lax.ragged_dot` elsewhere.

`ragged_dot(x [M, E], w [G, E, I], sizes [G])` multiplies each group of consecutive rows by its
own expert. XLA 0.11.2 lowers it on the GPU to one dense dot over *every* group (it writes the
rows masked per group, [M, G, E], and contracts over groups x hidden: read from the optimized
HLO, docs/benchmarks.md): it reads every expert's weights whatever the routing — 12x the
touched experts' bytes at one DeepSeek-V2-Lite token (421 vs 35 us on the H100, compiled as
the model's steps are; an earlier 50 us was XLA's dot merger sharing one read between the
benchmark's calls) — and G times the FLOPs at prefill sizes (62x its floor at 4096 tokens).

`pallas_kernels.grouped_matmul` (a Pallas Triton kernel: each row tile reads its expert's weights
in place) is therefore what one GPU runs at every size (`matmul_choice`); measured in
docs/benchmarks.md. The MoE layer calls `grouped_swiglu`, which on that path lays the rows out
once for all three projections and computes gate and up in one kernel. Only on one GPU or per
device inside the expert-parallel layer: with experts sharded over a mesh by XLA, a kernel
would need the other devices' weights.

`tiled_grouped_matmul` is exact and costs what the rows need: each group's rows are padded to
a multiple of `tile` and laid out tile by tile, every tile takes its group's weight matrix
(a gather of [tiles, E, I]), and one batched matmul does the rest. Its waste is bounded: at most
G x (tile - 1) padding rows and G spare tiles. Used where forced:
`MTPJAX_MOE_MATMUL=ragged|tiled|pallas|auto` overrides the choice.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from mtpjax.env_override import env_override

from pallas_kernels.grouped_matmul.fused_ffn import MAX_TOKENS as FUSED_MAX_TOKENS
from pallas_kernels.grouped_matmul.grouped_matmul import pad_rows, tile_layout

ENV = "MTPJAX_MOE_MATMUL"
FUSED_TOKENS_ENV = "MTPJAX_FUSED_MOE_TOKENS"
# the most tokens the MoE layer sends through the fused one-launch kernel: a batch-1 decode
# (one row, or generate's two) and a K <= 3 verify at batch 1 (H200, V2-Lite, batch 1, K=3:
# 5.63 ms a step against 5.97 with the expert tiles for its four tokens)
DEFAULT_FUSED_TOKENS = 4
FUSED_SHARED_ENV = "MTPJAX_FUSED_SHARED"


def fused_moe_tokens() -> int:
    """Up to this many tokens (static) the Pallas path runs the routed FFN as `fused_moe_ffn`
    (one launch, each pair reading its expert), beyond it as expert tiles (one tile per
    touched expert). `MTPJAX_FUSED_MOE_TOKENS=n` (0..FUSED_MAX_TOKENS) overrides the default;
    read when the layer is traced."""
    raw = os.environ.get(FUSED_TOKENS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_FUSED_TOKENS
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if not 0 <= n <= FUSED_MAX_TOKENS:
        raise ValueError(f"{FUSED_TOKENS_ENV}={raw!r}: expected an int 0..{FUSED_MAX_TOKENS}")
    return n


def fused_shared_experts() -> bool:
    """Where the MoE layer runs `fused_moe_ffn`, does the kernel also run the shared experts
    (as extra pairs of weight 1), rather than XLA's SwiGLU after it? `MTPJAX_FUSED_SHARED=0|1`
    (default 1); read when the layer is traced."""
    raw = os.environ.get(FUSED_SHARED_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{FUSED_SHARED_ENV}={raw!r}: expected 0 or 1")
    return raw != "0"


def tile_rows(M: int, G: int) -> int:
    """Rows per tile for M rows over G groups (static): the mean group size rounded up to a
    power of two, within [16, 256] — padding stays below one tile per group, and the weight
    gather below M / tile + G matrices."""
    mean = max(M // max(G, 1), 1)
    return min(256, max(16, 1 << (mean - 1).bit_length()))


def tiled_grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array,
                         tile: int | None = None) -> jax.Array:
    """x [M, E] rows sorted by group, w [G, E, I], sizes int32[G] with sum(sizes) <= M ->
    [M, I] in x's dtype (float32 accumulation), row r multiplied by its group's matrix; rows
    past sum(sizes) are zero (as `ragged_dot` gives them)."""
    M, E = x.shape
    G, _, I = w.shape
    m = tile or tile_rows(M, G)
    dest, tile_group, Mp = tile_layout(sizes, M, m)          # shared with the Pallas kernel
    xp = pad_rows(x, dest, Mp)
    wt = w[jnp.maximum(tile_group, 0)]          # [n_tiles, E, I]; tiles past the groups: any
    yp = jnp.einsum("tme,tei->tmi", xp.reshape(Mp // m, m, E), wt,
                    preferred_element_type=jnp.float32).reshape(Mp, I)
    y = yp[jnp.minimum(dest, Mp - 1)]
    return jnp.where((dest < Mp)[:, None], y, 0.0).astype(x.dtype)


def forced_path(path: str | None):
    """`MTPJAX_MOE_MATMUL=path` inside the block (None: left as it is). The choice is read when
    the MoE layer is traced, so only programs traced inside see it."""
    return env_override(ENV, path)


def matmul_choice(rows: int, groups: int, per_device: bool = False) -> str:
    """"ragged" or "pallas" ("tiled" only when forced) for `rows` grouped rows over `groups`
    groups (static). per_device: called inside `shard_map` on one device's own experts (the
    expert-parallel MoE), where a kernel reads only local weights."""
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced not in ("auto", "ragged", "tiled", "pallas"):
        raise ValueError(f"{ENV}={forced!r}: expected auto, ragged, tiled or pallas")
    if forced != "auto":
        return forced
    # one GPU only: with experts sharded over a mesh, a kernel (or the tiled form's gather)
    # would need other devices' experts (ragged_dot's partition keeps them local: docs/parallel.md)
    one_gpu = jax.default_backend() == "gpu" and (per_device or jax.device_count() == 1)
    return "pallas" if one_gpu else "ragged"


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array,
                   per_device: bool = False) -> jax.Array:
    """`ragged_dot(x, w, sizes)`, by the path `matmul_choice` picks for these shapes."""
    choice = matmul_choice(x.shape[0], w.shape[0], per_device)
    if choice == "pallas":          # interpreted off the GPU (only when forced there)
        from pallas_kernels.grouped_matmul import grouped_matmul as pallas_grouped_matmul
        return pallas_grouped_matmul(x, w, sizes, interpret=jax.default_backend() != "gpu")
    if choice == "tiled":
        return tiled_grouped_matmul(x, w, sizes)
    return jax.lax.ragged_dot(x, w, sizes)


def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   sizes: jax.Array, activation, per_device: bool = False) -> jax.Array:
    """The routed experts' FFN over rows sorted by expert: ragged_dot(activation(ragged_dot(x,
    w_gate)) * ragged_dot(x, w_up), w_down) -> [M, E] in x's dtype. On the Pallas path
    (`matmul_choice`) one row layout and two kernels (`pallas_kernels.grouped_matmul.
    grouped_swiglu`: gate and up in one launch); elsewhere three `grouped_matmul`s."""
    if matmul_choice(x.shape[0], w_gate.shape[0], per_device) == "pallas":
        from pallas_kernels.grouped_matmul import grouped_swiglu as pallas_grouped_swiglu
        return pallas_grouped_swiglu(x, w_gate, w_up, w_down, sizes, activation=activation,
                                     interpret=jax.default_backend() != "gpu")
    mm = lambda a, w: grouped_matmul(a, w, sizes, per_device)              # noqa: E731
    return mm(activation(mm(x, w_gate)) * mm(x, w_up), w_down)


def moe_swiglu(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, activation, out_dtype) -> jax.Array:
    """`pallas_kernels.grouped_matmul.moe_swiglu` (the routed FFN from token order and back,
    no sort: the pairs scattered into the tile layout by a row kernel, the weighted sum
    gathered out of it in one pass), interpreted off the GPU (there only when forced): x
    [N, E], ids int32[N, k] (outside [0, G): none), weights f32[N, k] -> [N, E]."""
    from pallas_kernels.grouped_matmul.routed_ffn import moe_swiglu as kernel_ffn
    return kernel_ffn(x, ids, weights, w_gate, w_up, w_down, activation=activation,
                      out_dtype=out_dtype, interpret=jax.default_backend() != "gpu")


def uses_expert_tiles(tokens: int, groups: int, per_device: bool = False) -> bool:
    """Does the MoE layer run `expert_tile_swiglu` (one tile per touched expert, no sort) for
    this many tokens (static)? On the Pallas path, up to its 16-token limit."""
    from pallas_kernels.grouped_matmul.expert_tiles import TILE_ROWS
    return tokens <= TILE_ROWS and matmul_choice(tokens, groups, per_device) == "pallas"


def expert_tile_swiglu(x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, activation) -> jax.Array:
    """`pallas_kernels.grouped_matmul.expert_tile_swiglu`, interpreted off the GPU (there only
    when forced): x [N, E], ids int32[N, k] (-1: none) -> float32 [N, k, E]."""
    from pallas_kernels.grouped_matmul.expert_tiles import expert_tile_swiglu as kernel_ffn
    return kernel_ffn(x, ids, w_gate, w_up, w_down, activation=activation,
                      interpret=jax.default_backend() != "gpu")


def fused_moe_ffn(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, activation, **shared) -> jax.Array:
    """`pallas_kernels.grouped_matmul.fused_moe_ffn` (a few tokens' routed experts and their
    weighted sum in one kernel and one reduction), interpreted off the GPU (there only when
    forced): x [N, E] (N <= FUSED_MAX_TOKENS, the kernel's limit), ids int32[N, k] (-1: none),
    weights f32[N, k] -> float32 [N, E]. shared: the kernel's shared-expert keywords
    (shared_gate_up or shared_gate / shared_up, shared_down, valid bool[N]), whose SwiGLU the
    sum then holds too."""
    from pallas_kernels.grouped_matmul.fused_ffn import fused_moe_ffn as kernel_ffn
    return kernel_ffn(x, ids, weights, w_gate, w_up, w_down, activation=activation,
                      interpret=jax.default_backend() != "gpu", **shared)
