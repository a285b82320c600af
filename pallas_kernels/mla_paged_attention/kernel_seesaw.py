"""MLA paged attention, Mosaic-GPU, with FlashMLA's "seesaw" schedule: two warpgroups that
take KV blocks in pairs and each compute the logits of one block of the pair.

Why (docs/kernels.md, "MLA at H=128"): in `kernel_mgpu.py` warpgroup 0 computes every
block's 576-deep logits product and softmax while warpgroup 1 only multiplies P by its value
half, so the tensor cores idle through each softmax and the two warpgroups' work is uneven.
Here (deepseek-ai/FlashMLA, docs/20250422-new-kernel-deep-dive.md) the output is split by
columns as before (wg 0 holds O_L = O[:, :R/2], wg 1 O_R), and for a pair of blocks (b0 in
slot 0, b1 in slot 1):

    wg 0: S0 = Q K0^T; m0 = max(m, rowmax S0); P0 = exp2(S0 - m0) -> shared memory; publish m0
          O_L = O_L * scale0 + P0 V0_L                        (scale0 = exp2(m - m0))
          wait m1; O_L = O_L * scale1 + P1 V1_L               (scale1 = exp2(m0 - m1))
    wg 1: S1 = Q K1^T; wait m0; m1 = max(m0, rowmax S1); P1 = exp2(S1 - m1) -> shared memory
          publish m1; O_R = (O_R * scale0 + P0 V0_R) * scale1 + P1 V1_R

Both sides compute scale0 and scale1 from the published maxima, bit for bit alike. Unlike
FlashMLA, P0 is stored as is (not times scale1, once m1 is known): holding it in registers
through the wait for m1 spilled, and the scale applies to the accumulator instead.

One warpgroup's softmax runs while the other's products keep the tensor cores busy, and each
does one logits product and two value products per pair. Each slot is two buffers, the left
value half [bk, R/2] and the rest [bk, R/2 + dr], with a TMA barrier each: a half is
reloaded (by the warpgroup that used it last) as soon as its last product is done, so the
next pair's loads overlap this pair's work. There is no memory warpgroup, and one release
barrier (P0's buffer, which wg 1 reads after publishing m1): every other hand-over above
orders the reuse. Shared memory: Q (72 KiB), two slots
(144 KiB), P0 (8 KiB), and P1 in the place of Q's rope columns, which each warpgroup holds in
registers for the whole kernel (the rope part of the logits takes its A operand from them).

Layouts, tiles and causality: as `kernel_mgpu.py` (`mla_tiles_seesaw` takes and returns the
same arrays as `mla_tiles_mgpu`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mla_paged_attention.kernel_mgpu import (
    LOG2E, MASKED, TILE_ROWS, _accumulate, _first_rows, _full, _iota, _load_rows, check_tiles,
    copy_kv_block, run_tiles, store_tile, zero_rows_past)


def _rope_registers(q_rope, interpret):
    """Q's rope columns [64, dr] as a wgmma A operand in registers."""
    if interpret:
        return q_rope[...]
    return plgpu.load(q_rope, (), layout=plgpu.Layout.WGMMA)


def _logits(q_left, q_right, rope, k_left, k_right, wait_left, wait_right, interpret):
    """Q . K^T [64, bk] f32 over the three column groups (left value half, right value half,
    rope: its A operand in registers). Waits for each half's TMA just before its product."""
    half = q_left.shape[1]
    if interpret:
        wait_left()
        wait_right()
        kr = k_right[...]
        return (jnp.dot(q_left[...], k_left[...].T, preferred_element_type=jnp.float32)
                + jnp.dot(q_right[...], kr[:, :half].T, preferred_element_type=jnp.float32)
                + jnp.dot(rope, kr[:, half:].T, preferred_element_type=jnp.float32))

    def run(ref):
        wait_left()
        plgpu.wgmma(ref, q_left, plgpu.transpose_ref(k_left, (1, 0)))
        wait_right()
        plgpu.wgmma(ref, q_right, plgpu.transpose_ref(k_right.at[:, pl.ds(0, half)], (1, 0)))
        plgpu.wgmma(ref, rope, plgpu.transpose_ref(
            k_right.at[:, pl.ds(half, k_right.shape[1] - half)], (1, 0)))
        plgpu.wgmma_wait(0)
        return ref[...]
    return pl.run_scoped(run, plgpu.ACC((TILE_ROWS, k_left.shape[0]), jnp.float32))


def _kernel(tile_seq_ref, tile_pos0_ref, tile_ntok_ref, bt_ref, q_ref, lat_ref,
            out_ref, lse_ref, scoped, *, block_h, block_kv, rank, num_splits, page_size,
            scale_log2, zero_masked, interpret):
    (q_left, q_right, (q_rope, p1_smem), p0_smem, ((k_left, k_right), o_stage),
     m_smem, l_smem), bars = scoped
    q_bar, left_bars, right_bars, done_bar, m0_ready, m1_ready, p1_ready, p0_free = bars
    tile = lax.axis_index("tile")
    split = lax.axis_index("split")
    wg = lax.axis_index("wg")
    seq = tile_seq_ref[tile]
    pos0 = tile_pos0_ref[tile]
    ntok = tile_ntok_ref[tile]
    kv_end = jnp.where(ntok > 0, pos0 + ntok, 0)            # KV positions 0 .. kv_end - 1
    total_steps = lax.div(kv_end + (block_kv - 1), jnp.int32(block_kv))
    per_split = lax.div(total_steps + (num_splits - 1), jnp.int32(num_splits))
    first_step = split * per_split
    steps = jnp.clip(total_steps - first_step, 0, per_split)   # this CTA's blocks
    half = rank // 2
    width = lat_ref.shape[2]
    live = q_ref.shape[1]
    rows_layout = plgpu.Layout.WGMMA.reduce(1)
    def load(i, right):
        """TMA-copies block i's left value half (or the rest: right value half and rope)
        into slot i % 2."""
        slot = lax.rem(i, jnp.int32(2))
        cols = pl.ds(half, width - half) if right else pl.ds(0, half)
        ring, bars = (k_right, right_bars) if right else (k_left, left_bars)
        copy_kv_block(lat_ref, bt_ref, seq, (first_step + i) * block_kv, ring, slot,
                      bars.at[slot], block_kv=block_kv, page_size=page_size, cols=cols)

    def load_if(i, right):
        pl.when(i < steps)(lambda: load(i, right))

    def block_logits(i, rope):
        slot = lax.rem(i, jnp.int32(2))
        return _logits(q_left, q_right, rope, k_left.at[slot], k_right.at[slot],
                       lambda: plgpu.barrier_wait(left_bars.at[slot]),
                       lambda: plgpu.barrier_wait(right_bars.at[slot]), interpret)

    def scaled_masked(s, i, masked):
        """Logits scaled to log2 units; positions a row must not see at MASKED."""
        s = s * scale_log2
        if not masked:
            return s, None
        k0 = (first_step + i) * block_kv
        row_tok = lax.div(_iota(s.shape, 0, interpret), jnp.int32(block_h))
        visible = (_iota(s.shape, 1, interpret) + k0) <= (row_tok + pos0)
        return jnp.where(visible, s, MASKED), visible

    def exp_and_sum(s, m_new, visible):
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        if zero_masked and visible is not None:   # a row with no visible key: l = 0
            p = jnp.where(visible, p, 0.0)
        return p, p.sum(axis=1)

    def value_half(buffer, i, final):
        """This warpgroup's value half of block i [bk, R/2]; in the final pair its rows past
        kv_end are zeroed first (spare pages may hold NaN, and 0 * NaN is NaN)."""
        values = buffer.at[lax.rem(i, jnp.int32(2)), :, pl.ds(0, half)]
        if final:
            zero_rows_past(values, (first_step + i) * block_kv, kv_end, interpret)
        return values

    def rows(x):
        return lax.broadcast_in_dim(x, (TILE_ROWS, half), [0])

    def store_p(ref, p):
        ref[...] = p.astype(ref.dtype)
        plgpu.commit_smem()

    def store_rows(ref, x):
        ref[...] = x
        plgpu.commit_smem()

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
        plgpu.copy_gmem_to_smem(q_ref.at[tile, :, pl.ds(0, half)], _first_rows(q_left, live),
                                q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[tile, :, pl.ds(half, half)],
                                _first_rows(q_right, live), q_bar)
        plgpu.copy_gmem_to_smem(q_ref.at[tile, :, pl.ds(rank, width - rank)],
                                _first_rows(q_rope, live), q_bar)
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
        store_rows(l_smem if m_f is None else m_smem, l_own)
        plgpu.barrier_arrive(done_bar)           # both are past their last ring read, too
        plgpu.barrier_wait(done_bar)
        l = l_own + _load_rows(m_smem if m_f is None else l_smem, interpret)
        l_safe = jnp.where(l > 0, l, 1.0)
        stage = o_stage.at[wg]
        stage[...] = (acc / rows(l_safe)).astype(stage.dtype)

        if m_f is not None:                      # wg 0 (wg 1 passes None)
            l_smem[...] = m_f + jnp.log2(l_safe)

        store_tile(stage, l_smem, out_ref, lse_ref, tile, split, wg, live)

    @pl.when(wg == 0)
    def _wg0():
        def pair(j, carry, *, masked, final, has_b1):
            acc, m_i, l_i, s0 = carry
            b0 = 2 * j
            s, visible = scaled_masked(s0, b0, masked)
            m0 = jnp.maximum(m_i, s.max(axis=1))
            scale0 = jnp.exp2(m_i - m0)
            p0, p0_sum = exp_and_sum(s, m0, visible)
            l_i = l_i * scale0 + p0_sum
            p0 = p0.astype(p0_smem.dtype)
            pl.when(j > 0)(lambda: plgpu.barrier_wait(p0_free))   # wg 1 is done with P0
            store_p(p0_smem, p0)
            store_rows(m_smem, m0)
            plgpu.barrier_arrive(m0_ready)
            acc = _accumulate(acc * rows(scale0), p0, value_half(k_left, b0, final),
                              interpret)
            load_if(b0 + 2, False)                  # this half of slot 0 is free now
            plgpu.barrier_wait(m1_ready)
            m1 = _load_rows(m_smem, interpret)
            scale1 = jnp.exp2(m0 - m1)              # bit for bit wg 1's
            l_i = l_i * scale1
            if not has_b1:                          # the lone last block
                return acc * rows(scale1), m1, l_i, zeros_s()
            plgpu.barrier_wait(p1_ready)
            acc = _accumulate(acc * rows(scale1), p1_smem, value_half(k_left, b0 + 1, final),
                              interpret)
            load_if(b0 + 3, False)                  # this half of slot 1 is free now
            # (not `lambda: s0`: that would keep this pair's logits alive through the pair)
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
            scale0 = jnp.exp2(m_i - m0)             # bit for bit wg 0's
            if has_b1:
                s, visible = scaled_masked(s1, b0 + 1, masked)
                m1 = jnp.maximum(m0, s.max(axis=1))
                scale1 = jnp.exp2(m0 - m1)
                p1, p1_sum = exp_and_sum(s, m1, visible)
                l_i = l_i * (scale0 * scale1) + p1_sum
                store_rows(m_smem, m1)
                plgpu.barrier_arrive(m1_ready)
                store_p(p1_smem, p1)
                plgpu.barrier_arrive(p1_ready)
            else:     # a lone last block: nothing to add, the maximum stays m0
                m1 = m0
                l_i = l_i * scale0
                plgpu.barrier_arrive(m1_ready)
            acc = _accumulate(acc * rows(scale0), p0_smem, value_half(k_right, b0, final),
                              interpret)
            plgpu.barrier_arrive(p0_free)
            load_if(b0 + 2, True)                   # this half of slot 0 is free now
            if not has_b1:
                return acc, m1, l_i, zeros_s()
            acc = _accumulate(acc * rows(scale1), p1_smem,
                              value_half(k_right, b0 + 1, final), interpret)
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
    schedule: [n, rows, W] query tiles -> (out [n, splits, rows, R] bf16, lse [n, splits,
    rows] f32)."""
    check_tiles(q_tiles, latent, rank, block_kv)
    width = q_tiles.shape[2]
    page_size = latent.shape[1]
    if width == rank or block_kv % 64:
        raise ValueError(f"the seesaw kernel needs rope columns (width {width} > kv_lora_rank "
                         f"{rank}) and block_kv a multiple of 64, got {block_kv}")
    half, rope = rank // 2, width - rank
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def smem(*shape):
        return plgpu.SMEM(shape, jnp.bfloat16, transforms=swizzled)

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

    return run_tiles(
        kernel,
        (smem(TILE_ROWS, half), smem(TILE_ROWS, half),
         union(smem(TILE_ROWS, rope), smem(TILE_ROWS, block_kv)),
         smem(TILE_ROWS, block_kv),
         union(ring, output),
         rows_f32, rows_f32),
        (plgpu.Barrier(num_arrivals=3),
         plgpu.Barrier(num_arrivals=copies, num_barriers=2),
         plgpu.Barrier(num_arrivals=copies, num_barriers=2),
         plgpu.Barrier(num_arrivals=2),
         plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier(), plgpu.Barrier()),
        (tile_seq, tile_pos0, tile_ntok, block_tables, q_tiles, latent),
        num_splits=num_splits, rank=rank, num_threads=2, interpret=interpret)
