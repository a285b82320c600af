"""Target model forward: plain causal (the reference) and over the paged KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.cache import KVCache, PagedBatch, PagedContext
from mtpjax.config import ModelConfig
from mtpjax.model.layers import decoder_block, rms_norm
from mtpjax.model.linear import linear
from mtpjax.model.params import lm_head_weight


def logits_from_hidden(params, hidden: jax.Array) -> jax.Array:
    """hidden [..., E] (already final-normed) -> f32 logits [..., V]."""
    return linear(hidden, lm_head_weight(params)).astype(jnp.float32)


def forward(params, cfg: ModelConfig, tokens: jax.Array, *, return_hidden: bool = False):
    """Plain causal forward over int32[B, T], no cache: the reference for every cached path.

    Returns logits f32[B, T, V]; with return_hidden also the final-normed hidden states [B, T, E]
    (h^0, what MTP module 1 consumes).
    """
    hidden = final_hidden(params, cfg, tokens)
    logits = logits_from_hidden(params, hidden)
    return (logits, hidden) if return_hidden else logits


def final_hidden(params, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Plain causal pass over int32[B, T] -> final-normed hidden states [B, T, E] (no lm_head)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be int32[B, T], got shape {tokens.shape}")
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    x = params["embed"][tokens]
    for p, kinds in zip(params["layers"], cfg.layer_kinds()):
        x, _ = decoder_block(p, x, positions, cfg, kinds)
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def forward_cached(params, cfg: ModelConfig, cache: KVCache, tokens: jax.Array,
                   batch: PagedBatch, *, backend):
    """Target forward over ragged tokens int32[N] through the paged cache.

    Writes the KV of every non-padding token, returns (final-normed hidden [N, E], cache).
    Layers are unrolled, each with its own weight buffers and pages (read and updated in place).
    """
    paged = PagedContext.build(batch, cache, backend)
    x = params["embed"][tokens]
    pages = list(cache.target)
    for i, (p, kinds) in enumerate(zip(params["layers"], cfg.layer_kinds())):
        with jax.named_scope(f"layer_{i}"):
            x, pages[i] = decoder_block(p, x, batch.positions, cfg, kinds, pages[i], paged)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return hidden, cache.replace(target=tuple(pages))
