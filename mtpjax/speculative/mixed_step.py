"""The engine's jitted step over a ragged batch mixing prefill chunks and speculative decodes.

Each row r of a `MixedBatch` is one scheduled request, living in engine slot `slots[r]`:
  KIND_DECODE      q_len = k+1: [pending token, d_1..d_k] at positions N..N+k, k <= K the drafts
                   the row verifies (chain drafting; the engine packs k+1 tokens, so a step
                   verifying fewer drafts runs a narrower verify; multi_layer: K+1). N, the
                   pending token and the drafts come from the slot's device state, not from the
                   host, so the host can pack step t+1 before it has read step t (async scheduling)
  KIND_CHUNK       a non-final prefill chunk: writes KV, commits nothing
  KIND_LAST_CHUNK  the final prefill chunk: commits the first sampled token
  KIND_RESUME      the final chunk of a resuming request's re-prefill (x_0..x_{T-2}, after a
                   preemption): commits nothing, x_{T-1} (next_tokens[r, 0]) becomes the pending
                   token again and the row drafts, so the next verify step is the one the request
                   would have run without the preemption (same drafts, same keys)
  KIND_PAD         padding row (q_len 0)
One ragged target forward serves every row; acceptance treats a final chunk as a request with
0 drafts. The MTP first pass is ragged too: for every row it covers the positions
[N' - L, N' - 1], L = W for decodes (chain: their q_len <= W, which covers the <= q_len
positions the step commits) and max(W, q_len) for chunks, taking inputs from this step's
rows and, before them, from the slot's draft-input history. The history's last W positions
become the new history (from the window where it covers them, else shifted from the old). Then the shared draft loop (`run_drafts`) drafts K tokens for decodes and final chunks.
The host reads only `committed_tokens` and `num_committed`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.cache import KVCache, PagedBatch
from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.model.transformer import forward_cached, logits_from_hidden
from mtpjax.logit_processors import process_logits
from mtpjax.sampling import PENALTY_MODES, SamplingArrays, processed_logprob_top, sample
from mtpjax.speculative.accept import apply_acceptance
from mtpjax.speculative.draft import draft_shape, run_drafts
from mtpjax.structured.bitmask import apply_token_bitmask
from mtpjax.speculative.rules.relaxed import thinking_after  # noqa: F401 (notebooks import it here)

KIND_PAD, KIND_DECODE, KIND_CHUNK, KIND_LAST_CHUNK, KIND_RESUME = 0, 1, 2, 3, 4


@struct.dataclass
class SlotState:
    """Device state of the engine: the paged cache and per-slot draft state."""

    cache: KVCache
    hist_tokens: jax.Array    # int32[S, W]   x at positions N-W+1..N of the slot's request
    hist_hidden: jax.Array    # [S, W, E]     target hidden at positions N-W..N-1
    drafts: jax.Array         # int32[S, K]
    draft_probs: jax.Array    # f32[S, K, V]
    in_thinking: jax.Array    # bool[S]       the acceptance rule's per-slot flag (relaxed:
                              #               inside thinking; AcceptanceRule.slot_flag)
    seq_len: jax.Array        # int32[S]      N: positions with committed KV
    pending: jax.Array        # int32[S]      the committed token at position N (no KV yet)
    # the penalties' token history (logit_processors): output counts | PROMPT_FLAG per token
    # id, including the pending token. Only the steps of a penalty mode carry it (the engine
    # attaches it to theirs); every other step has None here and its program is unchanged.
    history: jax.Array | None = None    # int32[S, V]

    @classmethod
    def create(cls, cfg: ModelConfig, spec: SpecConfig, cache: KVCache, num_slots: int,
               dtype=jnp.float32) -> "SlotState":
        K, W = draft_shape(spec)
        return cls(cache=cache,
                   hist_tokens=jnp.zeros((num_slots, W), jnp.int32),
                   hist_hidden=jnp.zeros((num_slots, W, cfg.hidden_size), dtype),
                   drafts=jnp.zeros((num_slots, K), jnp.int32),
                   draft_probs=jnp.zeros((num_slots, K, cfg.vocab_size), jnp.float32),
                   in_thinking=jnp.zeros((num_slots,), bool),
                   seq_len=jnp.zeros((num_slots,), jnp.int32),
                   pending=jnp.zeros((num_slots,), jnp.int32))


@struct.dataclass
class MixedBatch:
    tokens: jax.Array         # int32[T]     token ids (decode rows: placeholders)
    positions: jax.Array      # int32[T]     -1 = padding (decode rows: placeholders >= 0)
    seq_ids: jax.Array        # int32[T]     row of each token
    cu_q_lens: jax.Array      # int32[R+1]
    kv_lens: jax.Array        # int32[R]     N + q_len (decode rows: placeholder)
    block_tables: jax.Array   # int32[R, M]
    slots: jax.Array          # int32[R]     engine slot of each row (padding -> a scratch slot)
    kinds: jax.Array          # int32[R]     KIND_*
    next_tokens: jax.Array    # int32[R, K+1] prompt tokens at positions end..end+K of a
                              #              non-final chunk (-1 past the prompt)
    thinking: jax.Array       # bool[R]      the rule's per-slot flag after the prompt (final
                              #              chunks; resume rows: after every committed token)
    hist_from: jax.Array      # int32[R]     first position this residency computed itself;
                              #              earlier KV came from the prefix cache (no history)
    sampling: SamplingArrays  # per row
    num_drafts: jax.Array | None = None      # int32[R] drafts a decode row verifies, 0..K (the
                                             # rest are masked: never accepted); None: K
    want_logprobs: jax.Array | None = None   # bool[R] rows whose logprobs are returned


@struct.dataclass
class StepLogprobs:
    """Logprobs of a step's committed tokens under the target's processed distribution
    (`sampling.processed_logprobs`), from the verify pass's logits. Entry [r, j] belongs to
    committed_tokens[r, j] (meaningful for j < num_committed[r]); zeros when no row asked."""

    chosen: jax.Array         # f32[R, J]     logprob of committed_tokens[r, j]
    top_values: jax.Array     # f32[R, J, n]  the n largest logprobs, descending
    top_ids: jax.Array        # int32[R, J, n]


def step_logprobs(logits, tokens, sp: SamplingArrays, want, n: int) -> StepLogprobs:
    """logits [R, J, V], tokens int32[R, J], want bool[R] -> StepLogprobs (zeros for rows that
    do not want them). Computed for every row of an engine built with max_logprobs > 0: a
    device-side branch skipping it would make the GPU dispatch wait for the step
    (docs/architecture.md, "Compiling a step")."""
    # the tokens before position j are committed (the verify window's drafts up to there)
    chosen, vals, ids = processed_logprob_top(process_logits(logits, sp, drafts=tokens[:, :-1]),
                                              tokens,
                                              sp.temperature, sp.top_k, sp.top_p, n, sp.mode,
                                              sp.min_p)
    w = want[:, None]
    return StepLogprobs(jnp.where(w, chosen, 0.0), jnp.where(w[..., None], vals, 0.0),
                        jnp.where(w[..., None], ids.astype(jnp.int32), 0))


def mixed_step(params, cfg: ModelConfig, spec: SpecConfig, state: SlotState, batch: MixedBatch,
               *, first_pass_len: int, backend, draft_source: str = "model", forced=None,
               logprobs: int = 0, draft_passes: int | None = None):
    """-> (state, committed_tokens int32[R, K+1], num_committed int32[R]), and a 4th output,
    StepLogprobs with n = `logprobs` alternatives per token, when logprobs > 0.

    spec=None: plain autoregressive decoding (decode rows carry one token, no drafting).
    batch.num_drafts: per-row drafts verified (per-request / adaptive K, by masking: the
    compiled shapes stay those of K). draft_passes (static, default K): the draft passes this
    step runs for the next one (`run_drafts`' passes; the next step verifies at most that
    many drafts per row). draft_source / forced: the draft loop's test hooks
    (speculative/draft.py). This is the only device step: the engine runs it on ragged batches,
    `generate` inside its while_loop.
    """
    K, W = draft_shape(spec)
    T = batch.tokens.shape[0]
    R = batch.kinds.shape[0]
    F = first_pass_len
    cu = batch.cu_q_lens
    q_len = cu[1:] - cu[:-1]
    is_dec = batch.kinds == KIND_DECODE
    is_last = batch.kinds == KIND_LAST_CHUNK
    is_resume = batch.kinds == KIND_RESUME
    is_chunk = (batch.kinds == KIND_CHUNK) | is_last | is_resume
    drafts = state.drafts[batch.slots]
    probs = state.draft_probs[batch.slots]
    # the draft-input history's rows, gathered once: left to XLA, the gathers were fused
    # into several consumers, some of which it may run after the slots' in-place update, so
    # it copied both whole arrays first (twice, in the CPU HLO). (draft_probs stays out of
    # the barrier: a greedy step never reads it, and the barrier would keep its gather.)
    old_tokens, old_hidden = jax.lax.optimization_barrier(
        (state.hist_tokens[batch.slots], state.hist_hidden[batch.slots]))
    # N before the step: the slot's for decodes, the host's for chunks
    start = jnp.where(is_dec, state.seq_len[batch.slots], batch.kv_lens - q_len)
    kv_lens = start + q_len

    with jax.named_scope("verify"):
        j = jnp.arange(T) - cu[batch.seq_ids]
        dec_tok = is_dec[batch.seq_ids] & (jnp.arange(T) < cu[R])
        positions = jnp.where(dec_tok, start[batch.seq_ids] + j, batch.positions)
        if K and batch.num_drafts is not None:
            # a draft past its row's k is never verified: as a padding token (position -1) it
            # writes no KV and routes to no expert, so a masked draft costs an MoE layer
            # nothing (at batch 1 each routed token touches up to top-k more experts)
            row_k_tok = jnp.clip(batch.num_drafts, 0, K)[batch.seq_ids]
            positions = jnp.where(dec_tok & (j > row_k_tok), -1, positions)
        tokens = jnp.where(dec_tok & (j == 0), state.pending[batch.slots][batch.seq_ids],
                           batch.tokens)
        if K:
            tokens = jnp.where(dec_tok & (j >= 1),
                               drafts[batch.seq_ids, jnp.clip(j - 1, 0, K - 1)], tokens)
        pb = PagedBatch(positions=positions, seq_ids=batch.seq_ids,
                        block_tables=batch.block_tables, kv_lens=kv_lens, cu_q_lens=cu)
        hidden, cache = forward_cached(params, cfg, state.cache, tokens, pb, backend=backend)
        rows = jnp.where(is_dec[:, None], cu[:-1, None] + jnp.arange(K + 1)[None, :],
                         (cu[1:] - 1)[:, None])
        logits = logits_from_hidden(params, hidden[jnp.clip(rows, 0, T - 1)])   # [R, K+1, V]
        if batch.sampling.token_bitmask is not None:
            # structured output: every later use (acceptance, sampling, logprobs) sees the
            # grammar's masks; a batch without grammar rows has no bitmask and traces none of it
            logits = apply_token_bitmask(logits, batch.sampling.token_bitmask)

    live = batch.kinds != KIND_PAD
    s = batch.slots
    # penalty modes: each row's token history rides in its SamplingArrays (others: unread)
    history = state.history if batch.sampling.mode in PENALTY_MODES else None
    if batch.sampling.mode in PENALTY_MODES and history is None:
        raise ValueError(f"sampling mode {batch.sampling.mode!r} needs SlotState.history (the "
                         f"penalties' token history), got None")
    sp = batch.sampling if history is None else batch.sampling.replace(history=history[s])

    def commit_history(tokens, num):
        """{"history": after the first num[r] of tokens[r] (int32[R, J]) count as output}, or
        {} outside the penalty modes."""
        if history is None:
            return {}
        add = (jnp.arange(tokens.shape[1])[None, :] < num[:, None]).astype(jnp.int32)
        return dict(history=history.at[s[:, None], tokens].add(add, mode="drop"))

    def track(new_len, pending):
        """Per-slot N and pending token after the step (the next decode's inputs)."""
        return dict(seq_len=state.seq_len.at[s].set(jnp.where(live, new_len, state.seq_len[s])),
                    pending=state.pending.at[s].set(jnp.where(live, pending, state.pending[s])))

    if spec is None:
        key_pos = jnp.where(is_dec, start + 1, kv_lens)
        tok = sample(logits[:, 0], sp, key_pos)
        committed = (is_dec | is_last).astype(jnp.int32)
        new_len = jnp.where(is_dec, start + 1, kv_lens)
        pending = jnp.where(is_dec | is_last, tok, batch.next_tokens[:, 0])
        out = (state.replace(cache=cache, **track(new_len, pending),
                             **commit_history(tok[:, None], committed)), tok[:, None], committed)
        if logprobs:
            out += (step_logprobs(logits[:, :1], tok[:, None], sp,
                                  _want(batch, R), logprobs),)
        return out

    with jax.named_scope("accept"):
        row_k = K if batch.num_drafts is None else jnp.clip(batch.num_drafts, 0, K)
        # a decode row of q_len tokens verifies at most q_len - 1 drafts
        row_k = jnp.minimum(row_k, jnp.maximum(q_len - 1, 0))
        num_drafts = jnp.where(is_dec, row_k, 0).astype(jnp.int32)
        key_pos = jnp.where(is_dec, start + 1, kv_lens)
        thinking_in = jnp.where(is_dec, state.in_thinking[batch.slots], batch.thinking)
        acc, num_acc, thinking = apply_acceptance(spec, logits, drafts, probs, num_drafts,
                                                  thinking_in, sp, key_pos,
                                                  own_drafts=True)
        committed = jnp.where(is_dec, num_acc, jnp.where(is_last, 1, 0)).astype(jnp.int32)
        new_len = jnp.where(is_dec, start + num_acc, jnp.where(is_chunk, kv_lens, 0))
        pending = jnp.where(is_dec, jnp.take_along_axis(acc, (num_acc - 1)[:, None], 1)[:, 0],
                            jnp.where(is_last, acc[:, 0], batch.next_tokens[:, 0]))
        # the drafter proposes after this step's tokens: they count in its penalties
        new_history = commit_history(acc, committed)
        draft_sp = sp.replace(history=new_history["history"][s]) if new_history else sp

    with jax.named_scope("draft_inputs"):
        # ragged first pass: row r covers positions [new_len - L, new_len - 1]
        # chain: a decode's window is its q_len (>= the positions it commits); multi_layer's
        # window reaches W back whatever it commits
        L_dec = q_len if spec.method == "chain" else W
        L = jnp.where(is_dec, L_dec, jnp.where(is_chunk, jnp.maximum(W, q_len), 0))
        cu_f = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(L).astype(jnp.int32)])
        f = jnp.arange(F)
        # compare_all: searchsorted's default is a while loop (a host round trip per
        # iteration on the GPU)
        r_of = jnp.clip(jnp.searchsorted(cu_f, f, side="right", method="compare_all") - 1,
                        0, R - 1)
        in_batch = f < cu_f[R]
        pos = new_len[r_of] - L[r_of] + (f - cu_f[r_of])
        valid = in_batch & (pos >= 0) & (pos >= batch.hist_from[r_of])
        from_step = pos >= start[r_of]
        step_row = jnp.clip(cu[r_of] + pos - start[r_of], 0, T - 1)
        hist_idx = jnp.clip(W - (start[r_of] - pos), 0, W - 1)
        h0 = jnp.where(from_step[:, None], hidden[step_row],
                       old_hidden[r_of, hist_idx].astype(hidden.dtype))
        # the token one past each position
        acc_idx = jnp.clip(pos - start[r_of], 0, K)
        chunk_next = jnp.where(pos + 1 < kv_lens[r_of],
                               tokens[jnp.clip(step_row + 1, 0, T - 1)], pending[r_of])
        tok_step = jnp.where(is_dec[r_of], acc[r_of, acc_idx], chunk_next)
        t0 = jnp.where(from_step, tok_step, old_tokens[r_of, hist_idx])
        pos = jnp.where(valid, pos, -1)
        t0 = jnp.where(valid, t0, 0)
        h0 = jnp.where(valid[:, None], h0, 0)
        window = PagedBatch(positions=pos, seq_ids=r_of, block_tables=batch.block_tables,
                            kv_lens=new_len, cu_q_lens=cu_f)
        next_same = (f + 1 < cu_f[r_of + 1]) & in_batch
        last_rows = jnp.clip(cu_f[1:] - 1, 0, F - 1)
        # new history = positions [N' - W, N' - 1]: the window's entries where it covers them
        # (its last W when L >= W), the old history's (positions [N - W, N - 1]) before that
        hist_pos = new_len[:, None] - W + jnp.arange(W)[None, :]                  # [R, W]
        in_window = hist_pos >= (new_len - L)[:, None]
        tail = jnp.clip(cu_f[1:, None] - W + jnp.arange(W)[None, :], 0, F - 1)     # [R, W]
        kept = jnp.clip(hist_pos - start[:, None] + W, 0, W - 1)                   # [R, W]
        shifted_tokens = jnp.take_along_axis(old_tokens, kept, axis=1)
        shifted_hidden = jnp.take_along_axis(old_hidden, kept[:, :, None], axis=1)
        hist_tokens = jnp.where(in_window, t0[tail], shifted_tokens)
        hist_hidden = jnp.where(in_window[:, :, None], h0[tail].astype(old_hidden.dtype),
                                shifted_hidden)
        hist_tokens = jnp.where(live[:, None], hist_tokens, old_tokens)
        hist_hidden = jnp.where(live[:, None, None], hist_hidden, old_hidden)

    with jax.named_scope("draft"):
        fixed = jnp.where((batch.kinds == KIND_CHUNK)[:, None], batch.next_tokens[:, 1:], -1)
        cache, new_drafts, new_probs = run_drafts(
            params, cfg, spec, cache, window=window, hidden0=h0, tokens0=t0,
            next_same=next_same, last_rows=last_rows, seq_len=new_len,
            block_tables=batch.block_tables, sp=draft_sp, backend=backend,
            drafting=is_dec | is_last | is_resume, fixed_next=fixed, source=draft_source,
            forced=forced, passes=draft_passes)

    state = SlotState(
        cache=cache,
        hist_tokens=state.hist_tokens.at[s].set(hist_tokens),
        hist_hidden=state.hist_hidden.at[s].set(hist_hidden.astype(state.hist_hidden.dtype)),
        drafts=state.drafts.at[s].set(new_drafts),
        draft_probs=state.draft_probs.at[s].set(new_probs),
        in_thinking=state.in_thinking.at[s].set(
            jnp.where(is_dec | is_last, thinking,
                      jnp.where(is_resume, batch.thinking, state.in_thinking[s]))),
        **track(new_len, pending), **new_history)
    if logprobs:
        return state, acc, committed, step_logprobs(logits, acc, sp,
                                                    _want(batch, R), logprobs)
    return state, acc, committed


def _want(batch: MixedBatch, R: int):
    return jnp.ones((R,), bool) if batch.want_logprobs is None else batch.want_logprobs
