"""Public wrapper of the grouped-matmul kernel: `jax.lax.ragged_dot(x, w, sizes)` for MoE experts.

x [M, K] holds rows sorted by group (expert), `sizes[g]` rows for group g (rows past sum(sizes)
belong to no group and come out zero, as ragged_dot gives them); w [G, K, N]. The wrapper lays
the rows out tile by tile (each group padded to a multiple of `block_m`; `tile_layout`), runs
the kernel (kernel.py: each program reads its tile's expert weight in place), and gathers the
rows back. Why a kernel: XLA lowers `ragged_dot` on the GPU to a dense dot over every group, and
the XLA tiled form (mtpjax/model/grouped_matmul.py) gathers one weight matrix per tile;
this reads each touched expert's weights where they lie.

Tuning: block_m (rows per tile; default the mean group size rounded up to a power of two in
[16, 64]), block_n and num_splits (split-K; default `default_blocks`: enough programs for
every SM, K split before weight tiles narrow), block_k (must divide K; default 64),
num_warps (default 8 from 128 x 128 tiles, else 4), num_stages (3). Measured rates against
the touched experts' bytes are in docs/benchmarks.md. `python -m mtpjax.bench.moe --variants
pallas,pallas:BM/BN/BK/S` sweeps blocks and splits.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._device import num_sms
from pallas_kernels.grouped_matmul.kernel import grouped_matmul_kernel

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def default_block_m(M: int, G: int) -> int:
    """The mean group size rounded up to a power of two, in [16, 64]. 64, not 128, at prefill
    sizes: 64-row tiles measured faster for this kernel on the H100 (`bench moe`)."""
    mean = max(M // max(G, 1), 1)
    return min(64, max(16, 1 << (mean - 1).bit_length()))


def largest_block(dim: int, cap: int, floor: int = 16) -> int:
    """Largest power of two <= cap dividing dim (0 if none >= floor; 16: Triton's dot)."""
    b = cap
    while b >= floor and dim % b:
        b //= 2
    return b if b >= floor else 0


PROGRAMS_PER_SM = 2             # two waves: one program's tail overlaps the next's start


def target_programs() -> int:
    """Programs the default blocks aim for: PROGRAMS_PER_SM on every SM of this GPU."""
    return PROGRAMS_PER_SM * num_sms()


def default_blocks(M: int, G: int, K: int, N: int, block_m: int, block_k: int,
                   tiles: int | None = None) -> tuple[int, int]:
    """(block_n, num_splits) so that the tiles that hold rows (at most ceil(M / block_m) +
    min(G, M)) x column blocks x K splits give >= `target_programs()`: at decode sizes a
    few expert tiles must still spread over every SM, since each program's share of the weight
    read is what the step waits for. K is split first (up to 8 ways, >= 2 K blocks per split),
    keeping 128-wide weight tiles (bytes in flight per program); then block_n is halved, down
    to 16 (the only lever before split-K: on the H100 at one V2-Lite token, 7 tiles x 44
    column blocks of 32 ran at 0.4 TB/s, docs/benchmarks.md). tiles: the row tiles expected to
    hold rows, when the caller knows better than the bound."""
    tiles = tiles or -(-M // block_m) + min(G, M)
    b = largest_block(N, 128) or 128
    target = target_programs()
    splits = 1
    while (tiles * (N // b) * splits < target and splits < 8
           and K % (block_k * splits * 2) == 0 and K // (block_k * splits * 2) >= 2):
        splits *= 2
    while b > 16 and tiles * (N // b) * splits < target and N % (b // 2) == 0:
        b //= 2
    return b, splits


def tile_layout(sizes: jax.Array, M: int, block_m: int):
    """Tile layout of M rows in groups of `sizes` (int32[G]).

    Returns (dest int32[M]: each row's row in the padded layout, Mp for rows in no group;
    tile_group int32[n_tiles]: each tile's group, -1 past the last group; Mp = n_tiles x
    block_m). n_tiles = ceil(M / block_m) + min(G, M) bounds the tiles any sizes can need."""
    G = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)                                  # [G] end row of each group
    padded, pends, tile_group, Mp = _padded_groups(sizes, M, block_m)
    row = jnp.arange(M, dtype=jnp.int32)
    # compare_all, not searchsorted's default "scan": that is a while loop, and a while loop on
    # the GPU costs a device-to-host round trip per iteration (the layer ran ~3x slower)
    g = jnp.minimum(jnp.searchsorted(ends, row, side="right", method="compare_all"),
                    G).astype(jnp.int32)
    gc = jnp.minimum(g, G - 1)
    dest = jnp.where(g < G, pends[gc] - padded[gc] + row - (ends[gc] - sizes[gc]), Mp)
    return dest.astype(jnp.int32), tile_group, Mp


def _padded_ends(sizes: jax.Array, block_m: int):
    """(each group's size padded to whole tiles [G], each padded group's end row [G])."""
    padded = -(-sizes // block_m) * block_m
    return padded, jnp.cumsum(padded)


def _padded_groups(sizes: jax.Array, M: int, block_m: int):
    """Groups of `sizes` (int32[G], sum <= M) padded to whole tiles: (padded sizes [G], padded
    ends [G], tile_group int32[n_tiles]: each tile's group, -1 past the last, Mp)."""
    G = sizes.shape[0]
    n_tiles = -(-M // block_m) + min(G, M)
    padded, pends = _padded_ends(sizes, block_m)
    tg = jnp.searchsorted(pends, jnp.arange(n_tiles, dtype=jnp.int32) * block_m, side="right",
                          method="compare_all")
    return padded, pends, jnp.where(tg < G, tg, -1).astype(jnp.int32), n_tiles * block_m


def tile_live_rows(sizes: jax.Array, tile_group: jax.Array, block_m: int) -> jax.Array:
    """int32[n_tiles]: the live rows of each tile of `tile_layout` (its first ones): block_m,
    fewer in a group's last tile, 0 in empty tiles."""
    sizes = sizes.astype(jnp.int32)
    padded, pends = _padded_ends(sizes, block_m)
    first = (pends - padded) // block_m                        # [G] each group's first tile
    g = jnp.maximum(tile_group, 0)
    t = jnp.arange(tile_group.shape[0], dtype=jnp.int32)
    rows = jnp.clip(sizes[g] - (t - first[g]) * block_m, 0, block_m)
    return jnp.where(tile_group >= 0, rows, 0).astype(jnp.int32)


RANK_BLOCK = 256     # pairs per block of `pair_layout`'s triangular matmul


def pair_layout(expert: jax.Array, G: int, block_m: int):
    """The tile layout of `tile_layout` straight from each pair's expert, without a sort.

    expert int32[M] (outside [0, G): routed nowhere) -> (dest int32[M]: each pair's row in
    the padded layout, Mp for pairs routed nowhere; tile_group int32[n_tiles] as
    `tile_layout`'s; Mp; sizes int32[G]). Within an expert the pairs keep their order, so
    the layout is the one `tile_layout` gives the stably sorted rows.

    A pair's rank within its expert is a count of the earlier pairs with that expert: within
    blocks of RANK_BLOCK pairs a product of the one-hot [blocks, 256, G] (bf16 0/1, float32
    sums: exact) by a lower-triangular matrix of ones (tensor cores, a few microseconds),
    across blocks an integer cumulative sum of the [blocks, G] totals. An argsort instead
    (cub's radix sort: 6 kernels and 6 memsets) took ~42 us of the 4096-token V2-Lite layer
    on the H100, and a cumulative sum over all M pairs lowers to an O(M^2) reduce window."""
    M = expert.shape[0]
    valid = (expert >= 0) & (expert < G)
    e = jnp.where(valid, expert, G).astype(jnp.int32)
    pad = -M % RANK_BLOCK
    onehot = (jnp.pad(e, (0, pad), constant_values=G)[:, None]
              == jnp.arange(G, dtype=jnp.int32)).astype(jnp.bfloat16)       # [M', G]
    blocks = onehot.reshape(-1, RANK_BLOCK, G)                             # [B, 256, G]
    lower = jnp.tril(jnp.ones((RANK_BLOCK, RANK_BLOCK), jnp.bfloat16))
    within = jnp.einsum("ij,bjg->big", lower, blocks,
                        preferred_element_type=jnp.float32).astype(jnp.int32)   # inclusive
    totals = within[:, -1]                                                 # [B, G]
    before = jnp.cumsum(totals, axis=0) - totals                           # exclusive
    ranks = (within + before[:, None]).reshape(-1, G)[:M]                  # [M, G] inclusive
    rank = jnp.take_along_axis(ranks, jnp.minimum(e, G - 1)[:, None], axis=1)[:, 0] - 1
    sizes = totals.sum(0)                                                  # [G]
    padded, pends, tile_group, Mp = _padded_groups(sizes, M, block_m)
    dest = jnp.where(valid, (pends - padded)[jnp.minimum(e, G - 1)] + rank, Mp)
    return dest.astype(jnp.int32), tile_group, Mp, sizes.astype(jnp.int32)


def check_ffn_weights(w_gate, w_up, w_down) -> tuple[int, int, int]:
    """(G, E, I) of an expert FFN's weights, w_gate / w_up [G, E, I] and w_down [G, I, E], or a
    ValueError naming the bad shape."""
    if w_gate.ndim != 3 or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate and w_up must be [experts, E, I] of one shape, got "
                         f"{tuple(w_gate.shape)} and {tuple(w_up.shape)}")
    G, E, I = w_gate.shape
    if w_down.shape != (G, I, E):
        raise ValueError(f"w_down must be [experts={G}, I={I}, E={E}], got {tuple(w_down.shape)}")
    return G, E, I


def check_operands(x, w, sizes, block_m, block_n, block_k):
    """ValueError naming the bad value for operands or blocks the kernel cannot take (x may be
    a ShapeDtypeStruct: only its shape and dtype are read)."""
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [rows, K], got shape {tuple(x.shape)}")
    if w.ndim != 3:
        raise ValueError(f"w must be 3-D [groups, K, N], got shape {tuple(w.shape)}")
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w's K ({w.shape[1]}) must equal x's K ({x.shape[1]}): x "
                         f"{tuple(x.shape)}, w {tuple(w.shape)}")
    if sizes.shape != (w.shape[0],) or not jnp.issubdtype(sizes.dtype, jnp.integer):
        raise ValueError(f"sizes must be an integer array [groups={w.shape[0]}], got "
                         f"{sizes.dtype}{list(sizes.shape)}")
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"x and w must both be bfloat16 or float32, got {x.dtype} and {w.dtype}")
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (Triton's dot), got {b}")
    if w.shape[2] % block_n or x.shape[1] % block_k:
        raise ValueError(f"block_n={block_n} must divide N={w.shape[2]} and block_k={block_k} "
                         f"must divide K={x.shape[1]}")


def resolve_blocks(M: int, G: int, K: int, N: int, block_m, block_n, block_k, num_splits,
                   num_warps, accumulators: int = 1,
                   tiles: int | None = None) -> tuple[int, int, int, int, int]:
    """(block_m, block_n, block_k, num_splits, num_warps): the given ones, the defaults for the
    rest. accumulators: float32 output tiles per program (2 for the gate/up kernel, whose
    default column blocks halve from 64 x 128 rows x columns so its two tiles hold what one
    128 x 128 tile does)."""
    block_m = block_m or default_block_m(M, G)
    block_k = block_k or largest_block(K, 64) or 64
    auto_n, auto_splits = default_blocks(M, G, K, N, block_m, block_k, tiles)
    if accumulators > 1 and not block_n:
        while (auto_n > 16 and block_m * auto_n * accumulators > 128 * 128
               and N % (auto_n // 2) == 0):
            auto_n //= 2
    block_n = block_n or auto_n
    num_splits = num_splits or (auto_splits if K % (block_k * auto_splits) == 0 else 1)
    # 8 warps from 128 x 128 output tiles: at 4 warps the float32 accumulator alone is 128
    # registers per thread and the tile spilled (none at 8 warps: bench.register_report)
    num_warps = num_warps or (8 if block_m * block_n * accumulators >= 128 * 128 else 4)
    return block_m, block_n, block_k, num_splits, num_warps


def check_splits(K: int, block_k: int, num_splits: int) -> None:
    if num_splits < 1 or K % (block_k * num_splits):
        raise ValueError(f"num_splits={num_splits} must be >= 1 and divide K={K} into whole "
                         f"blocks of block_k={block_k}")


def grouped_pallas_call(kernel, xp: jax.Array, weights: tuple, tile_group: jax.Array, *,
                        N: int, n_outputs: int, block_m: int, block_n: int, num_splits: int,
                        num_warps: int, num_stages: int, interpret: bool, name: str,
                        columns_fastest: bool = False) -> tuple:
    """One grouped kernel over the grid (row tiles, N / block_n, num_splits): each program gets
    its row tile of xp [Mp, K] and every weight in place (the kernel picks the tile's expert).
    Returns n_outputs arrays [Mp, N] in xp's dtype, or float32 split-K partials
    [num_splits, Mp, N]. columns_fastest: the grid is (N / block_n, tiles, splits) (the kernel
    must be built with the same flag: kernel.tile_and_column)."""
    Mp, K = xp.shape

    def by_tile(index):
        """An index map of (tile t, column block j, split s), whatever the grid order."""
        return (lambda j, t, s: index(t, j, s)) if columns_fastest else index

    if num_splits == 1:
        spec = pl.BlockSpec((block_m, block_n), by_tile(lambda t, j, s: (t, j)))
        shape = jax.ShapeDtypeStruct((Mp, N), xp.dtype)
    else:
        spec = pl.BlockSpec((None, block_m, block_n), by_tile(lambda t, j, s: (s, t, j)))
        shape = jax.ShapeDtypeStruct((num_splits, Mp, N), jnp.float32)
    tiles, cols = Mp // block_m, N // block_n
    return pl.pallas_call(
        kernel,
        grid=(cols, tiles, num_splits) if columns_fastest else (tiles, cols, num_splits),
        in_specs=[pl.BlockSpec((block_m, K), by_tile(lambda t, j, s: (t, 0)))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * (len(weights) + 1),
        out_specs=(spec,) * n_outputs,
        out_shape=(shape,) * n_outputs,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name if num_splits == 1 else f"{name}_split{num_splits}",
    )(xp, *weights, tile_group)


def padded_grouped_matmul(xp: jax.Array, w: jax.Array, tile_group: jax.Array, *, block_m: int,
                          block_n: int, block_k: int, num_splits: int, num_warps: int,
                          num_stages: int, interpret: bool,
                          columns_fastest: bool = False) -> jax.Array:
    """The kernel on rows already laid out by `tile_layout`: xp [Mp, K] -> [Mp, N] in xp's
    dtype (split-K partials summed in float32)."""
    kernel = functools.partial(grouped_matmul_kernel, block_k=block_k, block_n=block_n,
                               num_splits=num_splits, columns_fastest=columns_fastest)
    yp, = grouped_pallas_call(kernel, xp, (w,), tile_group, N=w.shape[2], n_outputs=1,
                              block_m=block_m, block_n=block_n, num_splits=num_splits,
                              num_warps=num_warps, num_stages=num_stages, interpret=interpret,
                              name="grouped_matmul", columns_fastest=columns_fastest)
    return yp.sum(0).astype(xp.dtype) if num_splits > 1 else yp


def pad_rows(x: jax.Array, dest: jax.Array, Mp: int) -> jax.Array:
    """x [M, K] -> [Mp, K]: row r at dest[r] (dest >= Mp: dropped), the other rows zero. A
    gather with one source index per padded row: XLA's scatter of whole rows (`zeros.at[dest]
    .set(x)`) runs far below copy bandwidth, and writes the zeros first."""
    M = x.shape[0]
    src = jnp.full((Mp,), -1, jnp.int32).at[dest].set(jnp.arange(M, dtype=jnp.int32),
                                                         mode="drop")
    return gather_rows(x, src)


def gather_rows(x: jax.Array, src: jax.Array) -> jax.Array:
    """x [M, K] -> [len(src), K]: row r is x[src[r]], zero where src[r] < 0 (no source row)."""
    return jnp.where((src >= 0)[:, None], x[jnp.maximum(src, 0)], jnp.zeros((), x.dtype))


def unpad_rows(yp: jax.Array, dest: jax.Array, dtype) -> jax.Array:
    """Rows back from the tile layout; rows in no group come out zero (as ragged_dot's)."""
    Mp = yp.shape[0]
    y = yp[jnp.minimum(dest, Mp - 1)]
    return jnp.where((dest < Mp)[:, None], y, 0).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_splits",
                                             "num_warps", "num_stages", "interpret"))
def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, *, block_m: int | None = None,
                   block_n: int | None = None, block_k: int | None = None,
                   num_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int = 3, interpret: bool = False) -> jax.Array:
    """`ragged_dot(x [M, K], w [G, K, N], sizes int32[G])` -> [M, N] in x's dtype (float32
    accumulation). num_splits: K split over that many programs per output tile (partials
    summed in float32). Blocks not given come from `default_blocks`. ValueError for shapes,
    dtypes or blocks the kernel cannot take."""
    M, K = x.shape
    G, _, N = w.shape if w.ndim == 3 else (0, 0, 0)
    block_m, block_n, block_k, num_splits, num_warps = resolve_blocks(
        M, G, K, N, block_m, block_n, block_k, num_splits, num_warps)
    check_operands(x, w, sizes, block_m, block_n, block_k)
    check_splits(K, block_k, num_splits)
    dest, tile_group, Mp = tile_layout(sizes, M, block_m)
    xp = pad_rows(x, dest, Mp)
    yp = padded_grouped_matmul(xp, w, tile_group, block_m=block_m, block_n=block_n,
                               block_k=block_k, num_splits=num_splits, num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret)
    return unpad_rows(yp, dest, x.dtype)
