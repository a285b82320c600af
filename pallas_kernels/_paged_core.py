"""Shared Pallas (Triton backend) kernel for paged attention over work items.

Both public kernels (`paged_attention` for uniform [B, Q] batches and
`ragged_paged_attention` for ragged token batches) reduce to the same work:

    for every work item w (a block of <= block_q query tokens of ONE sequence),
    every KV head h and every KV split n:
        rows = block_q tokens x G query heads of the group of h     (one tile)
        loop over the sequence's pages in chunks of `pages_per_block` pages,
        online softmax, causal mask aligned to the end of the KV.

This module is the only place with backend-specific (Pallas Triton) code for
the attention kernels. The work list (which item covers which tokens) is built
by the callers with plain jnp, on device, so nothing recompiles per step.

Layouts (G = H // KVH query heads per KV head, G_p = G padded to a power of 2):
    q            [T, KVH, G_p, D]   tokens flattened
    k/v pages    [KVH, P, S, D]
    block_tables [num_seqs, M_pad] int32 (M_pad covers every split's pages)
    kv_lens      [num_seqs] int32, KV length incl. the sequence's query tokens
    seq_qlen     [num_seqs] int32 (query tokens of the sequence)
    items        [W] int32 each: seq id, first token, tokens in item (0 = no-op),
                 offset of the first token inside its sequence.
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
    # inputs
    item_ends_ref,  # [num_seqs_p] cumulative items per sequence, padded with INT32_MAX
                    # (+ [2] tail token bounds lo, hi with tail_items)
    cu_q_lens_ref,  # [num_seqs + 1]
    seq_qlen_ref, kv_lens_ref,  # [num_seqs]
    bt_ref,  # [num_seqs, M_pad]
    q_ref,  # [T, KVH, G_p, D]
    k_ref, v_ref,  # [P, S, D] (this KV head)
    # aliased inputs (initial values of the outputs), unused
    *refs,
    block_q: int,
    group: int,
    pages_per_block: int,
    pages_per_split: int,
    num_splits: int,
    sm_scale: float,
    soft_cap: float | None,
    exact_f32: bool,
    direct_items: bool,
    tail_items: bool,
):
    n_out = 1 if num_splits == 1 else 2
    out_refs = refs[-n_out:]
    w = pl.program_id(0)
    h = pl.program_id(1)
    split = pl.program_id(2)

    g_p = q_ref.shape[2]
    head_dim = q_ref.shape[3]
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    rows = block_q * g_p

    # Work item w -> its sequence (searchsorted on the cumulative item counts)
    # and its block of <= block_q query tokens inside that sequence.
    num_seqs = seq_qlen_ref.shape[0]
    if direct_items:
        # One item per sequence (uniform batches): no search, no dependent load.
        seq, valid, off = w, True, 0
    else:
        s_p = item_ends_ref.shape[0] - (2 if tail_items else 0)
        seq = jnp.sum((item_ends_ref[pl.ds(0, s_p)] <= w).astype(jnp.int32))
        valid = seq < num_seqs
        seq = jnp.where(valid, seq, 0)
        first_item = jnp.where(seq > 0, item_ends_ref[jnp.maximum(seq - 1, 0)], 0)
        off = (w - first_item) * block_q
    start = cu_q_lens_ref[seq] + off
    q_len = seq_qlen_ref[seq]
    n_tok = jnp.clip(q_len - off, 0, block_q)
    if not direct_items:
        n_tok = jnp.where(valid, n_tok, 0)
    kv_len = kv_lens_ref[seq]
    if tail_items:
        # Programs past the last item cover the tail tokens [lo, hi) (item_ends_ref
        # carries lo, hi after its s_p entries) in blocks of block_q and store zeros
        # there: no KV (kv_len 0), so the loop below does not run. This replaces
        # zero-initializing the whole output buffer (an extra pass over it).
        t_start = item_ends_ref[s_p] + (w - item_ends_ref[num_seqs - 1]) * block_q
        start = jnp.where(valid, start, t_start)
        n_tok = jnp.where(valid, n_tok, jnp.clip(item_ends_ref[s_p + 1] - t_start, 0, block_q))
        kv_len = jnp.where(valid, kv_len, 0)
        q_len = jnp.where(valid, q_len, 0)

    # Row r of the tile = token (r // G_p) of the item, query head (r % G_p).
    tok = jnp.arange(block_q, dtype=jnp.int32)
    tok_valid = tok < n_tok  # [block_q]
    r_tok = lax.div(jnp.arange(rows, dtype=jnp.int32), jnp.int32(g_p))
    r_head = lax.rem(jnp.arange(rows, dtype=jnp.int32), jnp.int32(g_p))
    r_pos = kv_len - q_len + off + r_tok  # position of the row's token
    r_valid = (r_tok < n_tok) & (r_head < group) & (r_pos >= 0)
    # Visible KV positions of this item: [0, kv_hi).
    kv_hi = jnp.where(n_tok > 0, kv_len - q_len + off + n_tok, 0)
    kv_hi = jnp.clip(kv_hi, 0, kv_len)

    q = plgpu.load(
        q_ref.at[pl.ds(start, block_q), h, :, :],
        mask=jnp.broadcast_to(tok_valid[:, None, None], (block_q, g_p, head_dim)),
        other=0.0,
    ).reshape(rows, head_dim)

    page_lo = split * pages_per_split
    page_hi = jnp.minimum(page_lo + pages_per_split, pl.cdiv(kv_hi, page_size))
    n_blocks = pl.cdiv(jnp.maximum(page_hi - page_lo, 0), pages_per_block)

    scale = sm_scale if soft_cap is not None else sm_scale * LOG2E
    precision = lax.Precision.HIGHEST if exact_f32 else None
    kv_shape = (pages_per_block, page_size, head_dim)
    # KV tiles are gathered with one int index per dim (all broadcast to the tile
    # shape): this form lowers to one pointer tensor on Triton and to a plain
    # gather in the CPU interpreter.
    slot_idx = lax.broadcasted_iota(jnp.int32, kv_shape, 1)
    dim_idx = lax.broadcasted_iota(jnp.int32, kv_shape, 2)
    tok_in_block = lax.broadcasted_iota(jnp.int32, kv_shape, 0) * page_size + slot_idx

    def body(i, carry, masked):
        acc, m_prev, l_prev = carry
        p0 = page_lo + i * pages_per_block
        pages = bt_ref[seq, pl.ds(p0, pages_per_block)]  # [ppb]
        base = p0 * page_size
        page_idx = jnp.broadcast_to(pages[:, None, None], kv_shape)
        kv_at = (page_idx, slot_idx, dim_idx)
        # Interior blocks (every row sees every key) load and compute unmasked;
        # only boundary blocks pay for the load predicates and the causal mask.
        kv_mask3 = (base + tok_in_block < kv_hi) if masked else None
        other = 0.0 if masked else None
        k = plgpu.load(k_ref.at[kv_at], mask=kv_mask3, other=other)
        k = k.reshape(block_k, head_dim)
        s = plgpu.dot(q, k, trans_b=True, precision=precision).astype(jnp.float32)
        s = s * scale
        if soft_cap is not None:
            s = jnp.tanh(s * (1.0 / soft_cap)) * (soft_cap * LOG2E)
        if masked:
            kv_pos = base + jnp.arange(block_k, dtype=jnp.int32)
            mask = (kv_pos[None, :] <= r_pos[:, None]) & r_valid[:, None]
            s = jnp.where(mask, s, -jnp.inf)
        m_curr = jnp.max(s, axis=1)
        m_next = jnp.maximum(m_prev, m_curr)
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next) if masked else m_next
        alpha = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_next = l_prev * alpha + jnp.sum(p, axis=1)
        v = plgpu.load(v_ref.at[kv_at], mask=kv_mask3, other=other)
        v = v.reshape(block_k, head_dim)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision).astype(jnp.float32)
        acc = acc * alpha[:, None] + pv
        return acc, m_next, l_next

    # Keys [0, full_end) are visible to every row of the item.
    full_end = jnp.maximum(kv_len - q_len + off + 1, 0)
    n_full = jnp.clip(lax.div(lax.div(full_end, page_size) - page_lo, pages_per_block),
                      0, n_blocks)
    n_full = jnp.where(lax.div(full_end, page_size) >= page_lo, n_full, 0)
    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m_i = jnp.full((rows,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((rows,), jnp.float32)
    carry = (acc, m_i, l_i)
    carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
    acc, m_i, l_i = lax.fori_loop(n_full, n_blocks, functools.partial(body, masked=True), carry)

    nonempty = l_i > 0.0
    inv_l = jnp.where(nonempty, 1.0 / jnp.where(nonempty, l_i, 1.0), 0.0)
    out = (acc * inv_l[:, None]).reshape(block_q, g_p, head_dim)
    store_mask = jnp.broadcast_to(tok_valid[:, None, None], (block_q, g_p, head_dim))
    if num_splits == 1:
        (o_ref,) = out_refs
        plgpu.store(o_ref.at[pl.ds(start, block_q), h, :, :],
                    out.astype(o_ref.dtype), mask=store_mask)
    else:
        o_ref, lse_ref = out_refs
        # log2-domain log-sum-exp of the split's logits; -inf when it saw nothing.
        lse = jnp.where(nonempty, m_i + jnp.log2(jnp.where(nonempty, l_i, 1.0)),
                        -jnp.inf).reshape(block_q, g_p)
        plgpu.store(o_ref.at[split, pl.ds(start, block_q), h, :, :], out,
                    mask=store_mask)
        plgpu.store(lse_ref.at[split, pl.ds(start, block_q), h, :], lse,
                    mask=jnp.broadcast_to(tok_valid[:, None], (block_q, g_p)))


def pad_group(q, num_kv_heads):
    """[T, H, D] -> [T, KVH, G_p, D], G_p = G rounded up to a power of 2 (Triton tiles)."""
    t, h, d = q.shape
    g = h // num_kv_heads
    g_p = pl.next_power_of_2(g)
    q = q.reshape(t, num_kv_heads, g, d)
    if g_p != g:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, g_p - g), (0, 0)))
    return q


def unpad_group(out, num_heads):
    t, kvh, _, d = out.shape
    return out[:, :, : num_heads // kvh, :].reshape(t, num_heads, d)


def paged_core(
    q,  # [T, KVH, G_p, D] (see pad_group)
    k_pages,  # [KVH, P, S, D]
    v_pages,
    block_tables,  # [num_seqs, M]
    kv_lens,  # [num_seqs]
    seq_qlen,  # [num_seqs] query tokens per sequence (0 for padding sequences)
    cu_q_lens,  # [num_seqs + 1]
    item_ends,  # [num_seqs] cumulative number of work items per sequence
    num_items: int,  # static grid size, >= item_ends[-1]
    *,
    group: int,
    block_q: int,
    pages_per_block: int,
    num_splits: int,
    sm_scale: float,
    soft_cap: float | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    out_init=None,
    direct_items: bool = False,
    tail_bounds=None,
):
    """Runs the kernel over the work list; returns out [T, KVH, G_p, D] (q dtype).

    Tokens no item covers keep `out_init`'s values (zeros if None). With
    num_splits > 1 the splits are merged by a small jnp epilogue (log-sum-exp).

    direct_items: the caller guarantees item w is sequence w, covering all its
    <= block_q tokens (num_items == num_seqs, item_ends == 1..num_seqs). The
    kernel then skips the item search, and since every token is written, the
    output buffer is not initialized (no memset launch; out_init must be None).

    tail_bounds: int32 [2] = (lo, hi): the programs past the last item store zeros
    for tokens [lo, hi) (blocks of block_q; num_items must leave enough of them), and
    the output buffer is not initialized: the caller guarantees that every token is
    covered by an item of this launch, the tail, or a later launch aliasing this
    output (num_splits == 1, out_init None).
    """
    t, kvh, g_p, d = q.shape
    _, num_pages, page_size, _ = k_pages.shape
    num_seqs, m = block_tables.shape
    w = num_items
    s_p = pl.next_power_of_2(num_seqs)
    item_ends = jnp.full((s_p,), jnp.iinfo(jnp.int32).max, jnp.int32).at[:num_seqs].set(
        item_ends.astype(jnp.int32))
    if tail_bounds is not None:
        # In the same small array (one XLA fusion, no extra launch before the kernel).
        item_ends = jnp.concatenate([item_ends, tail_bounds.astype(jnp.int32)])
    # At least 16 rows per tile for the matrix units.
    block_q = pl.next_power_of_2(max(block_q, pl.cdiv(16, g_p)))
    # A tail item's tile may run past T: Triton masks those rows, and the CPU
    # interpreter pads the ref before slicing, so no host-side padding is needed.
    pages_per_block = max(1, min(pages_per_block, pl.next_power_of_2(m)))
    pages_per_split = pl.cdiv(pl.cdiv(m, num_splits), pages_per_block) * pages_per_block
    m_pad = pages_per_split * num_splits
    if m_pad != m:
        block_tables = jnp.pad(block_tables, ((0, 0), (0, m_pad - m)))

    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group=group,
        pages_per_block=pages_per_block,
        pages_per_split=pages_per_split,
        num_splits=num_splits,
        sm_scale=float(sm_scale),
        soft_cap=None if soft_cap is None else float(soft_cap),
        exact_f32=q.dtype == jnp.float32,
        direct_items=direct_items,
        tail_items=tail_bounds is not None,
    )
    if tail_bounds is not None:
        if out_init is not None or num_splits != 1 or direct_items:
            raise ValueError("tail_bounds needs num_splits == 1, no out_init, no direct_items")

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    kv_spec = pl.BlockSpec((None, num_pages, page_size, d),
                           lambda i, h, n: (h, 0, 0, 0))
    in_specs = [full(item_ends.shape), full((num_seqs + 1,))] + [full((num_seqs,))] * 2 + [
        full((num_seqs, m_pad)), full((t, kvh, g_p, d)), kv_spec, kv_spec]
    args = [item_ends, cu_q_lens, seq_qlen, kv_lens,
            block_tables, q, k_pages, v_pages]
    if direct_items and (out_init is not None or w != num_seqs):
        raise ValueError("direct_items needs num_items == num_seqs and no out_init")
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((t, kvh, g_p, d), q.dtype)]
        inits = [jnp.zeros((t, kvh, g_p, d), q.dtype) if out_init is None else out_init]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, t, kvh, g_p, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, t, kvh, g_p), jnp.float32),
        ]
        inits = [jnp.zeros(out_shape[0].shape, jnp.float32),
                 jnp.full(out_shape[1].shape, -jnp.inf, jnp.float32)]
    if direct_items or tail_bounds is not None:
        inits = []  # every (split, token, head) row is stored by some program
    out_specs = [full(s.shape) for s in out_shape]
    n_in = len(args)
    outs = pl.pallas_call(
        kernel,
        grid=(w, kvh, num_splits),
        in_specs=in_specs + out_specs[:len(inits)],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={n_in + i: i for i in range(len(inits))},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                             num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attn_bq{block_q}_ppb{pages_per_block}_ns{num_splits}",
    )(*args, *inits)

    if num_splits == 1:
        return outs[0]
    o, lse = outs  # [NS, T, KVH, G_p, D], [NS, T, KVH, G_p]
    m_max = jnp.max(lse, axis=0)
    m_safe = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    wgt = jnp.exp2(lse - m_safe[None])  # 0 for empty splits
    den = jnp.sum(wgt, axis=0)
    num = jnp.sum(o * wgt[..., None], axis=0)
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    out = out.astype(q.dtype)
    if out_init is not None:
        # Tokens of sequences that have items in this launch take the merged value.
        n_items = jnp.diff(item_ends[:num_seqs], prepend=0)
        tok = jnp.arange(t, dtype=jnp.int32)
        covered = jnp.any((n_items[:, None] > 0) & (tok[None, :] >= cu_q_lens[:-1, None])
                          & (tok[None, :] < cu_q_lens[1:, None]), axis=0)
        out = jnp.where(covered[:, None, None, None], out, out_init)
    return out
