"""The grouped matmul as a Pallas Mosaic-GPU (Hopper warpgroup) kernel, bf16, for prefill sizes.

Why a second kernel: the Triton one (`kernel.py`) runs prefill-sized expert layers at under
half the bf16 matmul rate (docs/benchmarks.md): its 128 x 128
gate/up tile holds two float32 accumulators that spill. Here a CTA runs three warpgroups on one
(128-row tile, column block), the shape of JAX's Hopper matmul example
(jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py), with the group chosen per tile:

    wg 0, 1  compute: rows [64 wg, 64 wg + 64) of the tile; per K block one wgmma per weight
             from shared memory into float32 accumulators held by wgmma ([64, block_n] each),
             the next block's wgmma issued before the previous one is waited for; then the
             epilogue (activation(gate) * up with two weights, else the one product), staged
             in shared memory and TMA-stored.
    wg 2     memory: TMA-copies x [128, BLOCK_K] and each weight's [BLOCK_K, block_n] block of
             the tile's expert into a ring of `num_stages` slots, reusing a slot when both
             compute warpgroups have released it.

Work items are (tile, column block) pairs on one grid axis in band order (`tile_bands`): a
band of up to BAND_TILES consecutive tiles of one expert runs its tiles fastest, then its
column blocks, so one expert's tiles read each weight block from DRAM once; with `num_ctas` a
persistent grid loops over them. Without the band order the weights' DRAM reads bound the
large (V3-slice) shapes (docs/kernels.md).

Layouts:
    xp          [Mp, K] bf16     rows laid out tile by tile (`tile_layout`, block_m = 128)
    weights     [G, K, N] bf16   one or two (gate, up), read in place
    tile_group  [n_tiles] int32  each tile's group, -1: an empty tile (nothing read or written)
    tile_rows   [n_tiles] int32  each tile's live rows (optional); in the kernel with the group
                                 and each tile's band, [n_tiles, 4]
    out         [Mp, N] bf16     rows of empty tiles and idle warpgroups are left unwritten
                                 (callers never read them: each row's output is its own)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._device import HOPPER_SMEM_BYTES
from pallas_kernels._hopper import aligned_copy, interpret_params

TILE_M = 128            # rows per CTA: two compute warpgroups of wgmma's M = 64
BLOCK_K = 64            # K per ring slot: one 128-byte swizzled row of bf16
WG_ROWS = 64
SMEM_LIMIT = HOPPER_SMEM_BYTES
BAND_TILES = 8          # tiles per band of the work items' order (`tile_bands`)


def tile_bands(tile_group: jax.Array, band_tiles: int) -> tuple[jax.Array, jax.Array]:
    """(start, size), int32[n_tiles] each: the band of each tile, runs of consecutive tiles of
    one group cut into bands of at most band_tiles. The kernel runs a band's items with its
    tiles fastest, so the tiles of one expert read each weight block at nearly the same time
    (once from DRAM, then from L2) while the band's rows stay in L2 across its column blocks.
    Column blocks fastest instead (band_tiles 1) re-read a weight block from DRAM for each
    tile, and the DRAM traffic, not the matmul, bounds the kernel."""
    n = tile_group.shape[0]
    t = jnp.arange(n, dtype=jnp.int32)
    change = tile_group[1:] != tile_group[:-1]
    run_start = lax.cummax(jnp.where(jnp.concatenate([jnp.ones(1, bool), change]), t, 0))
    run_end = lax.cummin(jnp.where(jnp.concatenate([change, jnp.ones(1, bool)]), t + 1, n),
                         reverse=True)
    start = run_start + (t - run_start) // band_tiles * band_tiles
    return start, jnp.minimum(band_tiles, run_end - start)


def band_item(w, num_cols: int, band_of):
    """(tile, column block) of work item w (int32, scalar or array) in band order: band
    [start, start + size) holds items [start, start + size) * num_cols, tiles fastest. band_of
    maps a tile to its band's (start, size); w // num_cols is a tile of w's band."""
    start, size = band_of(lax.div(w, jnp.int32(num_cols)))
    r = w - start * num_cols
    return start + lax.rem(r, size), lax.div(r, size)


def smem_bytes(n_weights: int, block_n: int, num_stages: int, persistent: bool = False) -> int:
    """Shared memory of one CTA: the ring, the output stage (in the ring's memory unless
    persistent: there the memory warpgroup runs ahead into the next item's blocks) and the
    barriers."""
    ring = num_stages * 2 * BLOCK_K * (TILE_M + n_weights * block_n)
    out = 2 * TILE_M * block_n
    return (ring + out if persistent else max(ring, out)) + 1024


def _kernel(tiles_ref, x_ref, *refs, n_weights, block_n, num_stages,
            activation, num_ctas, num_cols, persistent):
    """Work items w = cta + j * num_ctas in band order (`tile_bands`): the items of a band of
    tiles [start, start + size) are w in [start, start + size) * num_cols, tiles fastest,
    then column blocks. Ring slots and barrier phases run on over the CTA's items: slot =
    (steps before) % stages. tiles_ref int32[n_tiles, 4]: (group, band start, band size,
    live rows). A compute warpgroup whose 64 rows are all past the tile's live rows (the
    tail of an expert's last tile) only paces the ring: no products, no store."""
    w_refs, out_ref, scoped = refs[:n_weights], refs[n_weights], refs[n_weights + 1]
    (x_smem, w_smem), out_smem = scoped[0]
    loaded, consumed, done = scoped[1]
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    items = num_cols * (x_ref.shape[0] // TILE_M)
    my_items = lax.div(items - cta + (num_ctas - 1), jnp.int32(num_ctas))
    k_steps = x_ref.shape[1] // BLOCK_K

    def item(j):
        """(tile, column block, steps: 0 for an empty tile) of this CTA's j-th item."""
        tile, col = band_item(cta + j * num_ctas, num_cols,
                              lambda t: (tiles_ref[t, 1], tiles_ref[t, 2]))
        group = tiles_ref[tile, 0]
        return tile, col, group, jnp.where(group >= 0, k_steps, 0)

    def slot_of(n):
        return lax.rem(n, jnp.int32(num_stages))

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        rows = pl.ds(wg * WG_ROWS, WG_ROWS)

        def one_item(j, base):
            tile, col, group, steps = item(j)

            def with_accumulators(*accs):
                def step(i, _):
                    slot = slot_of(base + i)
                    plgpu.barrier_wait(loaded.at[slot])
                    for acc, w in zip(accs, range(n_weights)):
                        plgpu.wgmma(acc, x_smem.at[slot, rows], w_smem.at[slot, w])
                    # Step i's products run while step i - 1's are waited for: then its
                    # slot is free for the memory warpgroup.
                    plgpu.wgmma_wait(n_weights)

                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_arrive(consumed.at[slot_of(base + i - 1)])

                lax.fori_loop(0, steps, step, None)
                plgpu.wgmma_wait(0)

                @pl.when(steps > 0)
                def _():
                    plgpu.barrier_arrive(consumed.at[slot_of(base + steps - 1)])

                @pl.when(group >= 0)
                def _store():
                    sums = [acc[...] for acc in accs]
                    out = activation(sums[0]) * sums[1] if n_weights == 2 else sums[0]
                    if persistent:      # the last item's store has read its stage
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    else:               # both warpgroups are past the ring out_smem reuses
                        plgpu.barrier_arrive(done)
                        plgpu.barrier_wait(done)
                    stage = out_smem.at[wg]
                    stage[...] = out.astype(stage.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        stage, out_ref.at[pl.ds(tile * TILE_M + wg * WG_ROWS, WG_ROWS),
                                          pl.ds(col * block_n, block_n)])

            live = tiles_ref[tile, 3] > wg * WG_ROWS

            @pl.when(live)
            def _():
                pl.run_scoped(with_accumulators,
                              *[plgpu.ACC((WG_ROWS, block_n), jnp.float32)] * n_weights)

            @pl.when(jnp.logical_not(live))
            def _idle():        # release each slot once loaded, as the products would
                @pl.loop(0, steps)
                def _(i):
                    slot = slot_of(base + i)
                    plgpu.barrier_wait(loaded.at[slot])
                    plgpu.barrier_arrive(consumed.at[slot])

                if not persistent:
                    @pl.when(group >= 0)
                    def _():
                        plgpu.barrier_arrive(done)
                        plgpu.barrier_wait(done)
            return base + steps

        lax.fori_loop(0, my_items, one_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def one_item(j, base):
            tile, col, group, steps = item(j)
            g = jnp.maximum(group, 0)
            all_rows = tiles_ref[tile, 3] > WG_ROWS     # else only wg 0's rows: wg 1 idles

            @pl.loop(0, steps)
            def _(i):
                slot = slot_of(base + i)

                @pl.when(base + i >= num_stages)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                k = pl.ds(i * BLOCK_K, BLOCK_K)
                for n_rows in (TILE_M, WG_ROWS):
                    @pl.when(all_rows == (n_rows == TILE_M))
                    def _():
                        plgpu.copy_gmem_to_smem(x_ref.at[pl.ds(tile * TILE_M, n_rows), k],
                                                x_smem.at[slot, pl.ds(0, n_rows)],
                                                loaded.at[slot])
                for w, w_ref in enumerate(w_refs):
                    plgpu.copy_gmem_to_smem(w_ref.at[g, k, pl.ds(col * block_n, block_n)],
                                            w_smem.at[slot, w], loaded.at[slot])
            return base + steps

        total = lax.fori_loop(0, my_items, one_item, jnp.int32(0))

        # Observe the last releases too (JAX's GPU interpreter checks that every phase of a
        # barrier was seen).
        @pl.loop(jnp.maximum(total - num_stages, 0), total)
        def _(n):
            plgpu.barrier_wait(consumed.at[slot_of(n)])


def grouped_matmul_mgpu(xp: jax.Array, weights: tuple, tile_group: jax.Array, *,
                        activation=None, block_n: int = 128, num_stages: int = 4,
                        num_ctas: int | None = None, band_tiles: int | None = None,
                        tile_rows: jax.Array | None = None,
                        interpret: bool = False) -> jax.Array:
    """xp [Mp, K] (Mp a multiple of 128) times each tile's expert of one weight [G, K, N] -> [Mp,
    N], or of two (gate, up) -> activation(xp @ gate) * (xp @ up), float32 math, in xp's dtype.
    num_ctas: None, one CTA per (tile, column block); or a persistent grid of that many CTAs
    (e.g. `_device.num_sms()`) looping over the work items, whose memory warpgroup loads the
    next item's first blocks while the compute warpgroups store the last (the output stage then
    takes its own shared memory, fewer ring slots may fit). band_tiles: the work items' order,
    runs of tiles of one group in bands of at most this many tiles, each band's tiles fastest
    (`tile_bands`; default BAND_TILES; 1 runs column blocks fastest).
    tile_rows: int32[n_tiles], each tile's live rows (its first ones; `tile_live_rows`), or
    None for all: a compute warpgroup whose 64 rows are all past them skips its products,
    and its output rows are left unwritten. See the module docstring for the layouts;
    ValueError for what the kernel cannot take."""
    n_weights = len(weights)
    Mp, K = xp.shape
    if n_weights not in (1, 2) or any(w.ndim != 3 or w.shape != weights[0].shape
                                      for w in weights):
        raise ValueError(f"weights must be one or two [G, K, N] arrays of one shape, got "
                         f"{[tuple(w.shape) for w in weights]}")
    G, K2, N = weights[0].shape
    if K2 != K:
        raise ValueError(f"the weights' K ({K2}) must equal xp's ({K})")
    if xp.dtype != jnp.bfloat16 or any(w.dtype != jnp.bfloat16 for w in weights):
        raise ValueError(f"the Mosaic-GPU grouped matmul takes bfloat16, got {xp.dtype} and "
                         f"{[str(w.dtype) for w in weights]}")
    if n_weights == 2 and activation is None:
        raise ValueError("two weights (gate, up) need an activation")
    if Mp % TILE_M or tile_group.shape != (Mp // TILE_M,):
        raise ValueError(f"xp's rows ({Mp}) must be whole {TILE_M}-row tiles, one tile_group "
                         f"entry each, got tile_group {tuple(tile_group.shape)}")
    if K % BLOCK_K or block_n % 64 or N % block_n or block_n > 256:
        raise ValueError(f"K={K} must be a multiple of {BLOCK_K} (a 128-byte swizzled row), and "
                         f"block_n a multiple of 64, <= 256, dividing N={N}; got block_n="
                         f"{block_n}")
    items = (Mp // TILE_M) * (N // block_n)
    persistent = num_ctas is not None
    if persistent and num_ctas < 1:
        raise ValueError(f"num_ctas must be None or >= 1, got {num_ctas}")
    num_ctas = min(num_ctas, items) if persistent else items
    band_tiles = BAND_TILES if band_tiles is None else band_tiles
    if not (isinstance(band_tiles, int) and band_tiles >= 1):
        raise ValueError(f"band_tiles must be an int >= 1, got {band_tiles!r}")
    need = smem_bytes(n_weights, block_n, num_stages, persistent)
    if num_stages < 2 or need > SMEM_LIMIT:
        raise ValueError(f"num_stages={num_stages} with block_n={block_n} needs {need} B of "
                         f"shared memory{' (persistent)' if persistent else ''}; it takes >= 2 "
                         f"stages within {SMEM_LIMIT} B")
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    ring = (plgpu.SMEM((num_stages, TILE_M, BLOCK_K), jnp.bfloat16, transforms=swizzled),
            plgpu.SMEM((num_stages, n_weights, BLOCK_K, block_n), jnp.bfloat16,
                       transforms=swizzled))
    output = plgpu.SMEM((2, WG_ROWS, block_n), jnp.bfloat16, transforms=swizzled)
    # The ring, then (after the loop) the output stage, in the same shared memory; separate
    # buffers on a persistent grid, and in the interpreter (no RefUnion, no memory limit).
    ring_then_output = ((ring, output) if interpret or persistent
                        else plgpu.RefUnion(ring, output))
    kernel = functools.partial(_kernel, n_weights=n_weights, block_n=block_n,
                               num_stages=num_stages, activation=activation,
                               num_ctas=num_ctas, num_cols=N // block_n, persistent=persistent)

    def entry(tiles_ref, x_ref, *refs):
        pl.run_scoped(
            lambda *scoped: kernel(tiles_ref, x_ref, *refs, scoped),
            ring_then_output,
            (plgpu.Barrier(num_arrivals=1 + n_weights, num_barriers=num_stages),
             plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
             None if persistent else plgpu.Barrier(num_arrivals=2)),
            collective_axes="wg")

    tile_group = tile_group.astype(jnp.int32)
    if tile_rows is None:
        tile_rows = jnp.full(tile_group.shape, TILE_M, jnp.int32)
    elif tile_rows.shape != tile_group.shape:
        raise ValueError(f"tile_rows must be int32[n_tiles={tile_group.shape[0]}], got "
                         f"{tuple(tile_rows.shape)}")
    tiles = aligned_copy(jnp.stack([tile_group, *tile_bands(tile_group, band_tiles),
                                    tile_rows.astype(jnp.int32)], axis=1))
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((Mp, N), xp.dtype),
        # One grid axis over the work items in band order (`tile_bands`): the CTAs that run
        # side by side share a band's rows and its expert's weight blocks. A 2-D grid
        # (columns, tiles) runs all tiles fastest and re-reads each row tile from DRAM once
        # per column block.
        grid=(num_ctas,), grid_names=("cta",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params() if interpret else None,
    )(tiles, xp, *weights)
