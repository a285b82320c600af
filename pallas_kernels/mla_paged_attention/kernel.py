"""The Pallas (Triton backend) kernel of MLA paged attention, absorbed form.

Work: for every work item w (a block of <= block_q query tokens of ONE sequence), every block of
block_h query heads and every KV split n, one program computes

    rows = block_q tokens x block_h heads          (row r: token r // block_h, head r % block_h)
    s    = q_nope . c_kv^T + q_rope . k_rope^T     (latent [.., R + dr] = [c_kv | k_rope])
    o    = softmax(s * sm_scale, causal) . c_kv    (the values are the first R latent entries)

over the sequence's latent pages, in blocks of `block_k` tokens, with an online softmax.
Folding a verify row's K+1 query tokens into the head dimension of one tile (FlashMLA's
trick) makes every latent block read once for all of them: decode (q_len 1) and verify
(q_len K+1) move the same bytes. The value tile IS the first R columns of the key tile, so
each latent element is loaded once per program.

Triton tiles must have power-of-2 shapes: the 576-wide latent is read as two tiles,
c_kv [block_k, R] and k_rope [block_k, dr] (R, dr powers of 2), and so is q.

Layouts:
    q            [T, H, R + dr]   tokens of all sequences flattened
    latent       [P, S, R + dr]   the paged latent cache
    block_tables [num_seqs, M_pad] int32 (M_pad covers every split's blocks)
    kv_lens      [num_seqs] int32, KV length incl. the sequence's query tokens
    seq_qlen     [num_seqs] int32, query tokens of the sequence (0 for padding sequences)
    cu_q_lens    [num_seqs + 1] int32
    item_ends    [num_seqs_p] int32 cumulative work items per sequence (INT32_MAX padded)
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)


def _kernel(
    item_ends_ref,  # [num_seqs_p]
    cu_q_lens_ref,  # [num_seqs + 1]
    seq_qlen_ref,   # [num_seqs]
    kv_lens_ref,    # [num_seqs]
    bt_ref,         # [num_seqs, M_pad]
    q_ref,          # [T, H, R + dr]
    lat_ref,        # [P, S, R + dr]
    *refs,          # (aliased initial output,) outputs
    block_q: int,
    block_h: int,
    rank: int,
    block_k: int,
    tokens_per_split: int,
    num_splits: int,
    sm_scale: float,
    exact_f32: bool,
    value_split: int = 1,
    qk_chunk: int | None = None,
    keys_first: bool = False,
):
    n_out = 1 if num_splits == 1 else 2
    out_refs = refs[-n_out:]
    # grid dim 0: head block x value part (the value part fastest, so the programs that read
    # the same latent blocks for the two halves of the output columns run side by side)
    hb = lax.div(pl.program_id(0), jnp.int32(value_split))
    rv = rank // value_split                                  # output columns per program
    v0 = lax.rem(pl.program_id(0), jnp.int32(value_split)) * rv
    qk_chunk = qk_chunk or rank
    # value_split == 1 and no QK chunking: q and each latent block are loaded once and the
    # block serves both dots; otherwise the latent block is loaded in pieces (QK chunks, then
    # this program's value columns: L1/L2 hits) so fewer registers stay live
    whole = value_split == 1 and qk_chunk == rank
    split = pl.program_id(1)
    w = pl.program_id(2)

    rope = q_ref.shape[2] - rank
    page_size = lat_ref.shape[1]
    rows = block_q * block_h
    h0 = hb * block_h

    # Work item w -> its sequence (searchsorted on the cumulative item counts) and its block
    # of <= block_q query tokens inside that sequence.
    num_seqs = seq_qlen_ref.shape[0]
    seq = jnp.sum((item_ends_ref[...] <= w).astype(jnp.int32))
    valid = seq < num_seqs
    seq = jnp.where(valid, seq, 0)
    first_item = jnp.where(seq > 0, item_ends_ref[jnp.maximum(seq - 1, 0)], 0)
    off = (w - first_item) * block_q
    start = cu_q_lens_ref[seq] + off
    q_len = seq_qlen_ref[seq]
    n_tok = jnp.where(valid, jnp.clip(q_len - off, 0, block_q), 0)
    kv_len = kv_lens_ref[seq]

    r_tok = lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(block_h))
    r_pos = kv_len - q_len + off + r_tok                      # [rows] position of row's token
    r_valid = (r_tok < n_tok) & (r_pos >= 0)
    # KV positions visible to some row of the item: [0, kv_hi).
    kv_hi = jnp.clip(jnp.where(n_tok > 0, kv_len - q_len + off + n_tok, 0), 0, kv_len)
    # ... and to every row: [0, full_end).
    full_end = jnp.maximum(kv_len - q_len + off + 1, 0)

    tok_valid = jnp.arange(block_q, dtype=jnp.int32) < n_tok  # [block_q]
    # One indexer per load (the CPU interpreter pads a ref read past its end only then).
    def load_q(first, width):
        mask = jnp.broadcast_to(tok_valid[:, None, None], (block_q, block_h, width))
        return plgpu.load(q_ref.at[pl.ds(start, block_q), pl.ds(h0, block_h),
                                   pl.ds(first, width)], mask=mask, other=0.0)

    q_rope = load_q(rank, rope).reshape(rows, rope)
    q_nope = load_q(0, rank).reshape(rows, rank) if whole else None

    # A block of block_k tokens spans ppb pages of spb slots each (block_k >= S: whole pages;
    # block_k < S: part of one page).
    spb = min(page_size, block_k)
    ppb = block_k // spb
    lo = split * tokens_per_split
    hi = jnp.minimum(lo + tokens_per_split, kv_hi)
    n_blocks = pl.cdiv(jnp.maximum(hi - lo, 0), block_k)
    n_full = jnp.clip(lax.div(full_end - lo, block_k), 0, n_blocks)
    n_full = jnp.where(full_end >= lo, n_full, 0)

    scale = sm_scale * LOG2E
    precision = lax.Precision.HIGHEST if exact_f32 else None

    def tile_index(base, width, first_dim):
        shape = (ppb, spb, width)
        pages = bt_ref[seq, pl.ds(lax.div(base, page_size), ppb)]          # [ppb]
        page_idx = jnp.broadcast_to(pages[:, None, None], shape)
        slot_idx = lax.broadcasted_iota(jnp.int32, shape, 1) + lax.rem(base, page_size)
        dim_idx = lax.broadcasted_iota(jnp.int32, shape, 2) + first_dim
        return page_idx, slot_idx, dim_idx

    blk_tok = (lax.broadcasted_iota(jnp.int32, (ppb, spb), 0) * spb
               + lax.broadcasted_iota(jnp.int32, (ppb, spb), 1))

    def body(i, carry, masked):
        acc, m_prev, l_prev = carry
        base = lo + i * block_k
        ok = (base + blk_tok < kv_hi) if masked else None                  # [ppb, spb]

        def latent(width, first):
            """Latent columns [first, first + width) of this block: [block_k, width]."""
            if keys_first and ppb == 1:
                # one page: a 2-D load, no reshape, so the tile can stay in shared memory as
                # wgmma's operand A (a reshape makes Triton route it through registers)
                mask = None if ok is None else jnp.broadcast_to(ok[0][:, None], (block_k, width))
                page = bt_ref[seq, lax.div(base, page_size)]
                return plgpu.load(lat_ref.at[page, pl.ds(lax.rem(base, page_size), block_k),
                                             pl.ds(first, width)],
                                  mask=mask, other=None if ok is None else 0.0)
            mask = None if ok is None else jnp.broadcast_to(ok[:, :, None], (ppb, spb, width))
            return plgpu.load(lat_ref.at[tile_index(base, width, first)], mask=mask,
                              other=None if ok is None else 0.0).reshape(block_k, width)

        if keys_first:
            return _keys_first_step(carry, latent(rank, 0), latent(rope, rank), q_nope, q_rope,
                                    base, masked, r_pos, r_valid, scale, precision)
        if whole:
            c_kv = latent(rank, 0)
            k_rope = latent(rope, rank)
            s = plgpu.dot(q_nope, c_kv, trans_b=True, precision=precision).astype(jnp.float32)
            values = c_kv
        else:
            k_rope = latent(rope, rank)
            s = jnp.zeros((rows, block_k), jnp.float32)
            for c in range(0, rank, qk_chunk):
                q_c = load_q(c, qk_chunk).reshape(rows, qk_chunk)
                s += plgpu.dot(q_c, latent(qk_chunk, c), trans_b=True,
                               precision=precision).astype(jnp.float32)
            values = latent(rv, v0)
        s += plgpu.dot(q_rope, k_rope, trans_b=True, precision=precision).astype(jnp.float32)
        s = s * scale                                                     # log2 domain
        if masked:
            kv_pos = base + jnp.arange(block_k, dtype=jnp.int32)
            mask = (kv_pos[None, :] <= r_pos[:, None]) & r_valid[:, None]
            s = jnp.where(mask, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        pv = plgpu.dot(p.astype(values.dtype), values, precision=precision).astype(jnp.float32)
        return acc * alpha[:, None] + pv, m_next, l_next

    carry = (jnp.zeros((rows, rv), jnp.float32),
             jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.float32))
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)

    nonempty = l_i > 0.0
    inv_l = jnp.where(nonempty, 1.0 / jnp.where(nonempty, l_i, 1.0), 0.0)
    out = (acc * inv_l[:, None]).reshape(block_q, block_h, rv)
    out_mask = jnp.broadcast_to(tok_valid[:, None, None], (block_q, block_h, rv))
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[pl.ds(start, block_q), pl.ds(h0, block_h), pl.ds(v0, rv)],
                    out.astype(o_ref.dtype), mask=out_mask)
    else:
        o_ref, lse_ref = out_refs
        # log2-domain log-sum-exp of this split's logits; -inf when it saw nothing.
        lse = jnp.where(nonempty, m_i + jnp.log2(jnp.where(nonempty, l_i, 1.0)), -jnp.inf)
        plgpu.store(o_ref.at[split, pl.ds(start, block_q), pl.ds(h0, block_h), pl.ds(v0, rv)],
                    out, mask=out_mask)
        plgpu.store(lse_ref.at[split, pl.ds(start, block_q), pl.ds(h0, block_h)],
                    lse.reshape(block_q, block_h),
                    mask=jnp.broadcast_to(tok_valid[:, None], (block_q, block_h)))


def _keys_first_step(carry, c_kv, k_rope, q_nope, q_rope, base, masked, r_pos, r_valid, scale,
                     precision):
    """One KV block with the logits computed transposed, s^T = latent . q^T [block_k, rows].

    Why: in the [rows, R] x [R, block_k] form Triton (3.x, MMAv3) feeds the query to wgmma as
    the *register* operand A: 64 x 512 bf16 is 128 registers per thread at 8 warps, on top of
    the 128 of the [64, 512] float32 value accumulator, so the H=128 tile spills (255
    registers, 1.2-1.3 KB per thread; Nsight Compute: 55 MB of DRAM writes for an 8 MB
    output). Transposed, the query is operand B, which wgmma reads from shared memory, and the
    latent block (already in shared memory from the pipelined load) is operand A. The
    probabilities are transposed back (a [block_k, rows] tile) for the value dot."""
    acc, m_prev, l_prev = carry
    block_k = c_kv.shape[0]
    s = plgpu.dot(c_kv, q_nope, trans_b=True, precision=precision).astype(jnp.float32)
    s += plgpu.dot(k_rope, q_rope, trans_b=True, precision=precision).astype(jnp.float32)
    s = s * scale                                                         # [block_k, rows]
    if masked:
        kv_pos = base + jnp.arange(block_k, dtype=jnp.int32)
        mask = (kv_pos[:, None] <= r_pos[None, :]) & r_valid[None, :]
        s = jnp.where(mask, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=0))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
    alpha = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[None, :])
    l_next = l_prev * alpha + jnp.sum(p, axis=0)
    pv = plgpu.dot(p.astype(c_kv.dtype), c_kv, trans_a=True,
                   precision=precision).astype(jnp.float32)              # [rows, R]
    return acc * alpha[:, None] + pv, m_next, l_next


def mla_core(
    q,             # [T, H, R + dr]
    latent,        # [P, S, R + dr]
    block_tables,  # [num_seqs, M] int32
    kv_lens,       # [num_seqs] int32
    seq_qlen,      # [num_seqs] int32 (0 for padding sequences)
    cu_q_lens,     # [num_seqs + 1] int32
    item_ends,     # [num_seqs] int32 cumulative work items per sequence
    num_items: int,  # static grid size, >= item_ends[-1]
    *,
    rank: int,
    block_q: int,
    block_h: int,
    block_k: int,
    num_splits: int,
    sm_scale: float,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    value_split: int = 1,
    qk_chunk: int | None = None,
    keys_first: bool = False,
):
    """Runs the kernel over the work list -> (out [T, H, R] in q's dtype, covered [T] bool for
    num_splits > 1 (None otherwise)).

    num_splits == 1: the output starts as zeros (aliased input), so tokens no item covers read
    0. num_splits > 1: each split writes an f32 partial output and its log2-sum-exp, merged by a
    jnp epilogue; the partial buffers are not initialized and the caller masks uncovered tokens.
    """
    t, h, dk = q.shape
    num_seqs, m = block_tables.shape
    page_size = latent.shape[1]
    s_p = pl.next_power_of_2(num_seqs)
    item_ends = jnp.full((s_p,), jnp.iinfo(jnp.int32).max, jnp.int32).at[:num_seqs].set(
        item_ends.astype(jnp.int32))
    blocks = pl.cdiv(m * page_size, block_k)
    tokens_per_split = pl.cdiv(blocks, num_splits) * block_k
    m_pad = pl.cdiv(tokens_per_split * num_splits, page_size)
    if m_pad > m:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, m_pad - m)))
    kernel = functools.partial(
        _kernel, block_q=block_q, block_h=block_h, rank=rank, block_k=block_k,
        tokens_per_split=tokens_per_split, num_splits=num_splits, sm_scale=float(sm_scale),
        exact_f32=q.dtype == jnp.float32, value_split=value_split, qk_chunk=qk_chunk,
        keys_first=keys_first)

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    args = [item_ends, cu_q_lens, seq_qlen, kv_lens, block_tables, q, latent]
    in_specs = [full(a.shape) for a in args]
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((t, h, rank), q.dtype)]
        inits = [jnp.zeros((t, h, rank), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, t, h, rank), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, t, h), jnp.float32)]
        inits = []
    outs = pl.pallas_call(
        kernel,
        grid=(h // block_h * value_split, num_splits, num_items),
        in_specs=in_specs + [full(s.shape) for s in out_shape[:len(inits)]],
        out_specs=[full(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases={len(args) + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"mla_paged_attn_bq{block_q}_bh{block_h}_bk{block_k}_ns{num_splits}"
             + (f"_vs{value_split}" if value_split > 1 else "")
             + (f"_qc{qk_chunk}" if qk_chunk and qk_chunk != rank else "")
             + ("_kf" if keys_first else ""),
    )(*args, *inits)
    if num_splits == 1:
        return outs[0]
    o, lse = outs                                         # [NS, T, H, R], [NS, T, H]
    m_max = jnp.max(lse, axis=0)
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    wgt = jnp.exp2(lse - m_safe[None])                    # 0 for empty splits
    den = jnp.sum(wgt, axis=0)
    num = jnp.sum(o * wgt[..., None], axis=0)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    # Partial buffers are uninitialized: tokens no item covered (padding) read 0.
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], tok, side="right", method="compare_all")
    covered = (seq < num_seqs) & (seq_qlen[jnp.minimum(seq, num_seqs - 1)] > 0)
    return jnp.where(covered[:, None, None], out, 0.0).astype(q.dtype)
