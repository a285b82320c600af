"""The Pallas (Triton backend) kernels of the grouped matmul: one program per (row tile, column
block[, K split]); the tile's group picks the expert weight *inside* the kernel.

    xp          [Mp, K]      rows sorted by group, each group padded to a multiple of block_m
    w           [G, K, N]    expert weights, read in place (never gathered or copied)
    tile_group  [n_tiles]    int32 group of each row tile, -1 for tiles past the last group
    out         [Mp, N]

Program (t, j[, s]): acc[block_m, block_n] = sum over K blocks (those of split s) of
xp[t rows, k] @ w[g, k, j cols]; with split-K each split writes a float32 partial.
A tile past the last group (group -1) runs zero K blocks (a dynamic trip count) and writes
nothing: its output rows are left as they were (callers never read them), so it moves no
bytes. Each expert's weight columns are therefore read once per row tile of that expert —
once in total at decode sizes (one tile per touched expert), which is the bandwidth floor, and
ceil(rows / block_m) times at prefill sizes, where the matmul is compute bound.

`grouped_gate_up_kernel` is the same program over two weights of one shape (an MoE expert's
gate and up projections): each x block is loaded once for both dots, and without split-K the
program writes activation(gate) * up directly (the SwiGLU hidden row), so one launch replaces
two and the gate / up outputs never reach memory.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def tile_and_column(columns_fastest: bool):
    """(row tile t, column block j) of this program. Grid (tiles, N / block_n, splits), or
    (N / block_n, tiles, splits) with columns_fastest: then the programs that run side by side
    share a row tile (its rows read from DRAM once for all column blocks, and an expert's
    tiles follow each other, so its weight blocks stay in L2). With tiles fastest each row
    tile is re-read from DRAM once per column block (~4x the distinct bytes at prefill sizes)."""
    if columns_fastest:
        return pl.program_id(1), pl.program_id(0)
    return pl.program_id(0), pl.program_id(1)


def _accumulate(x_ref, w_refs, tile_group_ref, *, block_k: int, block_n: int, num_splits: int,
                columns_fastest: bool):
    """float32 [block_m, block_n] accumulators, one per weight, of this program's K blocks."""
    # float32 inputs: full-precision dots (Triton would use TF32), as the f32 tests compare
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    t, j = tile_and_column(columns_fastest)
    g = tile_group_ref[t]
    # split-K (num_splits > 1): program (t, j, s) sums K blocks [s * n, (s + 1) * n) into its
    # own float32 partial, summed by the wrapper; int32 bounds on both ends of the loop:
    # Triton's scf.for needs one type (a weak Python 0 lowered to another width, and the module
    # failed to verify on the GPU)
    per_split = x_ref.shape[1] // block_k // num_splits
    first = (pl.program_id(2) * per_split).astype(jnp.int32) if num_splits > 1 else jnp.int32(0)
    last = jnp.where(g >= 0, first + jnp.int32(per_split), first)
    g = jnp.maximum(g, 0)

    def body(i, accs):
        x = x_ref[:, pl.ds(i * block_k, block_k)]                       # [block_m, block_k]
        return tuple(
            acc + plgpu.dot(x, w_ref[g, pl.ds(i * block_k, block_k), pl.ds(j * block_n, block_n)],
                            precision=precision).astype(jnp.float32)
            for acc, w_ref in zip(accs, w_refs))

    zero = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    return lax.fori_loop(first, last, body, tuple(zero for _ in w_refs))


def grouped_matmul_kernel(x_ref, w_ref, tile_group_ref, o_ref, *, block_k: int, block_n: int,
                          num_splits: int = 1, columns_fastest: bool = False):
    acc, = _accumulate(x_ref, (w_ref,), tile_group_ref, block_k=block_k, block_n=block_n,
                       num_splits=num_splits, columns_fastest=columns_fastest)

    @pl.when(tile_group_ref[tile_and_column(columns_fastest)[0]] >= 0)   # empty: no store
    def _():
        o_ref[...] = acc.astype(o_ref.dtype)


def grouped_gate_up_kernel(x_ref, wg_ref, wu_ref, tile_group_ref, *o_refs, block_k: int,
                           block_n: int, num_splits: int = 1, activation=None,
                           columns_fastest: bool = False):
    """num_splits == 1: one output, activation(gate) * up (float32 math, stored in its dtype);
    else two float32 partials (gate, up) for the wrapper to sum before the activation."""
    gate, up = _accumulate(x_ref, (wg_ref, wu_ref), tile_group_ref, block_k=block_k,
                           block_n=block_n, num_splits=num_splits,
                           columns_fastest=columns_fastest)

    @pl.when(tile_group_ref[tile_and_column(columns_fastest)[0]] >= 0)   # empty: no store
    def _():
        if num_splits == 1:
            o_refs[0][...] = (activation(gate) * up).astype(o_refs[0].dtype)
        else:
            o_refs[0][...] = gate
            o_refs[1][...] = up
