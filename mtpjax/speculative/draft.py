"""The K-step MTP draft loop for both drafting methods (chain: one `lax.fori_loop`; multi_layer:
one pass per module, unrolled, since each pass has its own module's weights).

Both start from a *first pass* over a window of committed positions whose inputs are exact
(target hidden states h^0 and committed tokens), so every module's KV at committed positions is
derived from target states only (docs/spec_decoding.md, "KV consistency").

  chain        modules m < min(K, D) each run over the window (their committed KV); module 0's
               output at the last committed position N-1 gives d_1. Then steps s = 1..K-1 feed
               d_s at position N-1+s with the previous step's output hidden; module s % D's
               output continues the chain (with D > 1 every module in use runs there too, so
               each module's KV has no holes).
  multi_layer  module k (k = 0..K-1, K <= D) runs over the window with tokens shifted k further
               (the draft-input roll by one, new draft at the tail) and the hidden states of
               module k-1 at the same positions; its output at position N-1 gives d_{k+1}.

The first pass is a flat ragged batch (uniform windows in `generate`, prefill chunks and
verify windows mixed in the engine); the multi_layer token shift is `roll_by_one`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax import struct

from mtpjax.cache import KVCache, PagedBatch
from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.logit_processors import process_logits
from mtpjax.model.mtp import mtp_forward_cached
from mtpjax.speculative.draft_vocab import draft_logits
from mtpjax.speculative.rules.registry import acceptance_rule
from mtpjax.sampling import (GREEDY_MODES, SamplingArrays, filtered_probs, position_keys,
                             sample_from_probs)

DRAFT_SOURCES = ("model", "random", "forced")


@struct.dataclass
class DraftOverride:
    """Test hook: per-request draft source (index into DRAFT_SOURCES) and forced tokens."""

    modes: jax.Array      # int32[B]
    tokens: jax.Array     # int32[B, L] draft at position p is tokens[b, p] (mode "forced")


def draw_draft(logits, sp: SamplingArrays, positions, *, source: str, forced=None,
               coupled: bool = False, vocab_ids=None, vocab_size: int | None = None,
               drafts=None, num_drafted=None):
    """Draft token for each request at `positions` [B] and the distribution f32[B, V] it was
    drawn from. logits [B, V], or [B, N] over the draft subset `vocab_ids` int32[N] of a
    vocabulary of `vocab_size` (draft_vocab.py): the draft is the subset's token, and its
    distribution is scattered into the vocabulary (zero outside the subset).

    Key: fold_in(fold_in(request key, position), 2), a stream of its own; coupled (coupled
    acceptance): fold_in(request key, position), the very key the target samples that
    position with, so draft and target share their noise.
    source "model": sampled from the filtered draft distribution (argmax for greedy requests).
    "random" (tests): uniform over the vocabulary. "forced" (tests): forced.tokens[b, position].
    "mixed" (tests): per request, the source forced.modes[b] names.
    drafts int32[B, K], num_drafted: the row's drafts so far, the first `num_drafted` of which
    the penalties count as output (`process_logits`), as plain decoding would have.
    """
    B = logits.shape[0]
    V = logits.shape[1] if vocab_ids is None else vocab_size
    keys = position_keys(sp.keys, positions)
    if not coupled:
        keys = jax.vmap(jax.random.fold_in)(keys, jnp.full((B,), 2, jnp.uint32))
    if source == "model":
        # the target's logit processors too, so q is the distribution plain decoding would
        # sample after the drafts so far
        logits = process_logits(logits, sp, drafts=drafts, num_drafted=num_drafted,
                                vocab_ids=vocab_ids)
        if sp.mode in GREEDY_MODES:  # q is the one-hot argmax: take the token from it once
            tok = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
            tok = tok if vocab_ids is None else vocab_ids[tok]
            return tok, jax.nn.one_hot(tok, V, dtype=jnp.float32)
        q = filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p, sp.mode, sp.min_p)
        if vocab_ids is not None:
            # sampled over the whole vocabulary with q = 0 outside the subset: the same Gumbel
            # noise per token id as the target's draw (coupled acceptance stays coupled)
            q = jnp.zeros((B, V), jnp.float32).at[:, vocab_ids].set(q)
        return sample_from_probs(q, keys, sp.mode), q
    if source == "random":
        tok = jax.vmap(lambda k: jax.random.randint(k, (), 0, V))(keys).astype(jnp.int32)
        return tok, jnp.full((B, V), 1.0 / V, jnp.float32)
    if source == "forced":
        idx = jnp.clip(positions, 0, forced.tokens.shape[1] - 1)
        tok = forced.tokens[jnp.arange(B), idx].astype(jnp.int32)
        return tok, jax.nn.one_hot(tok, V, dtype=jnp.float32)
    if source == "mixed":
        outs = [draw_draft(logits, sp, positions, source=s, forced=forced, coupled=coupled,
                           vocab_ids=vocab_ids, vocab_size=vocab_size, drafts=drafts,
                           num_drafted=num_drafted) for s in DRAFT_SOURCES]
        pick = lambda *xs: jnp.stack(xs)[forced.modes, jnp.arange(B)]
        return jax.tree.map(pick, *outs)
    raise ValueError(f"draft source {source!r} not in {DRAFT_SOURCES}")


def roll_by_one(tokens: jax.Array, next_same: jax.Array, new: jax.Array, row_of: jax.Array):
    """The draft-input roll by one over a flat ragged batch: every segment shifts left by one
    and takes its row's new token at the tail. tokens int32[F]; next_same bool[F] (entry f+1 is
    in f's segment); new int32[R]; row_of int32[F]."""
    shifted = jnp.concatenate([tokens[1:], tokens[:1]])
    return jnp.where(next_same, shifted, new[row_of])


def run_drafts(params, cfg: ModelConfig, spec: SpecConfig, cache: KVCache, *,
               window: PagedBatch, hidden0: jax.Array, tokens0: jax.Array,
               next_same: jax.Array, last_rows: jax.Array, seq_len: jax.Array,
               block_tables: jax.Array, sp: SamplingArrays, backend,
               drafting: jax.Array | None = None, fixed_next: jax.Array | None = None,
               source: str = "model", forced=None, passes: int | None = None):
    """Drafts d_1..d_K for R requests from a first pass over a flat ragged window.

    window: first-pass batch of F tokens (segments end at each request's position seq_len-1;
    positions -1 are padding). hidden0 [F, E]: target hidden states there. tokens0 int32[F]: the
    token one past each position (x_{p+1}). next_same bool[F]: f+1 lies in f's segment.
    last_rows int32[R]: flat row of position seq_len-1. seq_len int32[R]: committed KV count N
    (pending token at N, draft i at N+i). drafting bool[R]: rows that draft (others, e.g.
    non-final prefill chunks, only write their first-pass KV). fixed_next int32[R, K] (multi_layer):
    where >= 0, the token to roll in after module k instead of the draft (the prompt's next tokens
    of a non-final chunk). passes (static, chain only; default K): draft passes run, 0..K.
    Drafts past `passes` stay 0 with probability rows 0, so the next step must verify at most
    `passes` drafts per row (the engine's host keeps that; docs/spec_decoding.md, "Adaptive
    K"). The first pass of every module in use always runs: it writes the modules' KV of the
    committed window, which later steps read whatever they draft.
    Returns (cache, drafts int32[R, K], draft_probs f32[R, K, V]).
    """
    F, E = hidden0.shape
    R = seq_len.shape[0]
    K, D, V = spec.num_speculative_tokens, cfg.num_mtp_layers, cfg.vocab_size
    drafting = jnp.ones((R,), bool) if drafting is None else drafting
    drafts = jnp.zeros((R, K), jnp.int32)
    probs = jnp.zeros((R, K, V), jnp.float32)
    # coupled acceptance: the drafter draws with the target's keys (the rule's entry says)
    shared_keys = acceptance_rule(spec.acceptance).drafts_share_target_keys

    def draw(normed_rows, i, drafts):
        logits, ids = draft_logits(params, normed_rows)
        return draw_draft(logits, sp, seq_len + 1 + i, source=source, forced=forced,
                          coupled=shared_keys, vocab_ids=ids, vocab_size=V, drafts=drafts,
                          num_drafted=i)

    def record(drafts, probs, tok, q, i):
        drafts = jax.lax.dynamic_update_index_in_dim(drafts, tok, i, axis=1)
        probs = jax.lax.dynamic_update_index_in_dim(probs, q, i, axis=1)
        return drafts, probs

    passes = K if passes is None else passes
    if not 0 <= passes <= K or (passes != K and spec.method != "chain"):
        raise ValueError(f"draft passes must be 0..K={K} for the chain method (K for "
                         f"{spec.method!r}), got passes={passes}")
    if spec.method == "multi_layer":
        # One pass per module, unrolled: each uses its own module's weights, and selecting the
        # module with a traced index (lax.switch in a fori_loop) made the GPU launch thread wait
        # for the switch's index once per draft (docs/architecture.md, "Compiling a step").
        hidden, tokens = hidden0, tokens0
        for k in range(K):
            h_next, normed, cache = mtp_forward_cached(params, cfg, k, cache, hidden, tokens,
                                                       window, backend=backend)
            tok, q = draw(normed[last_rows], k, drafts)
            drafts, probs = record(drafts, probs, tok, q, k)
            new = tok if fixed_next is None else jnp.where(fixed_next[:, k] >= 0,
                                                           fixed_next[:, k], tok)
            tokens = roll_by_one(tokens, next_same, new, window.seq_ids)
            hidden = h_next.astype(hidden.dtype)
        return cache, drafts, probs

    # chain: first pass of every module that the K steps will use
    h_last = normed_last = None
    for m in range(min(K, D)):
        h_next, normed, cache = mtp_forward_cached(params, cfg, m, cache, hidden0, tokens0,
                                                   window, backend=backend)
        if m == 0:
            h_last, normed_last = h_next[last_rows], normed[last_rows]
    if passes == 0:
        return cache, drafts, probs
    tok, q = draw(normed_last, 0, drafts)
    drafts, probs = record(drafts, probs, tok, q, 0)

    def chain_step(s, carry):
        cache, h_prev, drafts, probs = carry
        pos = jnp.where(drafting, seq_len - 1 + s, -1)
        batch = PagedBatch.uniform(pos[:, None], block_tables)
        # Every module in use writes its KV at this position (so none later reads a stale
        # slot); module s % D's output continues the chain.
        outs = []
        for m in range(min(K, D)):
            h_next, normed, cache = mtp_forward_cached(params, cfg, m, cache, h_prev,
                                                       drafts[:, s - 1], batch, backend=backend)
            outs.append((h_next, normed))
        h_next, normed = jax.tree.map(lambda *xs: jnp.stack(xs)[s % len(outs)], *outs)
        tok, q = draw(normed, s, drafts)
        drafts, probs = record(drafts, probs, tok, q, s)
        return cache, h_next.astype(h_prev.dtype), drafts, probs

    cache, _, drafts, probs = jax.lax.fori_loop(1, passes, chain_step,
                                                (cache, h_last, drafts, probs))
    return cache, drafts, probs


def window_size(spec: SpecConfig) -> int:
    """Committed positions the first pass covers: K+1 (chain), 2K (multi_layer; see docs)."""
    K = spec.num_speculative_tokens
    return K + 1 if spec.method == "chain" else 2 * K


def draft_shape(spec: SpecConfig | None) -> tuple[int, int]:
    """(K, W): drafts per step and first-pass window; (0, 1) without speculation."""
    return (spec.num_speculative_tokens, window_size(spec)) if spec is not None else (0, 1)
