"""Target model forward: plain causal (the reference) and over the paged KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.cache import KVCache, PagedBatch, slot_indices, write_kv
from mtpjax.config import ModelConfig
from mtpjax.model.attention import dense_causal_attention, paged_attention
from mtpjax.model.layers import decoder_block, rms_norm
from mtpjax.model.params import lm_head_weight


def logits_from_hidden(params, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] (already final-normed) -> f32 logits [..., V]."""
    return (hidden @ lm_head_weight(params)).astype(jnp.float32)


def forward(params, cfg: ModelConfig, tokens: jax.Array, *, return_hidden: bool = False):
    """Plain causal forward over int32[B, T], no cache: the reference for every cached path.

    Returns logits f32[B, T, V]; with return_hidden also the final-normed hidden states [B, T, E]
    (h^0, what MTP module 1 consumes).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = params["embed"][tokens]

    def layer(x, p):
        return decoder_block(p, x, positions, cfg, dense_causal_attention), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    logits = logits_from_hidden(params, hidden)
    return (logits, hidden) if return_hidden else logits


def layer_params(stacked: dict, i: int) -> dict:
    return jax.tree.map(lambda a: a[i], stacked)


def cached_block(p, x, batch: PagedBatch, cfg: ModelConfig, k_pages, v_pages, page, offset,
                 impl: str):
    """One decoder block over ragged tokens x [N, E]: writes its KV, attends through the cache."""
    new_pages = []

    def attend(q, k, v):
        kp, vp = write_kv(k_pages, v_pages, k, v, page, offset)
        new_pages.extend((kp, vp))
        return paged_attention(q, kp, vp, batch, impl=impl)

    x = decoder_block(p, x, batch.positions, cfg, attend)
    return x, new_pages[0], new_pages[1]


def forward_cached(params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                   batch: PagedBatch, *, impl: str = "auto"):
    """Target forward over ragged tokens int32[N] through the paged cache.

    Writes the KV of every non-padding token, returns (final-normed hidden [N, E], cache).
    Layers are unrolled so each layer's pages are updated in place (see KVCache).
    """
    page, offset = slot_indices(batch, cache.page_size, cache.num_pages)
    x = params["embed"][tokens]
    ks, vs = list(cache.target_k), list(cache.target_v)
    for i in range(cfg.num_layers):
        with jax.named_scope(f"layer_{i}"):
            x, ks[i], vs[i] = cached_block(layer_params(params["layers"], i), x, batch, cfg,
                                           ks[i], vs[i], page, offset, impl)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return hidden, cache.replace(target_k=tuple(ks), target_v=tuple(vs))
