"""The MoE layer's rows into the expert-tile layout (a Triton kernel) and back (jnp).

Before the expert kernels, each (token, expert) pair's row of x goes to its row of the padded
tile layout (`tile_layout`); after them, each token's output is the routing-weighted sum of
its k pairs' rows. In XLA these were gathers of whole rows, well below copy bandwidth, and
the padded-row gather also wrote the zeros of padding rows.

`scatter_rows` writes only the pairs' rows, from x itself (no sorted copy first): padding
rows are left as they were (the output buffer is not initialised). Each row of an expert
matmul depends on its own input row only, so whatever a padding row holds stays in padding
rows, which nothing reads back; `combine_rows` reads only the pairs' rows, and masks (never
multiplies) the ones a pair has not got, so a NaN in an unread row cannot reach a token.
The scatter measured 2-3x faster than XLA's padded-row gather (docs/benchmarks.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.grouped_matmul.grouped_matmul import largest_block

ROW_BLOCK = 8           # rows per program
COLUMN_BLOCK = 512      # columns per program (at most; a power of 2 dividing the width)
NUM_WARPS = 4


def _scatter_kernel(src_ref, dest_ref, x_ref, o_ref, *, block_c, num_rows):
    cols = pl.ds(pl.program_id(1) * block_c, block_c)
    first = pl.program_id(0) * ROW_BLOCK
    for r in range(ROW_BLOCK):      # one contiguous row copy each (no index vectors: a
        dest = dest_ref[first + r]  # masked-off lane's clamped index could collide)

        @pl.when(dest < num_rows)
        def _():
            o_ref[pl.ds(dest, 1), cols] = x_ref[pl.ds(src_ref[first + r], 1), cols]


@functools.partial(jax.jit, static_argnames=("num_rows", "interpret"))
def scatter_rows(x: jax.Array, src: jax.Array, dest: jax.Array, *, num_rows: int,
                 interpret: bool = False) -> jax.Array:
    """out[dest[i]] = x[src[i]] for each i with dest[i] < num_rows -> [num_rows, E] in x's
    dtype; rows no i writes are left unwritten (whatever the buffer held).

    x [N, E]; src, dest int32[M] (src in [0, N): clamped; dest >= num_rows: dropped). Two i
    with one dest: one of them wins (the layer's dests are distinct)."""
    n, width = x.shape
    if src.shape != dest.shape or src.ndim != 1:
        raise ValueError(f"src and dest must be [M] of one shape, got {src.shape} and "
                         f"{dest.shape}")
    m = src.shape[0]
    pad = -m % ROW_BLOCK
    src = jnp.pad(jnp.clip(src.astype(jnp.int32), 0, n - 1), (0, pad))
    dest = jnp.pad(dest.astype(jnp.int32), (0, pad), constant_values=num_rows)
    block_c = largest_block(width, COLUMN_BLOCK, floor=1)      # Triton blocks: powers of 2
    return pl.pallas_call(
        functools.partial(_scatter_kernel, block_c=block_c, num_rows=num_rows),
        out_shape=jax.ShapeDtypeStruct((num_rows, width), x.dtype),
        grid=((m + pad) // ROW_BLOCK, width // block_c),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="moe_scatter_rows",
    )(src, dest, x)


def weighted_sum(y: jax.Array, weights: jax.Array) -> jax.Array:
    """sum_j weights[n, j] * y[n, j] in a fixed order, float32: y [N, k, E] -> [N, E]. A
    scatter-add instead lowers to float atomics on the GPU, whose order (and so rounding, and
    greedy tokens with it) changed from run to run."""
    y = y.astype(jnp.float32) * weights[..., None].astype(jnp.float32)
    out = y[:, 0]
    for j in range(1, y.shape[1]):
        out = out + y[:, j]
    return out


def combine_rows(y: jax.Array, rows: jax.Array, weights: jax.Array, out_dtype=None) -> jax.Array:
    """out[n] = sum_j weights[n, j] * y[rows[n, j]] over j in order, float32 sums -> [N, E]
    in out_dtype (default y's).

    y [Mp, E]; rows int32[N, k] (>= Mp: no row, adds nothing; other rows of y are never
    read); weights float32[N, k]. Plain jnp: XLA fuses the row gather into the weighted sum
    (one pass), and a Triton kernel of the same loop was no faster."""
    has = rows < y.shape[0]
    vals = y[jnp.where(has, rows, 0)]                             # [N, k, E]
    vals = jnp.where(has[..., None], vals.astype(jnp.float32), 0.0)
    return weighted_sum(vals, weights).astype(out_dtype or y.dtype)
