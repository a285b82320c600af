"""The one plain-jnp paged attention: what CPU runs, what the model's `reference` backend calls and
what every paged kernel is tested against (each kernel package's `*_reference` is a thin adapter
from its own argument layout to these two functions).

Query token (row b, position p) attends to the row's KV positions t <= p with t < kv_lens[b];
keys and values past kv_lens are zeroed before use, so NaN in spare pages never leaks; a query
with no visible key (padding: p = -1) gets zeros. Scores and the softmax are float32. Value
width may differ from key width (MLA latent pages: one shared head whose values are the first
kv_lora_rank entries of the keys).
"""

from __future__ import annotations

import math

import jax.numpy as jnp


def paged_attention_rows(q, k_pages, v_pages, block_tables, kv_lens, positions, *,
                         sm_scale=None, soft_cap=None, precision=None):
    """Uniform rows: each row's pages are gathered once for its Q queries.

    q [B, Q, H, d]; k_pages [KVH, P, S, d]; v_pages [KVH, P, S, dv]; block_tables int32[B, M];
    kv_lens int32[B]; positions int32[B, Q] (-1: padding) -> [B, Q, H, dv] in q's dtype.
    """
    b, q_len, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    dv = v_pages.shape[-1]
    m = block_tables.shape[1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    k = k_pages[:, block_tables].reshape(kvh, b, m * page_size, d)      # [KVH, B, L, d]
    v = v_pages[:, block_tables].reshape(kvh, b, m * page_size, dv)     # [KVH, B, L, dv]
    kv_pos = jnp.arange(m * page_size)
    kv_valid = kv_pos[None, :] < kv_lens[:, None]                        # [B, L]
    k = jnp.where(kv_valid[None, :, :, None], k, 0).astype(jnp.float32)
    v = jnp.where(kv_valid[None, :, :, None], v, 0).astype(jnp.float32)
    qg = q.reshape(b, q_len, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("bqkgd,kbld->bqkgl", qg, k, precision=precision) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    mask = (kv_pos[None, None, :] <= positions[:, :, None]) & kv_valid[:, None, :]  # [B, Q, L]
    s = jnp.where(mask[:, :, None, None, :], s, -jnp.inf)
    mx = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    o = jnp.einsum("bqkgl,kbld->bqkgd", p, v, precision=precision)
    return o.reshape(b, q_len, h, dv).astype(q.dtype)


def paged_attention_tokens(q, k_pages, v_pages, block_tables, kv_lens, seq_ids, positions, *,
                           sm_scale=None, soft_cap=None, precision=None):
    """Ragged tokens: token n belongs to row seq_ids[n] (its pages are gathered per token, so
    memory is O(N * M * S): tests and small batches).

    q [N, H, d]; block_tables int32[R, M]; kv_lens int32[R]; seq_ids int32[N];
    positions int32[N] (-1: padding) -> [N, H, dv].
    """
    out = paged_attention_rows(q[:, None], k_pages, v_pages, block_tables[seq_ids],
                               kv_lens[seq_ids], positions[:, None], sm_scale=sm_scale,
                               soft_cap=soft_cap, precision=precision)
    return out[:, 0]


def ragged_token_rows(cu_q_lens, kv_lens, num_seqs, num_tokens: int):
    """Row and position of each token of a ragged kernel batch: token i of sequence s
    (cu_q_lens[s] <= i < cu_q_lens[s + 1], s < num_seqs) sits at position
    kv_lens[s] - q_len_s + (i - cu_q_lens[s]); tokens past the live sequences get -1.
    -> (seq_ids int32[T], positions int32[T])."""
    s = kv_lens.shape[0]
    num_seqs = jnp.asarray(num_seqs).reshape(())
    tok = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right", method="compare_all"),
                   0, s - 1)
    live = (tok < cu_q_lens[jnp.minimum(num_seqs, s)]) & (seq < num_seqs)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    return seq, jnp.where(live, kv_lens[seq] - q_len + (tok - cu_q_lens[seq]), -1)
