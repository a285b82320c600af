"""The routed experts' whole SwiGLU FFN on the grouped-matmul kernels, in one row layout:

    y = ragged_dot(activation(ragged_dot(x, w_gate)) * ragged_dot(x, w_up), w_down)

x [M, E] holds (token, expert) rows sorted by expert, `sizes[g]` rows for expert g; w_gate and
w_up [G, E, I], w_down [G, I, E]. Three `grouped_matmul` calls would lay the rows out and
gather them back three times and launch three kernels; here the rows are laid out once
(`tile_layout`), one kernel computes gate and up together (x loaded once for both, and without
split-K the hidden row activation(gate) * up is written directly: kernel.py), the down
projection reads the hidden rows in the same layout, and the output rows are gathered once.
At decode sizes, where each matmul is a few microseconds of weight reads, the launches and
layout ops saved are a large part of the layer (docs/benchmarks.md, round 3 session 9: the
three-call layer at one DeepSeek-V2-Lite token took 102 us for 35 us of weight bytes).
The activation runs in float32 on the float32 sums (the three-call form rounds gate and up to
x's dtype first): outputs agree to that rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul.grouped_matmul import (check_ffn_weights, check_operands,
                                                          check_splits,
                                                          grouped_pallas_call, pad_rows,
                                                          padded_grouped_matmul, resolve_blocks,
                                                          tile_layout, unpad_rows)
from pallas_kernels.grouped_matmul.kernel import grouped_gate_up_kernel


def _gate_up(xp, w_gate, w_up, tile_group, *, block_m, block_n, block_k, num_splits, num_warps,
             num_stages, activation, interpret, columns_fastest=False):
    """xp [Mp, E] -> hidden rows [Mp, I] in xp's dtype."""
    kernel = functools.partial(grouped_gate_up_kernel, block_k=block_k, block_n=block_n,
                               num_splits=num_splits, activation=activation,
                               columns_fastest=columns_fastest)
    out = grouped_pallas_call(kernel, xp, (w_gate, w_up), tile_group, N=w_gate.shape[2],
                              n_outputs=1 if num_splits == 1 else 2, block_m=block_m,
                              block_n=block_n, num_splits=num_splits, num_warps=num_warps,
                              num_stages=num_stages, interpret=interpret, name="grouped_gate_up",
                              columns_fastest=columns_fastest)
    if num_splits == 1:
        return out[0]
    gate, up = out[0].sum(0), out[1].sum(0)
    return (activation(gate) * up).astype(xp.dtype)


def resolve_ffn_blocks(x, w_gate, w_up, w_down, sizes, M: int, block_m, gate_up_blocks,
                       down_blocks, tiles: int | None = None):
    """Blocks of an expert FFN's two kernels over M laid-out rows: (block_m, (block_n, block_k,
    num_splits, num_warps) of gate/up, the same of down), the given entries kept and the rest
    defaulted (`resolve_blocks`; tiles: see `default_blocks`). sizes: the group sizes, or None
    when the caller has none. ValueError for shapes, dtypes or blocks the kernels cannot take."""
    G, E, I = check_ffn_weights(w_gate, w_up, w_down)
    if sizes is None:
        sizes = jax.ShapeDtypeStruct((G,), jnp.int32)
    bn, bk, splits, warps = gate_up_blocks or (None,) * 4
    block_m, bn, bk, splits, warps = resolve_blocks(M, G, E, I, block_m, bn, bk, splits, warps,
                                                    accumulators=2, tiles=tiles)
    check_operands(x, w_gate, sizes, block_m, bn, bk)
    check_operands(x, w_up, sizes, block_m, bn, bk)
    check_splits(E, bk, splits)
    dbn, dbk, dsplits, dwarps = down_blocks or (None,) * 4
    _, dbn, dbk, dsplits, dwarps = resolve_blocks(M, G, I, E, block_m, dbn, dbk, dsplits, dwarps,
                                                  tiles=tiles)
    check_operands(jax.ShapeDtypeStruct((1, I), x.dtype), w_down, sizes, block_m, dbn, dbk)
    check_splits(I, dbk, dsplits)
    return block_m, (bn, bk, splits, warps), (dbn, dbk, dsplits, dwarps)


PREFILL_ROWS_PER_EXPERT = 64


def is_prefill(M: int, G: int) -> bool:
    """Do M rows over G experts (a mean of >= 64 rows each) take the prefill tiles?"""
    return M // max(G, 1) >= PREFILL_ROWS_PER_EXPERT


def prefill_tiles(gate_up_blocks, I: int):
    """(block_m, gate_up_blocks) at prefill sizes: 128-row tiles and 128 gate/up columns (two
    128 x 128 float32 accumulators, which spill at 8 warps, yet measured fastest), run with
    the columns-fastest grid and 3 stages. H200, round 3 session 11 (`bench moe`), against
    64-row tiles with 64 gate/up columns, tiles fastest, 4 stages: 4096 tokens V2-Lite 1619 ->
    1230 us, V3 slice 11703 -> 9284 us; 1024 tokens 690 -> 574 and 4939 -> 3780 us."""
    bn, bk, splits, warps = gate_up_blocks or (None,) * 4
    return 128, (bn or (128 if I % 128 == 0 else None), bk, splits, warps)


@functools.partial(jax.jit, static_argnames=("activation", "block_m", "gate_up_blocks",
                                             "down_blocks", "num_stages", "columns_fastest",
                                             "interpret"))
def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   sizes: jax.Array, *, activation=jax.nn.silu, block_m: int | None = None,
                   gate_up_blocks: tuple | None = None, down_blocks: tuple | None = None,
                   num_stages: int | None = None, columns_fastest: bool = True,
                   interpret: bool = False) -> jax.Array:
    """x [M, E] rows sorted by expert, w_gate / w_up [G, E, I], w_down [G, I, E], sizes
    int32[G] (sum <= M) -> [M, E] in x's dtype; rows past sum(sizes) come out zero.
    gate_up_blocks / down_blocks: (block_n, block_k, num_splits, num_warps), any entry None
    for its default (`resolve_blocks`; at prefill sizes `prefill_tiles`). num_stages: default
    3, or 4 for 64-row tiles (1872 vs 1964 us at 4096 V2-Lite tokens, H100). columns_fastest:
    both kernels' grids run column blocks fastest (kernel.tile_and_column): the programs that
    run side by side share a row tile, read from DRAM once (at 4096 V2-Lite tokens, H200:
    1588 -> 1516 us alone, and what makes 128-row tiles pay). ValueError for shapes, dtypes or
    blocks the kernels cannot take."""
    M = x.shape[0]
    if block_m is None and is_prefill(M, w_gate.shape[0]):
        block_m, gate_up_blocks = prefill_tiles(gate_up_blocks, w_gate.shape[2])
    block_m, (bn, bk, splits, warps), (dbn, dbk, dsplits, dwarps) = resolve_ffn_blocks(
        x, w_gate, w_up, w_down, sizes, M, block_m, gate_up_blocks, down_blocks)
    num_stages = num_stages or (4 if block_m == 64 else 3)

    dest, tile_group, Mp = tile_layout(sizes, M, block_m)
    xp = pad_rows(x, dest, Mp)
    hp = _gate_up(xp, w_gate, w_up, tile_group, block_m=block_m, block_n=bn, block_k=bk,
                  num_splits=splits, num_warps=warps, num_stages=num_stages,
                  activation=activation, interpret=interpret, columns_fastest=columns_fastest)
    yp = padded_grouped_matmul(hp, w_down, tile_group, block_m=block_m, block_n=dbn,
                               block_k=dbk, num_splits=dsplits, num_warps=dwarps,
                               num_stages=num_stages, interpret=interpret,
                               columns_fastest=columns_fastest)
    return unpad_rows(yp, dest, x.dtype)
