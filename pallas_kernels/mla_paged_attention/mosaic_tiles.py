"""The Mosaic-GPU MLA kernel's query tiles: a ragged batch cut into 64-row tiles and back.

A work item is <= block_q query tokens of one sequence (as for the Triton kernel); its tile
holds those tokens x block_h heads, row r = token r // block_h, head r % block_h, padded to
64 rows (H=16 decode: 16 live rows). Tiles are items x head groups (H / block_h), item-major.
Everything is jnp on device (per-step lengths never recompile), and both directions are
gathers: the queries into tiles, the tile outputs back to [T, H, R].
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mla_paged_attention.kernel_mgpu import TILE_ROWS, mla_tiles_mgpu
from pallas_kernels.paged_reference import ragged_token_rows


def _items(cu_q_lens, kv_lens, num_seqs, block_q, num_items):
    """Per work item: (seq, first token, tokens, KV position of its first token), [num_items]
    each; items past the live ones have 0 tokens. Also item_starts [S] (first item of each
    sequence)."""
    s = kv_lens.shape[0]
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    item_ends = jnp.cumsum((q_lens + block_q - 1) // block_q).astype(jnp.int32)
    item_starts = item_ends - (q_lens + block_q - 1) // block_q
    w = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(item_ends, w, side="right", method="compare_all"),
                      s - 1).astype(jnp.int32)
    j0 = (w - item_starts[seq]) * block_q
    ntok = jnp.where(w < item_ends[-1], jnp.clip(q_lens[seq] - j0, 0, block_q), 0)
    pos0 = kv_lens[seq] - q_lens[seq] + j0
    return seq, cu_q_lens[seq] + j0, ntok.astype(jnp.int32), pos0.astype(jnp.int32), item_starts


def mla_mosaic(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs, *, rank, sm_scale,
               block_q, block_h, block_kv, num_splits, num_stages, share_logits, interpret):
    """[T, H, W] queries -> [T, H, R] through `mla_tiles_mgpu` (arguments as for
    `mla_paged_attention`; jit by the caller)."""
    t, h, width = q.shape
    s = block_tables.shape[0]
    groups = h // block_h
    num_items = max(1, min(t, (t + s * (block_q - 1)) // block_q))
    seq, tok0, ntok, pos0, item_starts = _items(cu_q_lens, kv_lens, num_seqs, block_q,
                                                num_items)
    # Query rows of every tile: [items, groups, 64] indices into q viewed as [T * H, W].
    r = jnp.arange(TILE_ROWS, dtype=jnp.int32)
    tok = jnp.minimum(tok0[:, None, None] + r // block_h, t - 1)
    head = jnp.arange(groups, dtype=jnp.int32)[None, :, None] * block_h + r % block_h
    rows = (tok * h + head).reshape(-1)
    q_tiles = q.reshape(t * h, width)[rows].reshape(num_items * groups, TILE_ROWS, width)

    def per_tile(x):
        return jnp.repeat(x, groups)

    # Mosaic-GPU kernels take only 256-byte aligned buffers. Inside a larger program XLA
    # may hand a slice of the engine's tables over as an offset pointer (an unaligned one
    # failed at batch 32); a padded copy is a buffer of its own.
    tables = jnp.pad(block_tables, ((0, 1), (0, 0)))
    out, lse = mla_tiles_mgpu(q_tiles, latent, tables, per_tile(seq), per_tile(pos0),
                              per_tile(ntok), rank=rank, block_h=block_h, sm_scale=sm_scale,
                              block_kv=block_kv, num_splits=num_splits,
                              num_stages=num_stages, share_logits=share_logits,
                              interpret=interpret)
    if num_splits == 1:
        merged = out[:, 0]
    else:                                       # [n, NS, 64, R], [n, NS, 64]
        m = jnp.max(lse, axis=1, keepdims=True)
        wgt = jnp.exp2(lse - m)
        merged = jnp.sum(out.astype(jnp.float32) * wgt[..., None], axis=1) / jnp.sum(
            wgt, axis=1)[..., None]
    # Back to tokens: token i of sequence sq, j = i - cu_q_lens[sq] -> item, row.
    tok_seq, pos = ragged_token_rows(cu_q_lens, kv_lens, num_seqs, t)
    j = jnp.arange(t, dtype=jnp.int32) - cu_q_lens[tok_seq]
    item = jnp.clip(item_starts[tok_seq] + j // block_q, 0, num_items - 1)
    heads = jnp.arange(h, dtype=jnp.int32)
    tile = item[:, None] * groups + heads[None] // block_h               # [T, H]
    row = (j % block_q)[:, None] * block_h + heads[None] % block_h
    flat = merged.reshape(-1, rank)[(tile * TILE_ROWS + row).reshape(-1)].reshape(t, h, rank)
    return jnp.where((pos >= 0)[:, None, None], flat, 0).astype(q.dtype)
