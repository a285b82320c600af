"""The routed experts' whole SwiGLU FFN on the grouped-matmul kernels, in one row layout:

    y = ragged_dot(activation(ragged_dot(x, w_gate)) * ragged_dot(x, w_up), w_down)

x [M, E] holds (token, expert) rows sorted by expert, `sizes[g]` rows for expert g; w_gate and
w_up [G, E, I], w_down [G, I, E]. Three `grouped_matmul` calls would lay the rows out and
gather them back three times and launch three kernels; here the rows are laid out once
(`tile_layout`), one kernel computes gate and up together (x loaded once for both, and without
split-K the hidden row activation(gate) * up is written directly: kernel.py), the down
projection reads the hidden rows in the same layout, and the output rows are gathered once.
At decode sizes, where each matmul is a few microseconds of weight reads, the launches and
layout ops saved are a large part of the layer (the three-call layer at one
DeepSeek-V2-Lite token took about 3x its weight bytes' time).
The activation runs in float32 on the float32 sums (the three-call form rounds gate and up to
x's dtype first): outputs agree to that rounding.

`moe_swiglu` is the same FFN from token order and back, as the MoE layer calls it at prefill
sizes: the tile layout without a sort (`pair_layout`), x's rows scattered in by a kernel and
the weighted sum gathered out in one pass (`row_moves.py`).
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels._device import num_sms
from pallas_kernels._hopper import on_hopper
from pallas_kernels.grouped_matmul.grouped_matmul import (check_ffn_weights, check_operands,
                                                          check_splits,
                                                          grouped_pallas_call, pad_rows,
                                                          padded_grouped_matmul, pair_layout,
                                                          resolve_blocks, tile_layout,
                                                          tile_live_rows,
                                                          unpad_rows)
from pallas_kernels.grouped_matmul.kernel import grouped_gate_up_kernel
from pallas_kernels.grouped_matmul.row_moves import combine_rows, scatter_rows

KERNELS = ("triton", "mosaic")
KERNEL_ENV = "MTPJAX_MOE_KERNEL"


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
    the columns-fastest grid and 3 stages: faster than 64-row tiles at 1024 and 4096 tokens
    of both MoE shapes (H200, `bench moe`)."""
    bn, bk, splits, warps = gate_up_blocks or (None,) * 4
    return 128, (bn or (128 if I % 128 == 0 else None), bk, splits, warps)


def _widest(dim: int, cap: int) -> int:
    """The widest multiple of 64, <= cap, dividing dim (0 if none)."""
    return next((b for b in range(cap, 0, -64) if dim % b == 0), 0)


def mosaic_fits(x, w_gate) -> bool:
    """Can the Mosaic-GPU kernels (`kernel_mgpu.py`) take these operands? bf16, and E and I
    whole 64-column blocks."""
    G, E, I = w_gate.shape
    return (x.dtype == jnp.bfloat16 and w_gate.dtype == jnp.bfloat16 and E % 64 == 0
            and I % 64 == 0)


MOSAIC_ROWS_PER_EXPERT = 256


def default_kernel(x, w_gate, interpret: bool) -> str:
    """"mosaic" from a mean of 256 rows per expert on a Hopper GPU where its shapes fit
    (`mosaic_fits`), else "triton" (decode sizes, other GPUs, interpreted runs): below 256
    rows per expert the Triton kernel measured as fast or faster (`bench moe`). The environment
    variable MTPJAX_MOE_KERNEL (triton / mosaic) overrides it at prefill sizes
    (`is_prefill`)."""
    if not is_prefill(x.shape[0], w_gate.shape[0]):
        return "triton"
    forced = os.environ.get(KERNEL_ENV)
    if forced is not None:
        if forced not in KERNELS:
            raise ValueError(f"{KERNEL_ENV} must be one of {KERNELS}, got {forced!r}")
        return forced
    if (interpret or not mosaic_fits(x, w_gate)
            or x.shape[0] // w_gate.shape[0] < MOSAIC_ROWS_PER_EXPERT):
        return "triton"
    return "mosaic" if on_hopper() else "triton"


def _mgpu():
    """The Mosaic-GPU kernel module (`kernel_mgpu.py`), imported on first use: importing
    Mosaic GPU takes ~15 MB of host memory, which a checkpoint load (that never runs it)
    should not pay (tests/checkpoint/test_checkpoint_memory.py: 107 -> 121 MB with the import at the
    top)."""
    from pallas_kernels.grouped_matmul import kernel_mgpu
    return kernel_mgpu


def _stages(n_weights, block_n, persistent):
    """The most ring slots (<= 4) that fit beside the output stage."""
    mgpu = _mgpu()
    return max([n for n in (2, 3, 4) if mgpu.smem_bytes(n_weights, block_n, n, persistent)
                <= mgpu.SMEM_LIMIT] or [2])


def _mosaic_kernels(w_gate, w_up, w_down, *, activation, gate_up_blocks, down_blocks,
                    num_stages, persistent, band_tiles, interpret):
    """The Mosaic-GPU kernels as run(xp [Mp, E], tile_group, tile_rows) -> yp [Mp, E] (rows
    past each tile's live rows may be left unwritten: `grouped_matmul_mgpu`): 128-row tiles,
    gate/up columns in blocks of gate_up_blocks[0] (default 128), down columns in blocks of
    down_blocks[0] (default 256), num_stages ring slots (default: the most that fit, <= 4);
    the other block entries do not apply. persistent: each kernel on a persistent grid of one
    CTA per SM (opt-in, `grouped_matmul_mgpu`'s num_ctas). band_tiles: the work items'
    order (`grouped_matmul_mgpu`'s; None its default)."""
    G, E, I = w_gate.shape
    bn = (gate_up_blocks or (None,))[0] or _widest(I, 128)
    dbn = (down_blocks or (None,))[0] or _widest(E, 256)
    mgpu = _mgpu()
    ctas = num_sms() if persistent is True else (persistent or None)

    def run(xp, tile_group, tile_rows):
        hp = mgpu.grouped_matmul_mgpu(xp, (w_gate, w_up), tile_group, activation=activation,
                                      block_n=bn, num_stages=num_stages or _stages(2, bn, ctas),
                                      num_ctas=ctas, band_tiles=band_tiles,
                                      tile_rows=tile_rows, interpret=interpret)
        return mgpu.grouped_matmul_mgpu(hp, (w_down,), tile_group, block_n=dbn,
                                        num_stages=num_stages or _stages(1, dbn, ctas),
                                        num_ctas=ctas, band_tiles=band_tiles,
                                        tile_rows=tile_rows, interpret=interpret)
    return mgpu.TILE_M, run


def _kernels(x, w_gate, w_up, w_down, sizes, *, activation, block_m, gate_up_blocks,
             down_blocks, num_stages, columns_fastest, kernel, persistent, band_tiles,
             interpret):
    """The chosen kernels for M = x.shape[0] laid-out rows (x may be a ShapeDtypeStruct) as
    (block_m, run), run(xp [Mp, E], tile_group, tile_rows) -> yp [Mp, E] in the tile layout
    of block_m (`tile_layout`; tile_rows: `tile_live_rows`, rows past which are not read
    back). ValueError for shapes, dtypes or blocks the kernels cannot take."""
    M = x.shape[0]
    kernel = kernel or default_kernel(x, w_gate, interpret)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    if kernel == "mosaic":
        G, E, I = check_ffn_weights(w_gate, w_up, w_down)
        if not mosaic_fits(x, w_gate):
            raise ValueError(f"kernel='mosaic' takes bfloat16 x and weights with E and I "
                             f"multiples of 64, got {x.dtype} / {w_gate.dtype}, E={E}, I={I}")
        tile_m = _mgpu().TILE_M
        if block_m not in (None, tile_m):
            raise ValueError(f"kernel='mosaic' runs {tile_m}-row tiles, got block_m={block_m}")
        return _mosaic_kernels(w_gate, w_up, w_down, activation=activation,
                               gate_up_blocks=gate_up_blocks, down_blocks=down_blocks,
                               num_stages=num_stages, persistent=persistent,
                               band_tiles=band_tiles, interpret=interpret)
    if persistent or band_tiles is not None:
        raise ValueError(f"persistent and band_tiles are options of kernel='mosaic', got "
                         f"persistent={persistent}, band_tiles={band_tiles}")
    if block_m is None and is_prefill(M, w_gate.shape[0]):
        block_m, gate_up_blocks = prefill_tiles(gate_up_blocks, w_gate.shape[2])
    block_m, (bn, bk, splits, warps), (dbn, dbk, dsplits, dwarps) = resolve_ffn_blocks(
        x, w_gate, w_up, w_down, sizes, M, block_m, gate_up_blocks, down_blocks)
    num_stages = num_stages or (4 if block_m == 64 else 3)

    def run(xp, tile_group, tile_rows):
        del tile_rows       # the Triton kernels compute whole tiles
        hp = _gate_up(xp, w_gate, w_up, tile_group, block_m=block_m, block_n=bn, block_k=bk,
                      num_splits=splits, num_warps=warps, num_stages=num_stages,
                      activation=activation, interpret=interpret,
                      columns_fastest=columns_fastest)
        return padded_grouped_matmul(hp, w_down, tile_group, block_m=block_m, block_n=dbn,
                                     block_k=dbk, num_splits=dsplits, num_warps=dwarps,
                                     num_stages=num_stages, interpret=interpret,
                                     columns_fastest=columns_fastest)
    return block_m, run


_OPTIONS = ("activation", "block_m", "gate_up_blocks", "down_blocks", "num_stages",
            "columns_fastest", "kernel", "persistent", "band_tiles", "interpret")


@functools.partial(jax.jit, static_argnames=_OPTIONS)
def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   sizes: jax.Array, *, activation=jax.nn.silu, block_m: int | None = None,
                   gate_up_blocks: tuple | None = None, down_blocks: tuple | None = None,
                   num_stages: int | None = None, columns_fastest: bool = True,
                   kernel: str | None = None, persistent: bool | int = False,
                   band_tiles: int | None = None, interpret: bool = False) -> jax.Array:
    """x [M, E] rows sorted by expert, w_gate / w_up [G, E, I], w_down [G, I, E], sizes
    int32[G] (sum <= M) -> [M, E] in x's dtype; rows past sum(sizes) come out zero.
    gate_up_blocks / down_blocks: (block_n, block_k, num_splits, num_warps), any entry None
    for its default (`resolve_blocks`; at prefill sizes `prefill_tiles`). num_stages: default
    3, or 4 for 64-row tiles (1872 vs 1964 us at 4096 V2-Lite tokens, H100). columns_fastest:
    both kernels' grids run column blocks fastest (kernel.tile_and_column): the programs that
    run side by side share a row tile, read from DRAM once (at 4096 V2-Lite tokens, H200:
    1588 -> 1516 us alone, and what makes 128-row tiles pay). kernel: "triton" (`kernel.py`),
    "mosaic" (`kernel_mgpu.py`, Hopper warpgroups, bf16: `_mosaic_kernels`) or None
    (`default_kernel`: "mosaic" at prefill sizes on Hopper). persistent (Mosaic only,
    opt-in): True for a persistent grid of one CTA per SM, or a CTA count. band_tiles
    (Mosaic only): the work items' order (`kernel_mgpu.tile_bands`; None: BAND_TILES, 1:
    column blocks fastest). ValueError for shapes, dtypes or blocks the kernels cannot
    take."""
    block_m, run = _kernels(
        x, w_gate, w_up, w_down, sizes, activation=activation, block_m=block_m,
        gate_up_blocks=gate_up_blocks, down_blocks=down_blocks, num_stages=num_stages,
        columns_fastest=columns_fastest, kernel=kernel, persistent=persistent,
        band_tiles=band_tiles, interpret=interpret)
    dest, tile_group, Mp = tile_layout(sizes, x.shape[0], block_m)
    tile_rows = tile_live_rows(sizes, tile_group, block_m)
    return unpad_rows(run(pad_rows(x, dest, Mp), tile_group, tile_rows), dest, x.dtype)


@functools.partial(jax.jit, static_argnames=_OPTIONS + ("out_dtype",))
def moe_swiglu(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array, *, activation=jax.nn.silu, out_dtype=None,
               block_m: int | None = None, gate_up_blocks: tuple | None = None,
               down_blocks: tuple | None = None, num_stages: int | None = None,
               columns_fastest: bool = True, kernel: str | None = None,
               persistent: bool | int = False, band_tiles: int | None = None,
               interpret: bool = False) -> jax.Array:
    """The routed MoE FFN from token order and back, at prefill sizes:

        out[n] = sum_j weights[n, j] * expert_{ids[n, j]}(x[n])     (j in order, f32 sums)

    x [N, E]; ids int32[N, k] (outside [0, G): routed nowhere, adds nothing); weights
    float32[N, k] -> [N, E] in out_dtype (default x's). The pairs go to the tile layout of
    `grouped_swiglu` without a sort (`pair_layout`), x's rows straight into it by a kernel
    (`row_moves.scatter_rows`: no sorted copy of x, no zeroed padding rows), and the
    outputs' gather and weighted sum are one fused pass (`row_moves.combine_rows`). Options
    as for `grouped_swiglu`."""
    if ids.ndim != 2 or weights.shape != ids.shape or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be an integer [N, k] and weights [N, k] of its shape, got "
                         f"ids {ids.dtype}{list(ids.shape)} and weights {list(weights.shape)}")
    if x.ndim != 2 or x.shape[0] != ids.shape[0]:
        raise ValueError(f"x must be [N={ids.shape[0]}, E], got {list(x.shape)}")
    N, k = ids.shape
    M = N * k
    block_m, run = _kernels(
        jax.ShapeDtypeStruct((M, x.shape[1]), x.dtype), w_gate, w_up, w_down,
        jax.ShapeDtypeStruct((w_gate.shape[0],), jnp.int32), activation=activation,
        block_m=block_m, gate_up_blocks=gate_up_blocks, down_blocks=down_blocks,
        num_stages=num_stages, columns_fastest=columns_fastest, kernel=kernel,
        persistent=persistent, band_tiles=band_tiles, interpret=interpret)
    dest, tile_group, Mp, sizes = pair_layout(ids.reshape(-1), w_gate.shape[0], block_m)
    token = jnp.arange(M, dtype=jnp.int32) // k
    yp = run(scatter_rows(x, token, dest, num_rows=Mp, interpret=interpret), tile_group,
             tile_live_rows(sizes, tile_group, block_m))
    return combine_rows(yp, dest.reshape(N, k), weights, out_dtype or x.dtype)
