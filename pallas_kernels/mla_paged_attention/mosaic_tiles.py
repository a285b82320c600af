"""The Mosaic-GPU MLA kernel's query tiles: a ragged batch cut into 64-row tiles and back.

A work item is <= block_q query tokens of one sequence (as for the Triton kernel); its tile
holds those tokens x block_h heads, row r = token r // block_h, head r % block_h, padded to
64 rows (H=16 decode: 16 live rows), or with `compact` to a multiple of 8. Tiles are items x
head groups (H / block_h), item-major.
Everything is jnp on device (per-step lengths never recompile), and both directions are
gathers: the queries into tiles, the tile outputs back to [T, H, R]. Uniform batches
(decode and verify steps) skip both: the kernel reads their queries and writes their outputs
token-major, in place (`kernel_mgpu.tile_views`).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels._hopper import aligned_copy
from pallas_kernels.mla_paged_attention.kernel_mgpu import TILE_ROWS, mla_tiles_mgpu
from pallas_kernels.mla_paged_attention.kernel_seesaw import mla_tiles_seesaw
from pallas_kernels.mla_paged_attention.work_items import item_ends, max_items
from pallas_kernels.paged_reference import ragged_token_rows


def _items(cu_q_lens, kv_lens, num_seqs, block_q, num_items):
    """Per work item: (seq, first token, tokens, KV position of its first token), [num_items]
    each; items past the live ones have 0 tokens. Also item_starts [S] (first item of each
    sequence)."""
    s = kv_lens.shape[0]
    q_lens, ends = item_ends(cu_q_lens, num_seqs, block_q)
    item_starts = ends - (q_lens + block_q - 1) // block_q
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right", method="compare_all"),
                      s - 1).astype(jnp.int32)
    j0 = (w - item_starts[seq]) * block_q
    ntok = jnp.where(w < ends[-1], jnp.clip(q_lens[seq] - j0, 0, block_q), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + j0
    return seq, cu_q_lens[seq] + j0, ntok.astype(jnp.int32), pos0.astype(jnp.int32), item_starts


def uniform_tile_args(kv_lens, num_seqs, block_q, groups):
    """(tile_seq, tile_pos0, tile_ntok) [S * groups] of a uniform batch's tiles (every
    sequence block_q tokens), item-major; sequences past num_seqs get 0 tokens."""
    seq = jnp.arange(kv_lens.shape[0], dtype=jnp.int32)
    ntok = jnp.where(seq < num_seqs, block_q, 0).astype(jnp.int32)
    return tuple(jnp.repeat(x, groups) for x in (seq, kv_lens - block_q, ntok))


def uniform_tiles(q, kv_lens, num_seqs, block_q, block_h):
    """A uniform batch (every sequence block_q tokens, T = S * block_q: decode and verify
    steps) as the kernel's tiles, by reshape: (q_tiles [S * groups, block_q * block_h, W],
    tile_seq, tile_pos0, tile_ntok [S * groups]), item-major; sequences past num_seqs get
    0 tokens. (A transpose when block_q > 1 and H > block_h: `mla_mosaic` passes such
    batches token-major instead.)"""
    s, width = kv_lens.shape[0], q.shape[2]
    groups = q.shape[1] // block_h
    q_tiles = q.reshape(s, block_q, groups, block_h, width).transpose(0, 2, 1, 3, 4)
    return (q_tiles.reshape(s * groups, block_q * block_h, width),
            *uniform_tile_args(kv_lens, num_seqs, block_q, groups))


def mla_mosaic(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs, *, rank, sm_scale,
               block_q, block_h, block_kv, num_splits, num_stages, share_logits, interpret,
               compact=False, uniform_q_len=None, seesaw=False):
    """[T, H, W] queries -> [T, H, R] through `mla_tiles_mgpu` (arguments as for
    `mla_paged_attention`; jit by the caller).

    compact: tiles hold only their live rows (block_q * block_h, rounded up to 8) in HBM, not
    64, and rows that see no key come out of the kernel as zeros. With uniform_q_len ==
    block_q as well (every sequence has exactly that many tokens, T = S * block_q: decode and
    verify steps), no gathers: the kernel reads q and writes the output in place,
    token-major, where a tile takes its heads in multiples of 8 (block_h); otherwise the
    tiles are a reshape of q (a transpose when H > block_h) and the outputs one back.
    seesaw: the tiles run through `mla_tiles_seesaw` (FlashMLA's schedule) instead.
    """
    t, h, width = q.shape
    s = block_tables.shape[0]
    groups = h // block_h
    live = block_q * block_h
    rows = -(-live // 8) * 8 if compact else TILE_ROWS
    tables = aligned_copy(block_tables)
    if seesaw:
        kernel = functools.partial(
            mla_tiles_seesaw, rank=rank, block_h=block_h, sm_scale=sm_scale,
            block_kv=block_kv, num_splits=num_splits, zero_masked=compact, interpret=interpret)
    else:
        kernel = functools.partial(
            mla_tiles_mgpu, rank=rank, block_h=block_h, sm_scale=sm_scale, block_kv=block_kv,
            num_splits=num_splits, num_stages=num_stages, share_logits=share_logits,
            zero_masked=compact, interpret=interpret)
    uniform = compact and uniform_q_len == block_q and rows == live and t == s * block_q
    if uniform and block_h % 8 == 0:
        # Token-major: the kernel reads q [S, block_q, H, W] and writes out [splits, S,
        # block_q, H, R] in place (free reshapes of [T, H, .]), no transposes around it.
        out, lse = kernel(q.reshape(s, block_q, h, width), latent, tables,
                          *uniform_tile_args(kv_lens, num_seqs, block_q, groups))
        if num_splits > 1:    # lse [S * groups, splits, rows] -> [splits, S, block_q, H]
            lse = lse.reshape(s, groups, num_splits, block_q, block_h).transpose(2, 0, 3, 1, 4)
            out = _merge_splits(out.reshape(num_splits, t, h, rank),
                                lse.reshape(num_splits, t, h), axis=0)
        return out.reshape(t, h, rank).astype(q.dtype)
    if uniform:
        q_tiles, *tile_args = uniform_tiles(q, kv_lens, num_seqs, block_q, block_h)
        out, lse = kernel(q_tiles, latent, tables, *tile_args)
        merged = _merge_splits(out, lse).reshape(s, groups, block_q, block_h, rank)
        return merged.transpose(0, 2, 1, 3, 4).reshape(t, h, rank).astype(q.dtype)

    num_items = max_items(t, s, block_q)
    seq, tok0, ntok, pos0, item_starts = _items(cu_q_lens, kv_lens, num_seqs, block_q,
                                                num_items)
    # Query rows of every tile: [items, groups, rows] indices into q viewed as [T * H, W].
    r = jnp.arange(rows, dtype=jnp.int32)
    tok = jnp.minimum(tok0[:, None, None] + r // block_h, t - 1)
    head = jnp.arange(groups, dtype=jnp.int32)[None, :, None] * block_h + r % block_h
    q_tiles = q.reshape(t * h, width)[(tok * h + head).reshape(-1)].reshape(
        num_items * groups, rows, width)
    out, lse = kernel(q_tiles, latent, tables,
                      *(jnp.repeat(x, groups) for x in (seq, pos0, ntok)))
    merged = _merge_splits(out, lse)                                     # [n, rows, R]
    # Back to tokens: token i of sequence sq, j = i - cu_q_lens[sq] -> item, row.
    tok_seq, pos = ragged_token_rows(cu_q_lens, kv_lens, num_seqs, t)
    j = jnp.arange(t, dtype=jnp.int32) - cu_q_lens[tok_seq]
    item = jnp.clip(item_starts[tok_seq] + j // block_q, 0, num_items - 1)
    heads = jnp.arange(h, dtype=jnp.int32)
    tile = item[:, None] * groups + heads[None] // block_h               # [T, H]
    row = (j % block_q)[:, None] * block_h + heads[None] % block_h
    flat = merged.reshape(-1, rank)[(tile * rows + row).reshape(-1)].reshape(t, h, rank)
    return jnp.where((pos >= 0)[:, None, None], flat, 0).astype(q.dtype)


def _merge_splits(out, lse, axis=1):
    """Per-split outputs [..., NS (at `axis`), ..., R] and log2-sum-exps (the same without R)
    -> the outputs merged over the splits."""
    if out.shape[axis] == 1:
        return jnp.squeeze(out, axis)
    m = jnp.max(lse, axis=axis, keepdims=True)
    wgt = jnp.exp2(lse - m)
    return jnp.sum(out.astype(jnp.float32) * wgt[..., None], axis=axis) / jnp.sum(
        wgt, axis=axis)[..., None]
