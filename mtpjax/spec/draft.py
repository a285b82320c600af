"""The K-step MTP draft loop, one `lax.fori_loop`, for both drafting methods.

Both start from a *first pass* over a window of committed positions whose inputs are exact
(target hidden states h^0 and committed tokens), so every module's KV at committed positions is
derived from target states only (docs/spec_decoding.md, "KV consistency").

  chain        modules m < min(K, D) each run over the window (their committed KV); module 0's
               output at the last committed position N-1 gives d_1. Then steps s = 1..K-1 feed
               d_s at position N-1+s with the previous step's output hidden; module s % D's
               output continues the chain (with D > 1 every module in use runs there too, so
               each module's KV has no holes).
  multi_layer  module k (k = 0..K-1, K = D) runs over the window with tokens shifted k further
               (the draft-input roll by one, new draft at the tail) and the hidden states of
               module k-1 at the same positions; its output at position N-1 gives d_{k+1}.

`ext` holds the tokens the window needs plus room for the drafts: the token at window index j for
module k is ext[:, j + k + offset]; d_i is written at ext[:, last_idx + i + offset].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.cache import KVCache, PagedBatch
from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.model.mtp import mtp_forward_cached, mtp_forward_cached_switch
from mtpjax.model.transformer import logits_from_hidden
from mtpjax.sampling import SamplingArrays, filtered_probs, position_keys, sample_from_probs

DRAFT_SOURCES = ("model", "random", "forced")


def draw_draft(logits, sp: SamplingArrays, positions, *, source: str, forced=None):
    """Draft token for each request at `positions` [B] and the distribution it was drawn from.

    source "model": sampled from the filtered draft distribution (argmax for greedy requests).
    "random" (tests): uniform over the vocabulary. "forced" (tests): forced[b, position].
    """
    B, V = logits.shape
    keys = jax.vmap(jax.random.fold_in)(position_keys(sp.keys, positions),
                                        jnp.full((B,), 2, jnp.uint32))
    if source == "model":
        q = filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p)
        return sample_from_probs(q, keys), q
    if source == "random":
        tok = jax.vmap(lambda k: jax.random.randint(k, (), 0, V))(keys).astype(jnp.int32)
        return tok, jnp.full((B, V), 1.0 / V, jnp.float32)
    if source == "forced":
        idx = jnp.clip(positions, 0, forced.shape[1] - 1)
        tok = forced[jnp.arange(B), idx].astype(jnp.int32)
        return tok, jax.nn.one_hot(tok, V, dtype=jnp.float32)
    raise ValueError(f"draft source {source!r} not in {DRAFT_SOURCES}")


def run_drafts(params, cfg: ModelConfig, spec: SpecConfig, cache: KVCache, *,
               window: PagedBatch, hidden0: jax.Array, ext: jax.Array, offset: int,
               last_idx: jax.Array, seq_len: jax.Array, block_tables: jax.Array,
               sp: SamplingArrays, impl: str, source: str = "model", forced=None):
    """Drafts d_1..d_K for every request.

    window: ragged batch of the first pass (B requests x Tw positions, -1 = padding).
    hidden0 [B, Tw, E]: target hidden states at the window positions. ext int32[B, >= Tw+K+offset].
    last_idx int32[B]: window index of position seq_len-1. seq_len int32[B]: committed KV count N
    (the pending token sits at N, draft i at N+i).
    Returns (cache, drafts int32[B, K], draft_probs f32[B, K, V]).
    """
    B, Tw, E = hidden0.shape
    K, D, V = spec.num_speculative_tokens, cfg.num_mtp_layers, cfg.vocab_size
    rows = jnp.arange(B)
    drafts = jnp.zeros((B, K), jnp.int32)
    probs = jnp.zeros((B, K, V), jnp.float32)

    def tokens_for(ext, k):
        return jax.lax.dynamic_slice_in_dim(ext, k + offset, Tw, axis=1)

    def draft_at(normed_last, i, drafts, probs, ext):
        """Draws d_{i+1} from lm_head(normed_last), records it; i traced or static."""
        tok, q = draw_draft(logits_from_hidden(params, normed_last), sp, seq_len + 1 + i,
                            source=source, forced=forced)
        drafts = drafts.at[:, i].set(tok)
        probs = probs.at[:, i].set(q)
        ext = ext.at[rows, last_idx + 1 + i + offset].set(tok, mode="drop")
        return drafts, probs, ext

    if spec.method == "multi_layer":
        def module_pass(k, carry):
            cache, hidden, ext, drafts, probs = carry
            h_next, normed, cache = mtp_forward_cached_switch(
                params, cfg, k, cache, hidden.reshape(B * Tw, E),
                tokens_for(ext, k).reshape(-1), window, impl=impl)
            normed_last = normed.reshape(B, Tw, E)[rows, last_idx]
            drafts, probs, ext = draft_at(normed_last, k, drafts, probs, ext)
            return cache, h_next.reshape(B, Tw, E).astype(hidden.dtype), ext, drafts, probs

        cache, _, _, drafts, probs = jax.lax.fori_loop(
            0, K, module_pass, (cache, hidden0, ext, drafts, probs))
        return cache, drafts, probs

    # chain: first pass of every module that the K steps will use
    tokens0 = tokens_for(ext, 0).reshape(-1)
    h_last = normed_last = None
    for m in range(min(K, D)):
        h_next, normed, cache = mtp_forward_cached(params, cfg, m, cache,
                                                   hidden0.reshape(B * Tw, E), tokens0, window,
                                                   impl=impl)
        if m == 0:
            h_last = h_next.reshape(B, Tw, E)[rows, last_idx]
            normed_last = normed.reshape(B, Tw, E)[rows, last_idx]
    drafts, probs, ext = draft_at(normed_last, 0, drafts, probs, ext)

    def chain_step(s, carry):
        cache, h_prev, drafts, probs = carry
        batch = PagedBatch.uniform((seq_len - 1 + s)[:, None], block_tables)
        # Every module in use writes its KV at this position (so none later reads a stale
        # slot); module s % D's output continues the chain.
        outs = []
        for m in range(min(K, D)):
            h_next, normed, cache = mtp_forward_cached(params, cfg, m, cache, h_prev,
                                                       drafts[:, s - 1], batch, impl=impl)
            outs.append((h_next, normed))
        h_next, normed = jax.tree.map(lambda *xs: jnp.stack(xs)[s % len(outs)], *outs)
        tok, q = draw_draft(logits_from_hidden(params, normed), sp, seq_len + 1 + s,
                            source=source, forced=forced)
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, s, axis=1)
        probs = jax.lax.dynamic_update_index_in_dim(probs, q, s, axis=1)
        return cache, h_next.astype(h_prev.dtype), drafts, probs

    cache, _, drafts, probs = jax.lax.fori_loop(1, K, chain_step, (cache, h_last, drafts, probs))
    return cache, drafts, probs


def window_size(spec: SpecConfig) -> int:
    """Committed positions the first pass covers: K+1 (chain), 2K (multi_layer; see docs)."""
    K = spec.num_speculative_tokens
    return K + 1 if spec.method == "chain" else 2 * K
