"""Paged KV cache pytree and the ragged batch metadata that addresses it.

One block table per request serves the target layers and every MTP module: module KV lives in
its own arrays but on the same pages, at the same positions, as the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.config import ModelConfig


@struct.dataclass
class KVCache:
    """Per-layer page arrays (a tuple, not one stacked array, so a kernel gets a layer's pages
    without a copy and KV writes update each buffer in place under donation)."""

    target_k: tuple[jax.Array, ...]   # L x [KVH, P, S, hd]   P pages of S tokens
    target_v: tuple[jax.Array, ...]   # L x [KVH, P, S, hd]
    mtp_k: tuple[jax.Array, ...]      # D x [KVH, P, S, hd]   one attention layer per MTP module
    mtp_v: tuple[jax.Array, ...]      # D x [KVH, P, S, hd]

    @property
    def num_pages(self) -> int:
        return self.target_k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.target_k[0].shape[2]


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages and page_size must be > 0, got {num_pages}, {page_size}")
    shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    zeros = lambda n: tuple(jnp.zeros(shape, dtype) for _ in range(n))
    return KVCache(zeros(cfg.num_layers), zeros(cfg.num_layers),
                   zeros(cfg.num_mtp_layers), zeros(cfg.num_mtp_layers))


@struct.dataclass
class PagedBatch:
    """Ragged batch of N query tokens from S requests (padded to buckets).

    Request s owns tokens cu_q_lens[s]:cu_q_lens[s+1]; after this batch's KV is written its KV
    length is kv_lens[s], and its token j sits at position kv_lens[s] - q_len_s + j. Padding tokens
    have position -1 and seq_id 0: they write no KV and their outputs are garbage.
    """

    positions: jax.Array      # int32[N]   position of each token, -1 for padding
    seq_ids: jax.Array        # int32[N]   request index of each token
    block_tables: jax.Array   # int32[S, M] page ids per request
    kv_lens: jax.Array        # int32[S]   KV length after this batch's writes
    cu_q_lens: jax.Array      # int32[S+1] cumulative query lengths
    # Static: every request has exactly q_len tokens, contiguous, aligned to the end of its KV
    # (decode/verify). Lets attention take the batched [S, q_len] path. None for ragged batches.
    q_len: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def uniform(cls, positions: jax.Array, block_tables: jax.Array) -> "PagedBatch":
        """Batch of S requests with T contiguous tokens each, ending at each request's KV length.

        positions int32[S, T]; -1 marks padding, which may only precede a request's tokens (left
        padding), so the last column holds each request's last position (-1: nothing, kv_len 0).
        """
        S, T = positions.shape
        return cls(
            positions=positions.reshape(-1).astype(jnp.int32),
            seq_ids=jnp.repeat(jnp.arange(S, dtype=jnp.int32), T),
            block_tables=block_tables.astype(jnp.int32),
            kv_lens=(positions[:, -1] + 1).astype(jnp.int32),
            cu_q_lens=jnp.arange(S + 1, dtype=jnp.int32) * T,
            q_len=T,
        )


def slot_indices(batch: PagedBatch, page_size: int, num_pages: int):
    """(page, offset) of each token's KV slot; padding tokens get page `num_pages` (dropped)."""
    pos = jnp.maximum(batch.positions, 0)
    page = batch.block_tables[batch.seq_ids, pos // page_size]
    page = jnp.where(batch.positions >= 0, page, num_pages)
    return page, pos % page_size


def write_kv(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
             page: jax.Array, offset: jax.Array):
    """Scatter k/v [N, KVH, hd] into one layer's pages [KVH, P, S, hd]; out-of-range pages drop."""
    k_pages = k_pages.at[:, page, offset].set(jnp.swapaxes(k, 0, 1).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, page, offset].set(jnp.swapaxes(v, 0, 1).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages
