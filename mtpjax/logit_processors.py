"""The logit processors that change which token wins: one entry point, `process_logits`, called
wherever a distribution is made from logits (plain sampling, the verify window's acceptance,
the drafter's proposal, reported logprobs), so all of them see the same processed logits and
rejection sampling compares the distributions plain decoding samples from.

Order (vLLM's sampler): logit_bias, then the penalties, both on the raw logits, then (in
`sampling`) temperature, min_p, top-k and top-p. Penalties, vLLM's definitions, per row:

    repetition_penalty r   a token in the prompt or the output: x > 0 -> x / r, else x * r
    frequency_penalty f    x -= f * (count of the token in the output)
    presence_penalty p     x -= p * (token in the output)

Under speculation the distribution at verify position j (and at draft step j) is the one plain
decoding would have used after the j drafts before it were generated: drafts 0..j-1 count as
output. The row's history (`history`, int32[B, V]: output count in the low bits, PROMPT_FLAG
when the token is in the prompt) is applied densely once per row and broadcast over the window;
the drafts are then a sparse correction: each drafted id gets its value recomputed with its
count raised by the drafts before j, a scatter of K * (K + 1) entries per row instead of a
[B, K+1, V] count array.

A batch's static mode (`sampling.sampling_mode`) decides what runs: outside the penalty modes
none of the penalty code is traced, outside the feature modes nothing at all.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.sampling import PENALTY_MODES, SamplingArrays, apply_logit_bias

# history entry = output count | PROMPT_FLAG (token in the prompt); one int32 per token id
PROMPT_FLAG = 1 << 30
COUNT_MASK = PROMPT_FLAG - 1


def process_logits(logits: jax.Array, sp: SamplingArrays, *, drafts=None, num_drafted=None,
                   vocab_ids=None) -> jax.Array:
    """logits [B, V] or [B, J, V] after the batch mode's processors (unchanged, not even cast,
    in a mode without them; f32 otherwise).

    drafts int32[B, K]: the row's drafts, counted as output on top of `sp.history`: at window
    position j of [B, J, V] logits the first j of them (`num_drafted` defaults to arange(J));
    for [B, V] logits (one draft step) the first `num_drafted` (an int, traced or not).
    vocab_ids int32[N]: the logits are over that subset of the vocabulary (a draft vocabulary).
    """
    logits = apply_logit_bias(logits, sp, vocab_ids)
    if sp.mode not in PENALTY_MODES:
        return logits
    return apply_penalties(logits, sp.history, sp.repetition_penalty, sp.presence_penalty,
                           sp.frequency_penalty, drafts=drafts, num_drafted=num_drafted,
                           vocab_ids=vocab_ids)


def _penalize(x, count, in_prompt, rep, pres, freq):
    """vLLM's three penalties, elementwise: x f32, count int32 (in the output), in_prompt bool;
    rep / pres / freq broadcast against x. Off values (1, 0, 0) return x exactly."""
    in_output = count > 0
    x = jnp.where(in_prompt | in_output, jnp.where(x > 0, x / rep, x * rep), x)
    return x - freq * count.astype(jnp.float32) - pres * in_output.astype(jnp.float32)


def apply_penalties(logits, history, repetition, presence, frequency, *, drafts=None,
                    num_drafted=None, vocab_ids=None):
    """logits [B, X] or [B, J, X] penalized by each row's history int32[B, V] and its drafts
    (`process_logits`); repetition / presence / frequency f32[B]. X = V, or N with vocab_ids
    int32[N] (the subset the logits are over)."""
    single = logits.ndim == 2
    x = logits.astype(jnp.float32)
    x = x[:, None] if single else x
    B, J, X = x.shape
    V = history.shape[-1]
    h = history if vocab_ids is None else history[:, vocab_ids]                   # [B, X]
    count, in_prompt = h & COUNT_MASK, h >= PROMPT_FLAG
    rep, pres, freq = (a.astype(jnp.float32)[:, None, None]
                       for a in (repetition, presence, frequency))
    out = _penalize(x, count[:, None], in_prompt[:, None], rep, pres, freq)
    if drafts is not None and drafts.shape[1]:
        K = drafts.shape[1]
        n = jnp.arange(J) if num_drafted is None else num_drafted
        n = jnp.broadcast_to(jnp.asarray(n, jnp.int32).reshape((-1, J) if not single else
                                                               (-1, 1)), (B, J))
        valid = (drafts >= 0) & (drafts < V)                                      # [B, K]
        ids = jnp.clip(drafts, 0, V - 1)
        if vocab_ids is None:
            col = ids
        else:       # the draft's entry in the subset, X where it has none
            where = jnp.full((V,), X, jnp.int32).at[vocab_ids].set(jnp.arange(X, dtype=jnp.int32))
            col = where[ids]
        col = jnp.where(valid, col, X)
        counted = jnp.arange(K)[None, None, :] < n[:, :, None]                    # [B, J, K]
        same = drafts[:, :, None] == drafts[:, None, :]                           # [B, K, K]
        # extra[b, j, i]: drafts before position j with draft i's id
        extra = jnp.sum(same[:, None] & counted[:, :, None, :], axis=-1)          # [B, J, K]
        c = jnp.clip(col, 0, X - 1)
        base = jnp.take_along_axis(count, c, axis=1)[:, None] + extra
        prompt = jnp.take_along_axis(in_prompt, c, axis=1)[:, None]
        raw = jnp.take_along_axis(x, jnp.broadcast_to(c[:, None], (B, J, K)), axis=2)
        val = _penalize(raw, base, jnp.broadcast_to(prompt, (B, J, K)), rep, pres, freq)
        # only the ids drafted before j change (duplicates write the same value)
        tgt = jnp.where(counted & (col[:, None] < X), col[:, None], X)
        out = out.at[jnp.arange(B)[:, None, None], jnp.arange(J)[None, :, None], tgt].set(
            val, mode="drop")
    return out[:, 0] if single else out
