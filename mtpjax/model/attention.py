"""Plain-jnp attention: dense causal (no cache) and paged attention over any page kind.

`paged_attention_reference` adapts a model batch to the one jnp paged attention in
`pallas_kernels.paged_reference` (what CPU runs and what every kernel is tested against); the
choice between it and the Pallas kernels is the run's `AttentionBackend` (model/backend.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from mtpjax.cache import PagedBatch
from pallas_kernels.paged_reference import paged_attention_rows, paged_attention_tokens


def _grouped_scores(q, k, scale):
    """q [..., Tq, KV, G, hd], k [..., Tk, KV, hd] -> scores [..., KV, G, Tq, Tk] in f32."""
    return jnp.einsum("...qkgd,...tkd->...kgqt", q.astype(jnp.float32), k.astype(jnp.float32)) * scale


def _softmax_mix(scores, mask, v, out_dtype):
    """Masked softmax over the last axis and mix of v [..., Tk, KV, hd]; fully masked rows -> 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    p = jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.where(mask, p, 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("...kgqt,...tkd->...qkgd", p, v.astype(jnp.float32))
    return o.astype(out_dtype)


def _soft_cap(scores, soft_cap):
    return scores if soft_cap is None else soft_cap * jnp.tanh(scores / soft_cap)


def dense_causal_attention(q, k, v, *, sm_scale=None, soft_cap=None):
    """q [B, T, NH, hd], k [B, T, KV, hd], v [B, T, KV, hd_v] -> [B, T, NH, hd_v], causal."""
    B, T, NH, hd = q.shape
    KV = k.shape[2]
    scale = hd ** -0.5 if sm_scale is None else sm_scale
    qg = q.reshape(B, T, KV, NH // KV, hd)
    s = _soft_cap(_grouped_scores(qg, k, scale), soft_cap)
    mask = jnp.tril(jnp.ones((T, T), bool))
    return _softmax_mix(s, mask, v, q.dtype).reshape(B, T, NH, v.shape[-1])


def paged_attention_reference(q, k_pages, v_pages, batch: PagedBatch, *, sm_scale=None,
                              soft_cap=None):
    """q [N, NH, hd] ragged tokens; k_pages [KVH, P, S, hd], v_pages [KVH, P, S, hd_v]
    -> [N, NH, hd_v]: the one plain-jnp paged attention (`pallas_kernels.paged_reference`) for a
    model batch. GQA pages and MLA latent pages (one shared head, values a prefix of the keys)
    both come here, through their attention routes (`model/attention_routes.py`).

    Token n of request s at position p attends to KV positions t <= p with t < kv_lens[s].
    Keys and values past the mask are zeroed before use, so NaN in unused pages never leaks.
    Uniform batches (`batch.q_len`) gather each request's pages once, ragged ones per token.
    """
    N, NH, _ = q.shape
    kw = dict(sm_scale=sm_scale, soft_cap=soft_cap)
    if batch.q_len is not None:
        R, T = batch.block_tables.shape[0], batch.q_len
        out = paged_attention_rows(q.reshape(R, T, NH, -1), k_pages, v_pages,
                                   batch.block_tables, batch.kv_lens,
                                   batch.positions.reshape(R, T), **kw)
        return out.reshape(N, NH, v_pages.shape[-1])
    return paged_attention_tokens(q, k_pages, v_pages, batch.block_tables, batch.kv_lens,
                                  batch.seq_ids, batch.positions, **kw)
