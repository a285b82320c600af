"""The routed experts' SwiGLU FFN for a few tokens: one 16-row tile per touched expert, no sort.

    y[n, j] = w_down[e](activation(x[n] @ w_gate[e]) * (x[n] @ w_up[e])),  e = ids[n, j]

x [N, E] (N <= TILE_ROWS tokens), ids int32[N, k] (an id < 0 or >= the number of experts: the
pair is routed nowhere and its row is zero), w_gate / w_up [G, E, I], w_down [G, I, E] ->
y float32[N, k, E], each (token, slot) pair's expert output, unweighted.

Why: at decode sizes the sorted layout of `grouped_swiglu` (argsort, group sizes, cumulative
ends, a search per row, scatters and gathers) is a dozen small kernels around two short
matmuls, which cost more than the matmuls at one DeepSeek-V2-Lite token. Here the layout is one
[P, P] comparison of the P = N x k pairs' experts: pair p goes to the tile of its expert's
first pair, at the row given by how many earlier pairs chose that expert (a token's k experts
are distinct, so at most N <= 16 rows share a tile); the tiles' experts and each layout row's
pair come from comparisons too ([tiles, P] and [rows, P]), with no scatter. Each touched
expert's weights are read once, as in the sorted layout. The tile count is static,
min(P, G); tiles past the touched experts have group -1 and do nothing (kernel.py).

Split-K partials are summed only over the pairs' rows (gathered first): the partials of
empty tiles are never written nor read.

One token (batch-1 decode) needs no layout at all: its k experts are distinct, so pair p owns
tile p. Its rows are a broadcast and its outputs a strided slice: beside the two kernels only
small elementwise fusions run (five with the default split-K blocks, H100 Nsight Compute; a
guard test checks the export holds no gather, sort or scatter).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.grouped_matmul import gather_rows, grouped_pallas_call
from pallas_kernels.grouped_matmul.kernel import grouped_gate_up_kernel, grouped_matmul_kernel
from pallas_kernels.grouped_matmul.routed_ffn import resolve_ffn_blocks

TILE_ROWS = 16          # Triton's smallest dot; also the most tokens this layout takes


def expert_tile_layout(experts: jax.Array, num_experts: int):
    """experts int32[P] (< 0 or >= num_experts: none) -> (slot int32[P]: each pair's row in the
    [n_tiles * TILE_ROWS] layout, n_tiles * TILE_ROWS for none; tile_group int32[n_tiles]:
    each tile's expert, -1 when unused; source int32[n_tiles * TILE_ROWS]: the pair in each
    row of the layout, -1 for none), n_tiles = min(P, num_experts). Assumes no expert appears
    more than TILE_ROWS times (true when P / k <= TILE_ROWS tokens chose distinct experts
    each).

    Comparisons and reductions only, no scatter: on the GPU each XLA scatter is two kernels (its
    buffer's fill, then the scatter), ~2.5 us each at these sizes, and the layout's two
    scatters would be four of the nine small kernels around the 1-token layer's matmuls."""
    P = experts.shape[0]
    n_tiles = min(P, num_experts)
    idx = jnp.arange(P, dtype=jnp.int32)
    real = (experts >= 0) & (experts < num_experts)
    e = jnp.where(real, experts, -1 - idx)                    # none: a value no other pair has
    same = e[:, None] == e[None, :]                           # [P, P]
    rank = jnp.sum(same & (idx[None, :] < idx[:, None]), axis=1, dtype=jnp.int32)
    first = jnp.argmax(same, axis=1).astype(jnp.int32)        # the expert's first pair
    opens = real & (rank == 0)                                # this pair opens its expert's tile
    tile_of = jnp.cumsum(opens.astype(jnp.int32)) - 1         # tiles numbered in pair order
    tile = tile_of[first]
    rows = n_tiles * TILE_ROWS
    slot = jnp.where(real, tile * TILE_ROWS + rank, rows).astype(jnp.int32)
    opener = opens[None, :] & (tile_of[None, :] == jnp.arange(n_tiles, dtype=jnp.int32)[:, None])
    tile_group = jnp.max(jnp.where(opener, e[None, :], -1), axis=1).astype(jnp.int32)
    here = slot[None, :] == jnp.arange(rows, dtype=jnp.int32)[:, None]     # [rows, P]
    source = jnp.max(jnp.where(here, idx[None, :], -1), axis=1).astype(jnp.int32)
    return slot, tile_group, source


def _pair_rows(out: jax.Array, slot: jax.Array, num_splits: int) -> jax.Array:
    """The pairs' rows of a kernel output ([Mp, N], or [S, Mp, N] split-K partials, summed
    after the gather) -> float32 [P, N]; a pair in no tile gets a clamped row (masked later)."""
    Mp = out.shape[-2]
    s = jnp.minimum(slot, Mp - 1)
    if num_splits == 1:
        return out[s].astype(jnp.float32)
    return out[:, s].sum(0)


def _tile_first_rows(out: jax.Array, num_splits: int) -> jax.Array:
    """Each tile's first row of a kernel output ([Mp, N], or [S, Mp, N] split-K partials,
    summed) -> float32 [Mp / TILE_ROWS, N]: the one-token layout's pair rows."""
    first = out[..., ::TILE_ROWS, :].astype(jnp.float32)
    return first if num_splits == 1 else first.sum(0)


@functools.partial(jax.jit, static_argnames=("activation", "gate_up_blocks", "down_blocks",
                                             "num_stages", "interpret"))
def expert_tile_swiglu(x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                       w_down: jax.Array, *, activation=jax.nn.silu,
                       gate_up_blocks: tuple | None = None, down_blocks: tuple | None = None,
                       num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """See the module docstring. gate_up_blocks / down_blocks: (block_n, block_k, num_splits,
    num_warps), any entry None for its default: chosen for the k tiles one token touches (the
    decode case at batch 1, where every SM must share the weight read); more touched experts
    only add programs. ValueError for shapes, dtypes or blocks the kernels cannot take."""
    if x.ndim != 2 or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [N, E] and ids [N, k] with the same N, got x "
                         f"{tuple(x.shape)} and ids {tuple(ids.shape)}")
    N, k = ids.shape
    if N > TILE_ROWS:
        raise ValueError(f"expert tiles take at most {TILE_ROWS} tokens, got {N}: use "
                         "grouped_swiglu's sorted layout")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    P = N * k
    _, (bn, bk, splits, warps), (dbn, dbk, dsplits, dwarps) = resolve_ffn_blocks(
        x, w_gate, w_up, w_down, None, P, TILE_ROWS, gate_up_blocks, down_blocks,
        tiles=min(k, w_gate.shape[0]))
    G, E, I = w_gate.shape

    experts = ids.reshape(P).astype(jnp.int32)
    real = (experts >= 0) & (experts < G)
    one_token = N == 1 and P <= G
    if one_token:
        # Batch-1 decode: the token's k experts are distinct, so pair p has tile p to itself
        # and the layout is static. Every row of a tile holds the pair's row (a broadcast, not
        # a gather), the kernels' outputs are read at each tile's first row (a strided
        # slice): no comparisons, cumulative sums or gathers around the kernels.
        tile_group = jnp.where(real, experts, -1)

        def to_layout(rows):                    # [P, D] per pair -> [P * TILE_ROWS, D]
            return jnp.repeat(rows, TILE_ROWS, axis=0)

        pair_rows = _tile_first_rows
        xp = to_layout(jnp.broadcast_to(x, (P, E)))
    else:
        slot, tile_group, source = expert_tile_layout(experts, G)

        def to_layout(rows):
            return gather_rows(rows, source)

        pair_rows = functools.partial(_pair_rows, slot=slot)
        xp = gather_rows(x, jnp.where(source >= 0, source // k, -1))   # pair p: token p // k
    call = functools.partial(grouped_pallas_call, num_stages=num_stages, interpret=interpret,
                             block_m=TILE_ROWS)
    gate_up = functools.partial(grouped_gate_up_kernel, block_k=bk, block_n=bn,
                                num_splits=splits, activation=activation)
    out = call(gate_up, xp, (w_gate, w_up), tile_group, N=I, n_outputs=1 if splits == 1 else 2,
               block_n=bn, num_splits=splits, num_warps=warps, name="expert_tiles_gate_up")
    if splits == 1:
        hp = out[0]
    else:                            # the pairs' rows only, summed, back into the layout
        h = activation(pair_rows(out[0], num_splits=splits)) * pair_rows(out[1],
                                                                         num_splits=splits)
        hp = to_layout(h.astype(x.dtype))
    down = functools.partial(grouped_matmul_kernel, block_k=dbk, block_n=dbn, num_splits=dsplits)
    yp, = call(down, hp, (w_down,), tile_group, N=E, n_outputs=1, block_n=dbn,
               num_splits=dsplits, num_warps=dwarps, name="expert_tiles_down")
    y = pair_rows(yp, num_splits=dsplits)                     # [P, E]
    return jnp.where(real[:, None], y, 0.0).reshape(N, k, E)
