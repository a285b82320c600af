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
    """The paged cache: one page pytree per attention layer, of that layer's cache kind
    (`GQAPages` for "gqa"). Target layers and MTP modules share the block tables and slots."""

    target: tuple            # L x pages of the target layer's attention kind
    mtp: tuple               # D x pages, one attention layer per MTP module

    @property
    def num_pages(self) -> int:
        return self.target[0].num_pages

    @property
    def page_size(self) -> int:
        return self.target[0].page_size


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> KVCache:
    from mtpjax.model.kinds import attention_kind
    if num_pages <= 0 or page_size <= 0:
        raise ValueError(f"num_pages and page_size must be > 0, got {num_pages}, {page_size}")
    pages = lambda kind: attention_kind(kind).init_pages(cfg, num_pages, page_size, dtype)
    return KVCache(tuple(pages(a) for a, _ in cfg.layer_kinds()),
                   tuple(pages(cfg.mtp_layer_kind()[0]) for _ in range(cfg.num_mtp_layers)))


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

    @property
    def valid(self) -> jax.Array:
        """bool[N]: the token is real (not padding); what an MoE router may route."""
        return self.positions >= 0

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


@struct.dataclass
class PagedContext:
    """What a cached attention layer needs besides its pages: the batch, each token's KV slot
    (from `slot_indices`, computed once per forward) and the backend (static)."""

    batch: PagedBatch
    page: jax.Array            # int32[N] page of each token's slot (num_pages: dropped)
    offset: jax.Array          # int32[N] offset inside the page
    backend: object = struct.field(pytree_node=False)

    @classmethod
    def build(cls, batch: PagedBatch, cache: KVCache, backend) -> "PagedContext":
        page, offset = slot_indices(batch, cache.page_size, cache.num_pages)
        return cls(batch, page, offset, backend)
