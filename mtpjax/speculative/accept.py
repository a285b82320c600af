"""Acceptance rules: pure, batched, jittable, with per-request parameters.

All return (accepted_tokens int32[B, K+1], num_accepted int32[B]); num_accepted counts the bonus
(or correction) token, so it is in 1..num_drafts+1. Row b commits accepted_tokens[b, :num_accepted[b]]:
the accepted drafts followed by the target's own token at the first rejection (or the bonus
token after the last draft). A request with num_drafts == 0 (just prefilled) takes one token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.sampling import filtered_probs, position_keys, sample_from_probs


def _prefix_len(ok: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """Length of the all-True prefix of ok [B, K], limited to num_drafts [B]."""
    K = ok.shape[1]
    ok = ok & (jnp.arange(K)[None, :] < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def accept_greedy(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array):
    """Exact-match acceptance against the target's argmax (TensorRT-LLM's strict rule).

    target_logits [B, K+1, V]; draft_tokens int32[B, K]; num_drafts int32[B].
    """
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)          # [B, K+1]
    n = _prefix_len(draft_tokens == target[:, :-1], num_drafts)
    return target, (n + 1).astype(jnp.int32)


def accept_rejection(target_probs: jax.Array, draft_probs: jax.Array, draft_tokens: jax.Array,
                     num_drafts: jax.Array, keys: jax.Array):
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    target_probs [B, K+1, V] and draft_probs [B, K, V] are the *filtered* distributions
    (temperature / top-k / top-p applied identically, see sampling.filtered_probs); draft i was
    drawn from draft_probs[:, i]. Draft i is kept with probability min(1, p(d)/q(d)); at the first
    rejection the token is drawn from normalize(max(p - q, 0)); if all drafts are kept the bonus
    token is drawn from p at position K. keys uint32[B, 2] are this step's per-request keys.
    Greedy requests have one-hot p and q, which makes this exact-match acceptance.
    """
    B, K1, V = target_probs.shape
    K = K1 - 1
    k_accept, k_resample = jax.vmap(lambda k: jax.random.split(k, 2))(keys).transpose(1, 0, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(k_accept)                # [B, K]
    p_d = jnp.take_along_axis(target_probs[:, :K], draft_tokens[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], -1)[..., 0]
    ok = u * q_d < p_d                                   # u < p/q without dividing by zero
    n = _prefix_len(ok, num_drafts)                      # accepted drafts, [B]
    # Distribution of the token after the accepted drafts: residual at a rejection, p at the end.
    p_n = jnp.take_along_axis(target_probs, n[:, None, None], 1)[:, 0]           # [B, V]
    q_pad = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], 1)[:, 0]
    rejected = (n < num_drafts)[:, None]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p == q, where a rejection has probability 0; fall back to p then.
    dist = jnp.where(rejected & (mass > 0), residual / jnp.where(mass > 0, mass, 1.0), p_n)
    last = sample_from_probs(dist, k_resample)
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(K1)[None, :] == n[:, None], last[:, None], drafts_pad)
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


def accept_coupled(target_probs: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                   keys: jax.Array):
    """Coupled acceptance (lossless, reproducible): draft i is kept iff it equals the target's
    own sample at its position, drawn with that position's key.

    target_probs [B, K+1, V] filtered; draft_tokens int32[B, K]; num_drafts int32[B];
    keys uint32[B, K+1, 2]: keys[b, j] = fold_in(request key, position of the j-th committed
    token), the key plain decoding samples that position with (`sampling.sample`), and the key
    the draft at that position was drawn with. Every committed token is the target's sample
    `sample_from_probs(p_j, keys[j])` given the (identical) prefix, so the output is token for
    token that of plain seeded sampling: lossless by construction, independent of K, of the
    drafts and of where verify windows fall. `jax.random.categorical` is Gumbel-max,
    argmax(log p + g): target and draft share the noise g, so a draft is accepted iff
    argmax(log q + g) == argmax(log p + g) (less often than rejection sampling's
    1 - TV(p, q) in general; docs/spec_decoding.md has measurements).
    """
    B, K1, V = target_probs.shape
    target = sample_from_probs(target_probs.reshape(B * K1, V),
                               keys.reshape(B * K1, -1)).reshape(B, K1)
    n = _prefix_len(draft_tokens == target[:, :-1], num_drafts)
    return target.astype(jnp.int32), (n + 1).astype(jnp.int32)


def _rejection_when_greedy(target_logits, draft_tokens, num_drafts):
    """accept_rejection's exact output when every target distribution p is one-hot (greedy
    requests), whatever the draft distributions q: draft d is kept iff u * q(d) < p(d), i.e. iff
    d is the argmax; the residual max(p - q, 0) at a rejection, like p after the last draft, has
    all its mass on the argmax. No softmax, uniform or categorical draw is needed."""
    K = draft_tokens.shape[1]
    target = jnp.argmax(target_logits.astype(jnp.float32), axis=-1).astype(jnp.int32)  # [B, K+1]
    n = _prefix_len(draft_tokens == target[:, :-1], num_drafts)
    last = jnp.take_along_axis(target, n[:, None], axis=1)
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(K + 1)[None, :] == n[:, None], last, drafts_pad)
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


def accept_relaxed(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                   in_thinking: jax.Array, *, topk: int, delta: float, think_start: int,
                   think_end: int):
    """Relaxed acceptance for thinking models (TensorRT-LLM's rule; LOSSY, opt-in).

    While a request is inside its thinking phase (after `think_start`, before `think_end`), draft i
    is accepted if it is among the target's top-`topk` tokens at its position and its probability
    is at least top-1 probability minus `delta`. Outside thinking, and for the think markers
    themselves, acceptance is exact-match on the argmax. The correction / bonus token is the
    target's argmax. in_thinking bool[B] is the phase after the committed tokens; returns
    (accepted_tokens, num_accepted, in_thinking after the committed tokens).
    """
    B, K1, V = target_logits.shape
    K = K1 - 1
    probs = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, topk)                                    # [B, K+1, topk]
    target = top_i[..., 0].astype(jnp.int32)

    def phase_after(phase, tok):
        return jnp.where(tok == think_start, True, jnp.where(tok == think_end, False, phase))

    def per_position(phase, i):
        d = draft_tokens[:, i]
        in_top = jnp.any((top_i[:, i] == d[:, None]) &
                         (top_p[:, i] >= top_p[:, i, :1] - delta), axis=-1)
        marker = (d == think_start) | (d == think_end)
        ok = jnp.where(phase & ~marker, in_top, d == target[:, i])
        return phase_after(phase, d), ok

    # unrolled: K is small and a rolled scan is an XLA while loop (a host round trip per
    # iteration on the GPU; tests/test_no_host_round_trips.py)
    _, ok = jax.lax.scan(per_position, in_thinking, jnp.arange(K), unroll=True)
    n = _prefix_len(ok.T, num_drafts)
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    pos = jnp.arange(K1)[None, :]
    tokens = jnp.where(pos < n[:, None], drafts_pad, target).astype(jnp.int32)
    num = (n + 1).astype(jnp.int32)

    def commit_phase(phase, j):
        return jnp.where(j < num, phase_after(phase, tokens[:, j]), phase), None

    phase, _ = jax.lax.scan(commit_phase, in_thinking, jnp.arange(K1), unroll=True)
    return tokens, num, phase


def accept_synthetic(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array,
                     rates: jax.Array, keys: jax.Array):
    """BENCHMARK-ONLY: draft i is accepted with probability rates[i] (given the previous ones),
    whatever the models say, so random-weight models show realistic acceptance lengths. The
    output is NOT the target's distribution. Correction / bonus token: the target's argmax.
    """
    B, K1, V = target_logits.shape
    u = jax.vmap(lambda k: jax.random.uniform(k, (K1 - 1,)))(keys)
    n = _prefix_len(u < rates[None, :], num_drafts)
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    drafts_pad = jnp.concatenate([draft_tokens, jnp.zeros_like(draft_tokens[:, :1])], axis=1)
    tokens = jnp.where(jnp.arange(K1)[None, :] < n[:, None], drafts_pad, target)
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


def apply_acceptance(spec, logits, drafts, draft_probs, num_drafts, in_thinking, sp, key_positions):
    """The rule `spec.acceptance` names, for every request of a batch.

    logits f32[B, K+1, V]; drafts int32[B, K]; draft_probs f32[B, K, V]; num_drafts int32[B];
    in_thinking bool[B]; sp: SamplingArrays; key_positions int32[B]: position of the first token
    this step commits (its key is fold_in(request key, position), stream 1).
    Returns (accepted_tokens [B, K+1], num_accepted [B], in_thinking [B]).
    """
    keys = jax.vmap(jax.random.fold_in)(position_keys(sp.keys, key_positions),
                                        jnp.full(key_positions.shape, 1, jnp.uint32))
    if spec.acceptance == "greedy":
        return (*accept_greedy(logits, drafts, num_drafts), in_thinking)
    if spec.acceptance == "coupled":
        K1 = logits.shape[1]
        pos = key_positions[:, None] + jnp.arange(K1, dtype=key_positions.dtype)[None, :]
        pkeys = jax.vmap(position_keys, in_axes=(None, 1), out_axes=1)(sp.keys, pos)  # [B,K+1,2]

        if sp.mode == "greedy":      # one-hot p: the target's own sample is its argmax
            return (*_rejection_when_greedy(logits, drafts, num_drafts), in_thinking)
        p = filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p, sp.mode)
        return (*accept_coupled(p, drafts, num_drafts, pkeys), in_thinking)
    if spec.acceptance == "rejection":
        if sp.mode == "greedy":
            # every p is one-hot, where rejection sampling is exact match (the same output)
            return (*_rejection_when_greedy(logits, drafts, num_drafts), in_thinking)
        p = filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p, sp.mode)
        return (*accept_rejection(p, draft_probs, drafts, num_drafts, keys), in_thinking)
    if spec.acceptance == "relaxed":
        return accept_relaxed(logits, drafts, num_drafts, in_thinking, topk=spec.relaxed_topk,
                              delta=spec.relaxed_delta, think_start=spec.think_start_token_id,
                              think_end=spec.think_end_token_id)
    rates = jnp.asarray(spec.synthetic_rates(), jnp.float32)
    return (*accept_synthetic(logits, drafts, num_drafts, rates, keys), in_thinking)
