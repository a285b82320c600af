"""MLA paged attention, Mosaic-GPU, with FlashMLA's "seesaw" schedule (`seesaw=True`).

Why (docs/kernels.md, "MLA at H=128"): in `kernel_mgpu.py` warpgroup 0 computes every
block's 576-deep logits product and softmax while warpgroup 1 only multiplies P by its value
half, so the tensor cores idle through each softmax. Here (deepseek-ai/FlashMLA,
docs/20250422-new-kernel-deep-dive.md) the output is split by columns as there (wg 0 holds
O_L = O[:, :R/2], wg 1 O_R), and KV blocks go in pairs (b0 in slot 0, b1 in slot 1):

    wg 0: S0 = Q K0^T; m0 = max(m, rowmax S0), published; P0 = exp2(S0 - m0) -> shared memory
          O_L = O_L * scale0 + P0 V0_L                        (scale0 = exp2(m - m0))
          wait m1, P1; O_L = O_L * scale1 + P1 V1_L           (scale1 = exp2(m0 - m1))
    wg 1: S1 = Q K1^T; wait m0; m1 = max(m0, rowmax S1), published; P1 = exp2(S1 - m1) ->
          shared memory; wait P0; O_R = (O_R * scale0 + P0 V0_R) * scale1 + P1 V1_R

One warpgroup's softmax runs while the other's products keep the tensor cores busy. Both
sides derive scale0 and scale1 from the published maxima, bit for bit alike; the maxima are
lazy as in `kernel_mgpu.py` (they move only by more than LAZY_MAX), so most rescales are
skipped. Each slot is two buffers, the left value half [bk, R/2] and the rest [bk, R/2 + dr],
with a TMA barrier each: a half is reloaded by the warpgroup that used it last, as soon as
its last product is done. There is no memory warpgroup. Shared memory: Q's two value halves
(64 KiB), two slots (144 KiB), P0 (8 KiB), and P1 in the place of Q's rope columns, which
each warpgroup holds in registers (the rope part of the logits takes its A operand from them).

Every wgmma is issued from Mosaic GPU (`inline_mgpu`) with its shared-memory operands sliced
at an *opaque zero* (`_opaque_zero`). Without it, LLVM hoists the loop-invariant operand
descriptors (Q's, and the slots', whose indices fold to constants in a pair) out of the loop:
registers held across it, and spills.

Against FlashMLA's order taken literally, three changes shorten the chain that links the
warpgroups (m0 -> wg 1's softmax -> P1 -> wg 0's P1 . V1_L -> the next logits; each measured
faster on the H100):
- each maximum is published as soon as its row max is known, before its exponentials (P0
  then goes over through a barrier of its own, p0_ready): wg 1's softmax starts beside
  wg 0's exponentials;
- wg 1 computes and hands over P1 before it multiplies P0 . V0_R, so wg 0's P1 . V1_L does
  not wait behind that product;
- the logits wait for the right buffer only after the left product is issued: it computes
  while the right half, the later-freed one, may still be arriving.

Layouts, tiles and causality: as `kernel_mgpu.py` (`mla_tiles_seesaw` takes and returns the
same arrays as `mla_tiles_mgpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir.dialects import llvm, nvvm   # no public module for these (JAX 0.10-0.11)
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith

from pallas_kernels.mla_paged_attention.kernel_mgpu import (
    LOG2E, MASKED, TILE_ROWS, _exp2_split, _full, _load_rows, _rescaled,
    check_tiles, copy_query, kv_block_pages, lazy_max, query_copies, rescale_factor, run_tiles,
    store_tile, tile_blocks, tile_live_rows, visible_keys, zero_rows_past)

_SWIZZLED = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
_REF = plgpu.RefType(transforms=_SWIZZLED)
_ACC = plgpu.Layout._WGMMA_ACC_32BIT     # an accumulator still being written by a wgmma


def _opaque_zero():
    """An index 0 that LLVM cannot see through (inline asm with side effects, so it is
    computed where it stands, inside the loop)."""
    i32 = ir.IntegerType.get_signless(32)
    zero = llvm.inline_asm(i32, [], "mov.u32 $0, 0;", "=r", has_side_effects=True)
    return arith.index_cast(ir.IndexType.get(), zero)


def _at(ref, zero):
    """A tiled shared-memory memref sliced at `zero` along its first (row-tile) axis: its
    wgmma descriptor is then computed here, not hoisted."""
    rows = ir.MemRefType(ref.type).shape[0]
    return mgpu.memref_slice(ref, (mgpu.DynamicSlice(zero, rows),))


def _transposed(ref):
    return mgpu.memref_transpose(ref, (1, 0, 3, 2))


def _logits(q_left, q_right, rope, k_left, k_right, wait_right, interpret):
    """Q . K^T [64, bk] f32 over the left value half, the right one and the rope columns
    (A operand in registers): k_right holds the right half then the rope columns. The left
    product is issued first, then wait_right() (the right buffer's barrier wait) runs while
    it computes: the right buffer may still be arriving."""
    half = q_left.shape[1]
    bk, width_right = k_right.shape
    if interpret:
        wait_right()
        kr = k_right[...]
        return (jnp.dot(q_left[...], k_left[...].T, preferred_element_type=jnp.float32)
                + jnp.dot(q_right[...], kr[:, :half].T, preferred_element_type=jnp.float32)
                + jnp.dot(rope, kr[:, half:].T, preferred_element_type=jnp.float32))
    # The left product's result crosses the Pallas code between the two calls in flight:
    # in the accumulator's own layout, not waited for (ptxas keeps the wgmmas async).
    @plgpu.inline_mgpu(arg_types=(_REF, _REF),
                       return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, bk), jnp.float32,
                                                          layout=_ACC))
    def left(ctx, q_l, k_l):
        del ctx
        z = _opaque_zero()
        acc = mgpu.WGMMAAccumulator.zero(TILE_ROWS, bk)
        acc = mgpu.wgmma(acc, _at(q_l, z), _transposed(_at(k_l, z)))
        nvvm.wgmma_commit_group_sync_aligned()
        return acc._value

    @plgpu.inline_mgpu(arg_types=(_ACC, _REF, plgpu.Layout.WGMMA, _REF, _REF),
                       return_type=plgpu.ShapeDtypeStruct((TILE_ROWS, bk), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def rest(ctx, acc, q_r, rope, k_v, k_r):
        del ctx
        z = _opaque_zero()
        acc = mgpu.WGMMAAccumulator(_value=acc, _original_layout=mgpu.WGMMA_LAYOUT,
                                    _sync=False)
        acc = mgpu.wgmma(acc, _at(q_r, z), _transposed(_at(k_v, z)))
        acc = mgpu.wgmma(acc, rope, _transposed(_at(k_r, z)))
        nvvm.wgmma_commit_group_sync_aligned()
        nvvm.wgmma_wait_group_sync_aligned(0)
        return acc.value

    acc = left(q_left, k_left)
    wait_right()
    return rest(acc, q_right, rope, k_right.at[:, pl.ds(0, half)],
                k_right.at[:, pl.ds(half, width_right - half)])


def _in_registers(x):
    return isinstance(getattr(x, "aval", None), jax.core.ShapedArray)   # not a ref


def _accumulate(acc, p, values, interpret):
    """acc [64, R/2] f32 + p [64, bk] bf16 (registers, or shared memory) . values [bk, R/2]
    (shared memory)."""
    p_in_registers = _in_registers(p)
    if interpret:
        p = p if p_in_registers else p[...]
        return acc + jnp.dot(p, values[...], preferred_element_type=jnp.float32)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA if p_in_registers else _REF, _REF),
        return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA))
    def run(ctx, acc, p, values):
        del ctx
        z = _opaque_zero()
        out = mgpu.WGMMAAccumulator.from_registers(acc)
        out = mgpu.wgmma(out, p if p_in_registers else _at(p, z), _at(values, z))
        nvvm.wgmma_commit_group_sync_aligned()
        nvvm.wgmma_wait_group_sync_aligned(0)
        return out.value

    return run(acc, p, values)


def _rope_registers(q_rope, interpret):
    """Q's rope columns [64, dr] as a wgmma A operand in registers."""
    if interpret:
        return q_rope[...]
    return plgpu.load(q_rope, (), layout=plgpu.Layout.WGMMA)


def _kernel(tile_seq_ref, tile_pos0_ref, tile_ntok_ref, bt_ref, q_ref, lat_ref,
            out_ref, lse_ref, scoped, *, block_h, block_kv, rank, num_splits, page_size,
            scale_log2, zero_masked, interpret):
    (q_left, q_right, (q_rope, p1_smem), p0_smem, ((k_left, k_right), o_stage),
     m_smem, l_smem), bars = scoped
    (q_bar, left_bars, right_bars, done_bar, m0_ready, p0_ready, m1_ready, p1_ready,
     p0_free) = bars
    tile, split, seq, pos0, kv_end, first_step, steps = tile_blocks(
        tile_seq_ref, tile_pos0_ref, tile_ntok_ref, block_kv=block_kv, num_splits=num_splits)
    wg = lax.axis_index("wg")
    half = rank // 2
    width = lat_ref.shape[2]
    live = tile_live_rows(q_ref, block_h)
    rows_layout = plgpu.Layout.WGMMA.reduce(1)
    piece = min(block_kv, page_size)

    def load(i, right):
        """TMA-copies block i's left value half (or the rest: right value half and rope)
        into slot i % 2, one copy per page piece."""
        slot = lax.rem(i, jnp.int32(2))
        cols = pl.ds(half, width - half) if right else pl.ds(0, half)
        buf, buf_bars = (k_right, right_bars) if right else (k_left, left_bars)
        pages = kv_block_pages(lat_ref, bt_ref, seq, (first_step + i) * block_kv,
                               block_kv=block_kv, page_size=page_size)
        for j, (page, row0) in enumerate(pages):
            plgpu.copy_gmem_to_smem(lat_ref.at[page, pl.ds(row0, piece), cols],
                                    buf.at[slot, pl.ds(j * piece, piece)], buf_bars.at[slot])

    def load_if(i, right):
        pl.when(i < steps)(lambda: load(i, right))

    def block_logits(i, rope):
        """Block i's logits: the left product is issued once the left buffer is in, and
        computes while the right one may still be arriving."""
        slot = lax.rem(i, jnp.int32(2))
        plgpu.barrier_wait(left_bars.at[slot])
        return _logits(q_left, q_right, rope, k_left.at[slot], k_right.at[slot],
                       lambda: plgpu.barrier_wait(right_bars.at[slot]), interpret)

    def row_max(s, i, m_prev, masked):
        """Raw logits [64, bk] of block i -> (s, visible, m_new): the lazy running max, as
        in `kernel_mgpu.py` (and s in log2 units with the positions a row must not see at
        MASKED, if `masked`)."""
        visible = None
        if masked:
            visible = visible_keys(s.shape, (first_step + i) * block_kv, pos0, block_h,
                                   interpret)
            s = jnp.where(visible, s * scale_log2, MASKED)
            block_max = s.max(axis=1)
        else:
            block_max = s.max(axis=1) * scale_log2       # the scale is > 0: the same max
        return s, visible, lazy_max(m_prev, block_max)

    def exponentials(s, visible, m_new, masked):
        """P [64, bk] f32 of `row_max`'s s against the maximum m_new."""
        if masked:
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if zero_masked:       # a row with no visible key: l = 0, output 0, weight 0
                p = jnp.where(visible, p, 0.0)
            return p
        return _exp2_split(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]),
                           interpret)

    def value_half(buffer, i, final):
        """This warpgroup's value half of block i [bk, R/2]; in the final pair its rows past
        kv_end are zeroed first (spare pages may hold NaN, and 0 * NaN is NaN)."""
        values = buffer.at[lax.rem(i, jnp.int32(2)), :, pl.ds(0, half)]
        if final:
            zero_rows_past(values, (first_step + i) * block_kv, kv_end, interpret)
        return values

    def publish(ref, x, barrier):
        """Stores x into shared memory (fenced for wgmma too) and arrives on `barrier`."""
        ref[...] = x
        plgpu.commit_smem()
        plgpu.barrier_arrive(barrier)

    def scaled(acc, alpha):
        return _rescaled(acc, alpha, interpret)

    nfull = lax.div(steps, jnp.int32(2))       # pairs with both blocks

    def run_pairs(pair, carry):
        """Pairs 0 .. nfull - 2 unmasked, the last full pair masked (its rows past kv_end
        zeroed), then a lone last block if steps is odd. Only the last two blocks can hold
        positions a row must not see: past pos0 lie < 64 of them (a tile's <= 64 tokens)."""
        carry = lax.fori_loop(0, nfull - 1, functools.partial(
            pair, masked=False, final=False, has_b1=True), carry)
        carry = lax.cond(nfull > 0, lambda c: pair(nfull - 1, c, masked=True, final=True,
                                                    has_b1=True), lambda c: c, carry)
        return lax.cond(lax.rem(steps, jnp.int32(2)) == 1,
                        lambda c: pair(nfull, c, masked=True, final=True, has_b1=False),
                        lambda c: c, carry)

    @pl.when(wg == 0)
    def _():
        for cols, smem in ((pl.ds(0, half), q_left), (pl.ds(half, half), q_right),
                           (pl.ds(rank, width - rank), q_rope)):
            copy_query(q_ref, cols, smem, q_bar, tile, seq, block_h)
        for i in range(2):
            load_if(jnp.int32(i), False)
            load_if(jnp.int32(i), True)

    plgpu.barrier_wait(q_bar)
    # Each warpgroup reads the rope columns into registers before the first P1 overwrites
    # them: wg 1 writes P1 only after wg 0's first m0_ready, which follows this load.
    rope = _rope_registers(q_rope, interpret)
    acc = _full((TILE_ROWS, half), 0.0, plgpu.Layout.WGMMA, interpret)
    m_init = _full((TILE_ROWS,), MASKED, rows_layout, interpret)
    l_init = _full((TILE_ROWS,), 0.0, rows_layout, interpret)

    def zeros_s():
        return _full((TILE_ROWS, block_kv), 0.0, plgpu.Layout.WGMMA, interpret)

    def finish(acc, m_f, l_own):
        """Sum both warpgroups' row sums (wg 0's through m_smem, wg 1's through l_smem),
        normalize, store this warpgroup's output half (and wg 0 the log2-sum-exp, staged in
        l_smem, which only wg 0 reads)."""
        publish(l_smem if m_f is None else m_smem, l_own, done_bar)
        plgpu.barrier_wait(done_bar)             # both are past their last ring read, too
        l = l_own + _load_rows(m_smem if m_f is None else l_smem, interpret)
        l_safe = jnp.where(l > 0, l, 1.0)
        stage = o_stage.at[wg]
        stage[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(stage.dtype)
        if m_f is not None:                      # wg 0 (wg 1 passes None)
            l_smem[...] = m_f + jnp.log2(l_safe)
        store_tile(stage, l_smem, out_ref, lse_ref, tile, split, seq, wg, live, block_h)

    # m_smem holds one maximum at a time: wg 0 writes m0 (after reading the last m1), wg 1
    # reads it and writes m1, wg 0 reads that. A row's value is read and written only by
    # the 4 threads holding that row, with the row max's shuffles between.
    @pl.when(wg == 0)
    def _wg0():
        def pair(j, carry, *, masked, final, has_b1):
            acc, m_i, l_i, s0 = carry
            b0 = 2 * j
            s, visible, m0 = row_max(s0, b0, m_i, masked)
            publish(m_smem, m0, m0_ready)           # wg 1's softmax needs only m0
            p0 = exponentials(s, visible, m0, masked)
            scale0 = rescale_factor(m_i, m0)
            l_i = l_i * scale0 + p0.sum(axis=1)
            p0 = p0.astype(p0_smem.dtype)
            pl.when(j > 0)(lambda: plgpu.barrier_wait(p0_free))   # wg 1 is done with P0
            publish(p0_smem, p0, p0_ready)
            acc = _accumulate(scaled(acc, scale0), p0, value_half(k_left, b0, final),
                              interpret)
            load_if(b0 + 2, False)                  # this half of slot 0 is free now
            plgpu.barrier_wait(m1_ready)
            m1 = _load_rows(m_smem, interpret)
            scale1 = rescale_factor(m0, m1)                 # bit for bit wg 1's
            l_i = l_i * scale1
            if not has_b1:                          # the lone last block
                return scaled(acc, scale1), m1, l_i, zeros_s()
            plgpu.barrier_wait(p1_ready)
            acc = _accumulate(scaled(acc, scale1), p1_smem,
                              value_half(k_left, b0 + 1, final), interpret)
            load_if(b0 + 3, False)                  # this half of slot 1 is free now
            # (not `lambda: s0`: that would keep this pair's logits alive through it)
            s0 = lax.cond(b0 + 2 < steps, lambda: block_logits(b0 + 2, rope), zeros_s)
            return acc, m1, l_i, s0

        s0 = lax.cond(steps > 0, lambda: block_logits(jnp.int32(0), rope), zeros_s)
        acc_f, m_f, l_f, _ = run_pairs(pair, (acc, m_init, l_init, s0))
        pl.when(steps > 0)(lambda: plgpu.barrier_wait(p0_free))  # the last pair's release
        finish(acc_f, m_f, l_f)

    @pl.when(wg == 1)
    def _wg1():
        def pair(j, carry, *, masked, final, has_b1):
            acc, m_i, l_i, s1 = carry                # m_i: the maximum before this pair
            b0 = 2 * j
            plgpu.barrier_wait(m0_ready)
            m0 = _load_rows(m_smem, interpret)
            scale0 = rescale_factor(m_i, m0)                 # bit for bit wg 0's
            if has_b1:
                s, visible, m1 = row_max(s1, b0 + 1, m0, masked)
                publish(m_smem, m1, m1_ready)
                # P1 before P0 . V0_R: wg 0's P1 . V1_L waits for it
                p1 = exponentials(s, visible, m1, masked)
                scale1 = rescale_factor(m0, m1)
                l_i = l_i * (scale0 * scale1) + p1.sum(axis=1)
                p1 = p1.astype(p1_smem.dtype)
                publish(p1_smem, p1, p1_ready)
            else:     # a lone last block: nothing to add, the maximum stays m0
                m1 = m0
                l_i = l_i * scale0
                plgpu.barrier_arrive(m1_ready)
            plgpu.barrier_wait(p0_ready)
            acc = _accumulate(scaled(acc, scale0), p0_smem, value_half(k_right, b0, final),
                              interpret)
            plgpu.barrier_arrive(p0_free)
            load_if(b0 + 2, True)                   # this half of slot 0 is free now
            if not has_b1:
                return acc, m1, l_i, zeros_s()
            acc = _accumulate(scaled(acc, scale1), p1, value_half(k_right, b0 + 1, final),
                              interpret)
            load_if(b0 + 3, True)                   # this half of slot 1 is free now
            s1 = lax.cond(b0 + 3 < steps, lambda: block_logits(b0 + 3, rope), zeros_s)
            return acc, m1, l_i, s1

        s1 = lax.cond(steps > 1, lambda: block_logits(jnp.int32(1), rope), zeros_s)
        acc_f, _, l_f, _ = run_pairs(pair, (acc, m_init, l_init, s1))
        finish(acc_f, None, l_f)


def mla_tiles_seesaw(q_tiles, latent, block_tables, tile_seq, tile_pos0, tile_ntok, *, rank,
                     block_h, sm_scale, block_kv=64, num_splits=1, zero_masked=False,
                     interpret=False):
    """`mla_tiles_mgpu`'s contract (same inputs, outputs and checks) with the seesaw
    schedule: [n, rows, W] query tiles (or token-major [S, block_q, H, W]) -> (out [n,
    splits, rows, R] bf16 (or [splits, S, block_q, H, R]), lse [n, splits, rows] f32)."""
    check_tiles(q_tiles, latent, rank, block_kv, block_h, tile_seq.shape[0])
    width = q_tiles.shape[-1]
    page_size = latent.shape[1]
    if width - rank != 64 or block_kv != 64:
        raise ValueError(f"the seesaw kernel needs 64 rope columns (width {width} - "
                         f"kv_lora_rank {rank}) and block_k 64, got block_k {block_kv}")
    if not sm_scale > 0:    # the softmax takes the max of the unscaled logits
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    half, rope = rank // 2, width - rank

    def smem(*shape):
        return plgpu.SMEM(shape, jnp.bfloat16, transforms=_SWIZZLED)

    ring = (smem(2, block_kv, half), smem(2, block_kv, width - half))
    output = smem(2, TILE_ROWS, half)
    # Q's rope columns share their place with P1 (each warpgroup holds them in registers
    # once loaded), and the output halves take the KV ring's after the loop. The interpreter
    # has no RefUnion (nor a shared-memory limit): separate buffers there.
    union = (lambda *refs: refs) if interpret else plgpu.RefUnion
    rows_f32 = plgpu.SMEM((TILE_ROWS,), jnp.float32)
    kernel = functools.partial(
        _kernel, block_h=block_h, block_kv=block_kv, rank=rank, num_splits=num_splits,
        page_size=page_size, scale_log2=float(sm_scale) * LOG2E, zero_masked=zero_masked,
        interpret=interpret)
    copies = max(1, block_kv // page_size)
    halves = plgpu.Barrier(num_arrivals=copies, num_barriers=2)     # a TMA barrier a slot

    return run_tiles(
        kernel,
        (smem(TILE_ROWS, half), smem(TILE_ROWS, half),
         union(smem(TILE_ROWS, rope), smem(TILE_ROWS, block_kv)),
         smem(TILE_ROWS, block_kv),
         union(ring, output),
         rows_f32, rows_f32),
        (plgpu.Barrier(num_arrivals=3 * query_copies(q_tiles)), halves, halves,
         plgpu.Barrier(num_arrivals=2), *(plgpu.Barrier() for _ in range(5))),
        (tile_seq, tile_pos0, tile_ntok, block_tables, q_tiles, latent),
        num_splits=num_splits, rank=rank, block_h=block_h, num_threads=2, interpret=interpret)
