"""Plain-jnp attention: dense causal (no cache) and paged attention over GQA pages.

`paged_attention_reference` is what CPU runs and what every kernel is tested against; the
choice between it and the Pallas kernels is the run's `AttentionBackend` (model/backend.py).
"""

from __future__ import annotations

import jax.numpy as jnp

from mtpjax.cache import PagedBatch


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


def _gather_pages(pages, block_tables):
    """pages [KVH, P, S, hd], block_tables [S_req, M] -> [S_req, M*S, KVH, hd]."""
    g = pages[:, block_tables]                      # [KVH, S_req, M, S, hd]
    KVH, R, M, S, hd = g.shape
    return jnp.moveaxis(g.reshape(KVH, R, M * S, hd), 0, 2)


def paged_attention_reference(q, k_pages, v_pages, batch: PagedBatch, *, sm_scale=None,
                              soft_cap=None):
    """q [N, NH, hd] ragged tokens; k_pages [KVH, P, S, hd], v_pages [KVH, P, S, hd_v]
    -> [N, NH, hd_v]. The one plain-jnp paged attention: GQA pages and MLA latent pages (one
    shared head, values a prefix of the keys) both come here (`AttentionBackend`).

    Token n of request s at position p attends to KV positions t <= p with t < kv_lens[s].
    Keys and values past the mask are zeroed before use, so NaN in unused pages never leaks.
    """
    N, NH, hd = q.shape
    KVH = k_pages.shape[0]
    scale = hd ** -0.5 if sm_scale is None else sm_scale
    k_all = _gather_pages(k_pages, batch.block_tables)   # [S_req, C, KVH, hd], C = M*S
    v_all = _gather_pages(v_pages, batch.block_tables)
    C = k_all.shape[1]
    t = jnp.arange(C)
    if batch.q_len is not None:
        T = batch.q_len
        R = batch.block_tables.shape[0]
        pos = batch.positions.reshape(R, T)
        valid_kv = t[None, :] < batch.kv_lens[:, None]                    # [R, C]
        k_all = jnp.where(valid_kv[:, :, None, None], k_all, 0)
        v_all = jnp.where(valid_kv[:, :, None, None], v_all, 0)
        qg = q.reshape(R, T, KVH, NH // KVH, hd)
        s = _soft_cap(_grouped_scores(qg, k_all, scale), soft_cap)       # [R, KV, G, T, C]
        mask = (t[None, None, :] <= pos[:, :, None]) & valid_kv[:, None, :]  # [R, T, C]
        o = _softmax_mix(s, mask[:, None, None], v_all, q.dtype)        # [R, T, KV, G, hd_v]
        return o.reshape(N, NH, v_pages.shape[-1])
    kv_len = batch.kv_lens[batch.seq_ids]                                 # [N]
    valid_kv = t[None, :] < kv_len[:, None]                               # [N, C]
    k_tok = jnp.where(valid_kv[:, :, None, None], k_all[batch.seq_ids], 0)  # [N, C, KVH, hd]
    v_tok = jnp.where(valid_kv[:, :, None, None], v_all[batch.seq_ids], 0)
    qg = q.reshape(N, 1, KVH, NH // KVH, hd)
    s = _soft_cap(_grouped_scores(qg, k_tok, scale), soft_cap)            # [N, KV, G, 1, C]
    mask = (t[None, :] <= batch.positions[:, None]) & valid_kv            # [N, C]
    o = _softmax_mix(s, mask[:, None, None, None, :], v_tok, q.dtype)     # [N, 1, KV, G, hd_v]
    return o.reshape(N, NH, v_pages.shape[-1])
