"""The speculative step: verify K+1 tokens, accept, commit, roll draft inputs, draft K more.

One jitted pure function `spec_step(params, state, ...) -> state` (state donated by callers);
no device-to-host transfer inside. `spec_prefill` builds the first state from prompts, including
each request's first token and first drafts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.cache import KVCache, PagedBatch
from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.model.transformer import forward_cached, logits_from_hidden
from mtpjax.sampling import Limits, SamplingArrays, is_stop, sample
from mtpjax.speculative.accept import apply_acceptance
from mtpjax.speculative.draft import run_drafts, window_size
from mtpjax.speculative.metrics import SpecStats
from mtpjax.speculative.roll import roll_draft_inputs


@struct.dataclass
class SpecState:
    cache: KVCache
    block_tables: jax.Array    # int32[B, M]
    seq_len: jax.Array         # int32[B] committed KV count N; pending token at position N
    hist_tokens: jax.Array     # int32[B, W] tokens at positions N-W+1..N (last = pending token)
    hist_hidden: jax.Array     # [B, W, E] target hidden h^0 at positions N-W..N-1
    drafts: jax.Array          # int32[B, K] drafts for positions N+1..N+K
    draft_probs: jax.Array     # f32[B, K, V] distributions the drafts were drawn from
    in_thinking: jax.Array     # bool[B] relaxed acceptance: inside the thinking phase
    out_tokens: jax.Array      # int32[B, max_new + K + 1] generated ids, -1 past num_out
    num_out: jax.Array         # int32[B]
    done: jax.Array            # bool[B]
    stats: SpecStats

    @property
    def last_token(self):
        return self.hist_tokens[:, -1]


def window_batch(seq_len, W: int, block_tables) -> PagedBatch:
    """First-pass batch over positions seq_len-W .. seq_len-1 (negative -> padding)."""
    pos = seq_len[:, None] - W + jnp.arange(W, dtype=jnp.int32)[None, :]
    return PagedBatch.uniform(jnp.where(pos >= 0, pos, -1), block_tables)


def commit(state: SpecState, tokens, num_accepted, limits: Limits):
    """Truncates each accepted run at the first stop token / max_new and appends it to the output.

    Returns (num_committed int32[B] (0 for finished requests), out_tokens, num_out, done).
    """
    B, K1 = tokens.shape
    live = ~state.done
    j = jnp.arange(K1)[None, :]
    stop = is_stop(tokens, limits.stop_ids) & (j < num_accepted[:, None])
    first_stop = jnp.where(jnp.any(stop, 1), jnp.argmax(stop, 1) + 1, K1 + 1)
    n = jnp.minimum(jnp.minimum(num_accepted, first_stop), limits.max_new - state.num_out)
    n = jnp.where(live, n, 0).astype(jnp.int32)
    cols = state.num_out[:, None] + j
    cols = jnp.where(j < n[:, None], cols, state.out_tokens.shape[1])       # dropped
    out = state.out_tokens.at[jnp.arange(B)[:, None], cols].set(tokens, mode="drop")
    num_out = state.num_out + n
    done = state.done | (live & ((first_stop <= n) | (num_out >= limits.max_new)))
    return n, out, num_out, done


def spec_step(params, cfg: ModelConfig, spec: SpecConfig, state: SpecState, sp: SamplingArrays,
              limits: Limits, *, backend, source: str = "model", forced=None) -> SpecState:
    B, K = state.drafts.shape
    W = state.hist_tokens.shape[1]
    N = state.seq_len
    with jax.named_scope("verify"):
        tokens = jnp.concatenate([state.last_token[:, None], state.drafts], axis=1)   # [B, K+1]
        pos = N[:, None] + jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        hidden, cache = forward_cached(params, cfg, state.cache, tokens.reshape(-1),
                                       PagedBatch.uniform(pos, state.block_tables), backend=backend)
        logits = logits_from_hidden(params, hidden).reshape(B, K + 1, -1)
    with jax.named_scope("accept"):
        acc_tokens, num_accepted, thinking = apply_acceptance(
            spec, logits, state.drafts, state.draft_probs, jnp.full((B,), K, jnp.int32),
            state.in_thinking, sp, N + 1)
        n, out, num_out, done = commit(state, acc_tokens, num_accepted, limits)
    # Rejected KV stays beyond seq_len and is overwritten by later steps.
    seq_len = N + n
    hist_tokens, hist_hidden = roll_draft_inputs(
        state.hist_tokens, state.hist_hidden, acc_tokens,
        hidden.reshape(B, K + 1, -1), n, backend=backend)
    with jax.named_scope("draft"):
        j = jnp.arange(B * W) % W
        cache, drafts, probs = run_drafts(
            params, cfg, spec, cache, window=window_batch(seq_len, W, state.block_tables),
            hidden0=hist_hidden.reshape(B * W, -1), tokens0=hist_tokens.reshape(-1),
            next_same=j < W - 1, last_rows=jnp.arange(B) * W + W - 1, seq_len=seq_len,
            block_tables=state.block_tables, sp=sp, backend=backend, source=source, forced=forced)
    return SpecState(cache=cache, block_tables=state.block_tables, seq_len=seq_len,
                     hist_tokens=hist_tokens, hist_hidden=hist_hidden, drafts=drafts,
                     draft_probs=probs, in_thinking=jnp.where(state.done, state.in_thinking, thinking),
                     out_tokens=out, num_out=num_out, done=done,
                     stats=state.stats.update(~state.done, num_accepted, n))


def spec_prefill(params, cfg: ModelConfig, spec: SpecConfig, cache: KVCache, tokens, positions,
                 lens, block_tables, sp: SamplingArrays, limits: Limits, *, max_new: int,
                 backend, source: str = "model", forced=None) -> SpecState:
    """Prefills left-padded prompts int32[B, T], samples each first token, drafts K tokens."""
    B, T = tokens.shape
    K = spec.num_speculative_tokens
    W = window_size(spec)
    rows = jnp.arange(B)
    batch = PagedBatch.uniform(positions, block_tables)      # left padded: ends aligned
    hidden, cache = forward_cached(params, cfg, cache, tokens.reshape(-1), batch, backend=backend)
    hidden = hidden.reshape(B, T, -1)
    first = sample(logits_from_hidden(params, hidden[:, T - 1]), sp, lens)
    # the token one past each position: the prompt shifted by one, the first token at the end
    ahead = jnp.concatenate([tokens[:, 1:], first[:, None]], axis=1)             # [B, T]
    j = jnp.arange(B * T) % T
    cache, drafts, probs = run_drafts(
        params, cfg, spec, cache, window=batch, hidden0=hidden.reshape(B * T, -1),
        tokens0=ahead.reshape(-1), next_same=j < T - 1, last_rows=rows * T + T - 1,
        seq_len=lens, block_tables=block_tables, sp=sp, backend=backend, source=source, forced=forced)
    # History window: the last W rows (positions P-W..P-1; zeros before position 0).
    valid = (positions >= 0)[..., None]
    pad = lambda a: jnp.concatenate([jnp.zeros_like(a[:, :W]), a], axis=1)[:, -W:]
    hist_hidden = pad(jnp.where(valid, hidden, 0.0))
    hist_tokens = pad(jnp.where(valid[..., 0], ahead, 0))
    out = jnp.full((B, max_new + K + 1), -1, jnp.int32).at[:, 0].set(first)
    done = is_stop(first, limits.stop_ids) | (limits.max_new <= 1)
    thinking = jnp.zeros((B,), bool)
    if spec.acceptance == "relaxed":   # phase after the prompt and the first token
        seen = jnp.concatenate([jnp.where(positions >= 0, tokens, -1), first[:, None]], axis=1)
        idx = jnp.arange(T + 1)
        start = jnp.where(seen == spec.think_start_token_id, idx, -1).max(1)
        end = jnp.where(seen == spec.think_end_token_id, idx, -1).max(1)
        thinking = start > end
    return SpecState(cache=cache, block_tables=block_tables, seq_len=lens,
                     hist_tokens=hist_tokens.astype(jnp.int32), hist_hidden=hist_hidden,
                     drafts=drafts, draft_probs=probs, in_thinking=thinking, out_tokens=out,
                     num_out=jnp.ones((B,), jnp.int32), done=done, stats=SpecStats.zeros(K))
