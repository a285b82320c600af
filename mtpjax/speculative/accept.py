"""Acceptance rules: pure, batched, jittable, with per-request parameters.

All return (accepted_tokens int32[B, K+1], num_accepted int32[B]); num_accepted counts the bonus
(or correction) token, so it is in 1..num_drafts+1. Row b commits accepted_tokens[b, :num_accepted[b]]:
the accepted drafts followed by the target's own token at the first rejection (or the bonus
token after the last draft). A request with num_drafts == 0 (just prefilled) takes one token.

Input contract (research code calls these directly; the engine and `generate` always meet it):
  - target [B, K+1, V] (logits or probabilities, as each rule names), draft_tokens int32[B, K],
    num_drafts int32[B], K >= 0. K = 0 (no draft slots) is allowed: every row takes one token.
  - 0 <= num_drafts[b] <= K. Draft entries past num_drafts[b] are ignored (any value, e.g. -1).
  - draft_tokens[b, i] in [0, V) for i < num_drafts[b].
  - probabilities (target_probs, draft_probs) are distributions over V: finite, >= 0, summing
    to 1; draft i was sampled from draft_probs[b, i], so draft_probs[b, i, draft] > 0.
Shapes are checked when the rule is traced (ValueError). On the device, without a host check,
a draft id outside [0, V) is never accepted (the row commits the target's token there; an
unchecked -1 would otherwise read probability V-1 and be committed as -1), num_drafts is
clipped to [0, K], and `accept_rejection` rejects a draft whose draft probability is not > 0
(the drafter cannot have sampled it; vLLM's rejection sampler does the same). For inputs that
meet the contract these change nothing. `checked(rule)` runs a rule with every clause checked
(`jax.experimental.checkify`), raising on the first violation; `contract_checks` issues the
same checks inside a function the caller checkifies itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from mtpjax.logit_processors import process_logits
from mtpjax.sampling import position_keys, sample_from_probs
from mtpjax.speculative.rules.registry import AcceptInputs, acceptance_rule


def _check_shapes(name: str, target, draft_tokens, num_drafts, draft_probs=None) -> int:
    """Static shape checks of the contract (free: they run at trace time); returns K."""
    if target.ndim != 3 or target.shape[1] < 1:
        raise ValueError(f"{name}: target must be [B, K+1, V] with K >= 0, got shape "
                         f"{tuple(target.shape)}")
    B, K1, V = target.shape
    if tuple(draft_tokens.shape) != (B, K1 - 1):
        raise ValueError(f"{name}: draft_tokens must be [B, K] = {(B, K1 - 1)} (target is "
                         f"{tuple(target.shape)}), got shape {tuple(draft_tokens.shape)}")
    if not jnp.issubdtype(draft_tokens.dtype, jnp.integer):
        raise ValueError(f"{name}: draft_tokens must be integer token ids, got dtype "
                         f"{draft_tokens.dtype}")
    if tuple(num_drafts.shape) != (B,):
        raise ValueError(f"{name}: num_drafts must be [B] = {(B,)}, got shape "
                         f"{tuple(num_drafts.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (B, K1 - 1, V):
        raise ValueError(f"{name}: draft_probs must be [B, K, V] = {(B, K1 - 1, V)}, got shape "
                         f"{tuple(draft_probs.shape)}")
    return K1 - 1


def _prefix_len(ok: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """Length of the all-True prefix of ok [B, K], limited to num_drafts [B]."""
    K = ok.shape[1]
    ok = ok & (jnp.arange(K)[None, :] < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def _valid_drafts(draft_tokens, V: int):
    """bool[B, K]: draft ids inside the vocabulary (others are never accepted)."""
    return (draft_tokens >= 0) & (draft_tokens < V)


def _pad_one(x):
    """x [B, K, ...] with one zero entry appended on axis 1 (also for K = 0)."""
    return jnp.concatenate([x, jnp.zeros((x.shape[0], 1) + x.shape[2:], x.dtype)], axis=1)


def contract_checks(draft_tokens, num_drafts, target, *, draft_probs=None,
                    target_is_probs: bool = False, atol: float = 1e-3) -> None:
    """`checkify.check`s of the input contract (module docstring), for use inside a function
    the caller wraps with `checkify.checkify` (e.g. `jax.jit(checkify.checkify(f))`). target
    [B, K+1, V] (probabilities when target_is_probs); draft_probs [B, K, V] or None; atol:
    tolerance of the sums to 1."""
    K = _check_shapes("contract_checks", target, draft_tokens, num_drafts, draft_probs)
    V = target.shape[-1]
    nd = jnp.asarray(num_drafts)
    checkify.check(jnp.all((nd >= 0) & (nd <= K)),
                   f"num_drafts must be in [0, K={K}], got {{nd}}", nd=nd)
    live = jnp.arange(K)[None, :] < nd[:, None]
    checkify.check(jnp.all(~live | _valid_drafts(draft_tokens, V)),
                   f"draft_tokens[b, i] for i < num_drafts[b] must be in [0, V={V}), got "
                   "{d} (num_drafts {nd})", d=draft_tokens, nd=nd)

    def distribution(name, x):
        x = x.astype(jnp.float32)
        checkify.check(jnp.all(jnp.isfinite(x) & (x >= 0)),
                       f"{name} must be finite and >= 0 (a distribution over V)")
        sums = jnp.sum(x, axis=-1)
        checkify.check(jnp.all(jnp.abs(sums - 1) <= atol),
                       f"{name} rows must sum to 1 (within {atol}), got sums {{s}}", s=sums)

    if target_is_probs:
        distribution("target_probs", target)
    else:
        checkify.check(jnp.all(~jnp.isnan(target)), "target_logits must not be NaN")
    if draft_probs is not None:
        distribution("draft_probs", draft_probs)
        q_d = jnp.take_along_axis(draft_probs, jnp.clip(draft_tokens, 0, V - 1)[..., None],
                                  -1)[..., 0]
        checkify.check(jnp.all(~live | (q_d > 0)),
                       "draft_probs[b, i, draft_tokens[b, i]] must be > 0 for i < num_drafts[b] "
                       "(draft i is sampled from draft_probs[b, i]), got {q}", q=q_d)


def checked(rule):
    """`rule` (accept_greedy, accept_rejection, accept_coupled, accept_relaxed or
    accept_synthetic) with its input contract checked on every call: raises
    `checkify.JaxRuntimeError` naming the first violated clause, else returns the rule's
    output. For research code and tests (it adds a host read of the error per call); e.g.
    `checked(accept_rejection)(target_probs, draft_probs, draft_tokens, num_drafts, keys)`."""
    name = rule.__name__
    if name not in _CONTRACT_ARGS:
        raise ValueError(f"checked() takes one of {sorted(_CONTRACT_ARGS)}, got {name}")

    @functools.wraps(rule)
    def run(*args, **kwargs):
        err, out = _checked_program(rule, tuple(sorted(kwargs.items())))(*args)
        err.throw()
        return out

    return run


@functools.lru_cache(maxsize=None)
def _checked_program(rule, kw_items):
    """`rule` with its contract checks, checkified and jitted once per rule and keyword
    arguments (relaxed's topk, delta, ...); run op by op, every primitive compiled alone."""
    kwargs = dict(kw_items)

    def body(*args):
        contract_checks(**_CONTRACT_ARGS[rule.__name__](*args))
        return rule(*args, **kwargs)

    return jax.jit(checkify.checkify(body))


def accept_greedy(target_logits: jax.Array, draft_tokens: jax.Array, num_drafts: jax.Array):
    """Exact-match acceptance against the target's argmax (TensorRT-LLM's strict rule).

    target_logits [B, K+1, V]; draft_tokens int32[B, K]; num_drafts int32[B] (contract: module
    docstring; an out-of-range draft never equals the argmax, so it is never accepted).
    """
    _check_shapes("accept_greedy", target_logits, draft_tokens, num_drafts)
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
    Contract: module docstring. A draft outside [0, V) or with q(d) not > 0 (the drafter
    cannot have sampled it) is rejected; K = 0 takes the token drawn from p[:, 0].
    """
    K = _check_shapes("accept_rejection", target_probs, draft_tokens, num_drafts, draft_probs)
    V = target_probs.shape[-1]
    num_drafts = jnp.clip(num_drafts, 0, K)
    k_accept, k_resample = jax.vmap(lambda k: jax.random.split(k, 2))(keys).transpose(1, 0, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (K,)))(k_accept)                # [B, K]
    valid = _valid_drafts(draft_tokens, V)
    idx = jnp.where(valid, draft_tokens, 0)[..., None]
    p_d = jnp.take_along_axis(target_probs[:, :K], idx, -1)[..., 0]
    q_d = jnp.take_along_axis(draft_probs, idx, -1)[..., 0]
    ok = valid & (q_d > 0) & (u * q_d < p_d)             # u < p/q without dividing by zero
    n = _prefix_len(ok, num_drafts)                      # accepted drafts, [B]
    # Distribution of the token after the accepted drafts: residual at a rejection, p at the end.
    p_n = jnp.take_along_axis(target_probs, n[:, None, None], 1)[:, 0]           # [B, V]
    q_n = jnp.take_along_axis(_pad_one(draft_probs), n[:, None, None], 1)[:, 0]
    rejected = (n < num_drafts)[:, None]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # mass == 0 only when p == q, where a rejection has probability 0; fall back to p then.
    dist = jnp.where(rejected & (mass > 0), residual / jnp.where(mass > 0, mass, 1.0), p_n)
    last = sample_from_probs(dist, k_resample)
    tokens = jnp.where(jnp.arange(K + 1)[None, :] == n[:, None], last[:, None],
                       _pad_one(draft_tokens))
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
    1 - TV(p, q) in general; docs/spec_decoding.md has measurements). Contract: module
    docstring (an out-of-range draft never equals the target's sample).
    """
    _check_shapes("accept_coupled", target_probs, draft_tokens, num_drafts)
    B, K1, V = target_probs.shape
    target = sample_from_probs(target_probs.reshape(B * K1, V),
                               keys.reshape(B * K1, -1)).reshape(B, K1)
    n = _prefix_len(draft_tokens == target[:, :-1], num_drafts)
    return target.astype(jnp.int32), (n + 1).astype(jnp.int32)


def draft_token_probs(draft_probs, draft_tokens):
    """q(d): f32[B, K], each draft's probability under its draft distribution [B, K, V] (ids
    outside [0, V) read entry 0; such drafts are rejected anyway)."""
    V = draft_probs.shape[-1]
    idx = jnp.clip(draft_tokens, 0, V - 1)[..., None]
    return jnp.take_along_axis(draft_probs, idx, -1)[..., 0]


def rejection_when_greedy(target_logits, draft_tokens, num_drafts, draft_q=None):
    """accept_rejection's exact output when every target distribution p is one-hot (greedy
    requests), whatever the draft distributions q: draft d is kept iff q(d) > 0 and
    u * q(d) < p(d), i.e. iff d is the argmax and q(d) > 0; the residual max(p - q, 0) at a
    rejection, like p after the last draft, has all its mass on the argmax. No softmax,
    uniform or categorical draw is needed. draft_q: q(d) f32[B, K] (`draft_token_probs`);
    None leaves that test out (coupled acceptance, whose rule never reads q)."""
    K = draft_tokens.shape[1]
    target = jnp.argmax(target_logits.astype(jnp.float32), axis=-1).astype(jnp.int32)  # [B, K+1]
    ok = draft_tokens == target[:, :-1]
    if draft_q is not None:
        ok = ok & (draft_q > 0)
    n = _prefix_len(ok, num_drafts)
    last = jnp.take_along_axis(target, n[:, None], axis=1)
    tokens = jnp.where(jnp.arange(K + 1)[None, :] == n[:, None], last, _pad_one(draft_tokens))
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
    (accepted_tokens, num_accepted, in_thinking after the committed tokens). Contract: module
    docstring (an out-of-range draft is never among the top-k nor the argmax).
    """
    _check_shapes("accept_relaxed", target_logits, draft_tokens, num_drafts)
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
    # iteration on the GPU; tests/speculative/test_no_host_round_trips.py)
    if K:
        _, ok = jax.lax.scan(per_position, in_thinking, jnp.arange(K), unroll=True)
        ok = ok.T
    else:       # no draft slots (the scan would still trace its body on a [B, 0] array)
        ok = jnp.zeros((B, 0), bool)
    n = _prefix_len(ok, num_drafts)
    pos = jnp.arange(K1)[None, :]
    tokens = jnp.where(pos < n[:, None], _pad_one(draft_tokens), target).astype(jnp.int32)
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
    Contract: module docstring (a draft outside [0, V) is never accepted).
    """
    _check_shapes("accept_synthetic", target_logits, draft_tokens, num_drafts)
    B, K1, V = target_logits.shape
    u = jax.vmap(lambda k: jax.random.uniform(k, (K1 - 1,)))(keys)
    n = _prefix_len((u < rates[None, :]) & _valid_drafts(draft_tokens, V), num_drafts)
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    tokens = jnp.where(jnp.arange(K1)[None, :] < n[:, None], _pad_one(draft_tokens), target)
    return tokens.astype(jnp.int32), (n + 1).astype(jnp.int32)


# rule name -> its arguments as contract_checks takes them
_CONTRACT_ARGS = {
    "accept_greedy": lambda logits, d, nd: dict(draft_tokens=d, num_drafts=nd, target=logits),
    "accept_rejection": lambda p, q, d, nd, keys: dict(draft_tokens=d, num_drafts=nd, target=p,
                                                       draft_probs=q, target_is_probs=True),
    "accept_coupled": lambda p, d, nd, keys: dict(draft_tokens=d, num_drafts=nd, target=p,
                                                  target_is_probs=True),
    "accept_relaxed": lambda logits, d, nd, thinking: dict(draft_tokens=d, num_drafts=nd,
                                                           target=logits),
    "accept_synthetic": lambda logits, d, nd, rates, keys: dict(draft_tokens=d, num_drafts=nd,
                                                                target=logits),
}


def apply_acceptance(spec, logits, drafts, draft_probs, num_drafts, in_thinking, sp, key_positions,
                     own_drafts: bool = False):
    """The rule `spec.acceptance` names (its registry entry, `speculative/rules/`), for every
    request of a batch.

    logits f32[B, K+1, V]; drafts int32[B, K]; draft_probs f32[B, K, V]; num_drafts int32[B];
    in_thinking bool[B]: the rule's per-slot flag (relaxed: inside thinking); sp:
    SamplingArrays; key_positions int32[B]: position of the first token this step commits (its
    key is fold_in(request key, position), stream 1).
    own_drafts (static): the drafts are those `run_drafts` drew from draft_probs in the same
    device state (mixed_step), so each has q(d) > 0 by construction. Rejection sampling's
    greedy mode then skips its q(d) > 0 test: reading q(d) would gather the [B, K, V]
    draft_probs (or, by index, add a collective on a vocabulary-split mesh) in every greedy
    step for a condition that cannot fail there. Research callers leave it False.
    Returns (accepted_tokens [B, K+1], num_accepted [B], in_thinking [B]).
    Every rule sees the logits after the batch's logit processors (`process_logits`: a no-op
    outside their modes; penalties count the drafts before each window position), as
    `draw_draft` and plain decoding (`sampling.sample`) do.
    """
    logits = process_logits(logits, sp, drafts=drafts)
    keys = jax.vmap(jax.random.fold_in)(position_keys(sp.keys, key_positions),
                                        jnp.full(key_positions.shape, 1, jnp.uint32))
    rule = acceptance_rule(spec.acceptance)
    return rule.accept(spec, AcceptInputs(logits=logits, drafts=drafts, draft_probs=draft_probs,
                                          num_drafts=num_drafts, flag=in_thinking, sampling=sp,
                                          key_positions=key_positions, keys=keys,
                                          own_drafts=own_drafts))
