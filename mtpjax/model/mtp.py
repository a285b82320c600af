"""MTP module k (0-based here; the 1-based depth k = 1..D of DeepSeek-V3 is `module + 1`).

At position i, module k combines the previous depth's hidden state h^k_i with the embedding of
the token it is given (x_{i+k+1} in 0-based module numbering, i.e. the token one past what the
previous depth predicted) and predicts the token after it:

    e = enorm(embed(x)),  zeroed at position 0
    u = eh_proj(concat(e, hnorm(h)))        # MiMo: concat(hnorm(h), e)
    y = block_k(u)                          # its own attention layer over its own paged KV
    logits   = lm_head(out_norm(y))
    h_next   = y  (DeepSeek)  |  out_norm(y)  (MiMo, `mtp_normed_hidden_to_next`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.cache import KVCache, PagedBatch, PagedContext
from mtpjax.config import ModelConfig
from mtpjax.model.layers import decoder_block, rms_norm
from mtpjax.model.linear import linear
from mtpjax.model.transformer import logits_from_hidden


def _module_input(params, mp, cfg: ModelConfig, hidden_prev, tokens, positions):
    emb = params["embed"][tokens]
    emb = jnp.where((positions == 0)[..., None], jnp.zeros_like(emb), emb)
    e = rms_norm(emb, mp["enorm"], cfg.rms_norm_eps)
    h = rms_norm(hidden_prev.astype(emb.dtype), mp["hnorm"], cfg.rms_norm_eps)
    parts = (e, h) if cfg.mtp_concat_order == "embed_hidden" else (h, e)
    return linear(jnp.concatenate(parts, axis=-1), mp["eh_proj"])


def _module_output(mp, cfg: ModelConfig, y):
    """(hidden handed to the next depth, normed hidden for lm_head)."""
    normed = rms_norm(y, mp["out_norm"], cfg.rms_norm_eps)
    return (normed if cfg.mtp_normed_hidden_to_next else y), normed


def mtp_forward(params, cfg: ModelConfig, k: int, hidden_prev: jax.Array, tokens: jax.Array,
                positions: jax.Array | None = None):
    """Module k over whole sequences, no cache (the from-scratch reference).

    hidden_prev [B, T, E] = h^k at positions 0..T-1; tokens int32[B, T] = the token each position
    is given. Returns (h^{k+1} [B, T, E], logits f32[B, T, V]).
    """
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mp = params["mtp"][k]
    u = _module_input(params, mp, cfg, hidden_prev, tokens, positions)
    y, _ = decoder_block(mp["block"], u, positions, cfg, cfg.mtp_layer_kind())
    h_next, normed = _module_output(mp, cfg, y)
    return h_next, logits_from_hidden(params, normed)


def mtp_forward_cached(params, cfg: ModelConfig, k: int, cache: KVCache, hidden_prev: jax.Array,
                       tokens: jax.Array, batch: PagedBatch, *, backend):
    """Module k over ragged tokens [N] through its own paged KV (same block tables as the target).

    Returns (h^{k+1} [N, E], normed [N, E] (lm_head input: `logits_from_hidden`), cache).
    Logits are left to the caller, which usually needs them at a few rows only.
    """
    mp = params["mtp"][k]
    u = _module_input(params, mp, cfg, hidden_prev, tokens, batch.positions)
    pages = list(cache.mtp)
    y, pages[k] = decoder_block(mp["block"], u, batch.positions, cfg, cfg.mtp_layer_kind(),
                                pages[k], PagedContext.build(batch, cache, backend))
    h_next, normed = _module_output(mp, cfg, y)
    return h_next, normed, cache.replace(mtp=tuple(pages))
