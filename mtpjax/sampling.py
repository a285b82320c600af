"""Per-request sampling on device: temperature, top-k, top-p, greedy, all as arrays.

`filtered_probs` is the one place the sampling transform is defined; rejection sampling applies
it to target and draft logits alike, so acceptance is lossless for the *filtered* distribution.
A greedy request (temperature 0) gets the one-hot distribution of its argmax.

Work that no request of a batch needs is skipped by a *static* sampling mode that the host
chooses from the batch's SamplingParams (`sampling_mode`), never by a device-side `lax.cond`:
on a GPU every `lax.cond` copies its predicate to the host and blocks the launching thread
until everything before it has run, which made each engine step synchronous (measured on an
H100: the jitted step's dispatch took as long as the step itself, 9.5 ms at the 8B shape, so
none of the host's work overlapped the device; docs/benchmarks.md). Modes:

  "greedy"  every row has temperature <= 0: argmax only (no softmax, no sort, no draw)
  "filter"  any other batch: temperature, then top-k and top-p (two vocabulary sorts) on every
            row; a row that asks for neither passes through masks that change nothing
  "greedy_bias", "filter_full"  the same with the logit processors some row asks for:
            logit_bias (added to the logits first, so a greedy row's argmax is the biased one)
            and min_p (after temperature). Only a batch with such a row gets these modes, so
            every other batch runs exactly the program it ran before they existed; the engine
            compiles them on first use (`FEATURE_MODES`, not warmed up)
  "greedy_penalty", "filter_penalty"  the feature modes plus repetition / presence /
            frequency penalties over each row's token history (`mtpjax.logit_processors`),
            for batches where some row has a penalty (`PENALTY_MODES`, engine only)

A greedy row's result is the one-hot argmax in both modes, so no row depends on the mode, nor
on batch composition. (A third mode without the sorts for batches that sample without top-k /
top-p was tried: XLA fuses the softmax differently there and its probabilities differed from
the filter mode's in the last bit, which would make a seeded token depend on its batch.)
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtpjax.config import LOGIT_BIAS_MAX, LOGIT_BIAS_SLOTS, SamplingParams  # noqa: F401


@struct.dataclass
class SamplingArrays:
    """SamplingParams of B requests as device arrays."""

    temperature: jax.Array   # f32[B]    0 = greedy
    top_k: jax.Array         # int32[B]  0 = off
    top_p: jax.Array         # f32[B]    1 = off
    keys: jax.Array          # uint32[B, 2] per-request base PRNG keys
    # the logit processors (FEATURE_MODES only; None in the other modes, which never read them)
    min_p: jax.Array | None = None       # f32[B]   0 = off
    bias_ids: jax.Array | None = None    # int32[B, LOGIT_BIAS_SLOTS] token ids (0 where unused)
    bias_vals: jax.Array | None = None   # f32[B, LOGIT_BIAS_SLOTS] biases (0 where unused)
    # the penalties (PENALTY_MODES only; 1, 0, 0 = off) and each row's token history
    repetition_penalty: jax.Array | None = None   # f32[B]
    presence_penalty: jax.Array | None = None     # f32[B]
    frequency_penalty: jax.Array | None = None    # f32[B]
    history: jax.Array | None = None     # int32[B, V] output counts | PROMPT_FLAG (logit_processors)
    # structured output (engine steps with a grammar row only; None elsewhere): bit v of each
    # row and verify position allows token v (mtpjax.structured.bitmask; all ones: no grammar)
    token_bitmask: jax.Array | None = None   # int32[B, K+1, ceil(V/32)]
    mode: str = struct.field(pytree_node=False, default="filter")   # static: ALL_SAMPLING_MODES

    @classmethod
    def build(cls, params: Sequence[SamplingParams], base_seed: int = 0) -> "SamplingArrays":
        keys = [request_key(p, base_seed, i) for i, p in enumerate(params)]
        temperature = np.asarray([p.temperature for p in params], np.float32)
        top_k = np.asarray([p.top_k for p in params], np.int32)
        top_p = top_p_array([p.top_p for p in params])
        mode = sampling_mode(temperature, params)
        extra = {}
        if mode in FEATURE_MODES:
            min_p, ids, vals = feature_arrays(params)
            extra = dict(min_p=jnp.asarray(min_p), bias_ids=jnp.asarray(ids),
                         bias_vals=jnp.asarray(vals))
        if mode in PENALTY_MODES:      # the history is the caller's (the engine's device state)
            extra.update(zip(PENALTY_FIELDS, map(jnp.asarray, penalty_arrays(params))))
        return cls(temperature=jnp.asarray(temperature), top_k=jnp.asarray(top_k),
                   top_p=jnp.asarray(top_p), keys=jnp.asarray(np.stack(keys)), mode=mode,
                   **extra)


SAMPLING_MODES = ("greedy", "filter")           # the modes warmup compiles
PENALTY_MODES = ("greedy_penalty", "filter_penalty")   # + penalties (module doc)
# with logit_bias / min_p (module doc); the penalty modes have them too
FEATURE_MODES = ("greedy_bias", "filter_full") + PENALTY_MODES
ALL_SAMPLING_MODES = SAMPLING_MODES + FEATURE_MODES
# every row greedy: the one-hot argmax only
GREEDY_MODES = ("greedy", "greedy_bias", "greedy_penalty")
MIN_P_MODES = ("filter_full", "filter_penalty")            # the sampled modes that apply min_p
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")


# The smallest positive normal float32. A top_p that SamplingParams accepts (any p in (0, 1])
# can be a subnormal or 0 once it is float32, and the device flushes subnormals to zero; at
# p = 0 no token would be in the nucleus (every probability zeroed, the draw NaN: token 0).
TOP_P_MIN = float(np.finfo(np.float32).tiny)


def top_p_array(top_p) -> np.ndarray:
    """Host side: top_p values as float32 [B], each clamped to [TOP_P_MIN, 1] in float64 first,
    so a tiny nucleus stays positive on the device (it keeps exactly the top token)."""
    return np.clip(np.asarray(top_p, np.float64), TOP_P_MIN, 1.0).astype(np.float32)


def sampling_mode(temperature, params: Sequence[SamplingParams | None] | None = None) -> str:
    """Host side: the mode that serves rows with these temperatures (numpy [B]) and, when given,
    these SamplingParams (None for padding rows): a feature mode only if some row has a
    logit_bias, or samples with min_p > 0 (min_p cannot change a greedy row; module doc); a
    penalty mode if some row has a penalty."""
    sampled = (np.asarray(temperature) > 0).any()
    if any(p is not None and p.has_penalties for p in params or ()):
        return "filter_penalty" if sampled else "greedy_penalty"
    bias = any(p is not None and p.logit_bias for p in params or ())
    min_p = any(p is not None and p.min_p > 0 and p.temperature > 0 for p in params or ())
    if bias or min_p:
        return "filter_full" if sampled else "greedy_bias"
    return "filter" if sampled else "greedy"


def feature_arrays(params: Sequence[SamplingParams | None]):
    """Host side: (min_p f32[B], bias_ids int32[B, LOGIT_BIAS_SLOTS], bias_vals f32[B, S]) of
    SamplingParams (None: a padding row, no processors). Unused slots add 0 to token 0."""
    B, S = len(params), LOGIT_BIAS_SLOTS
    min_p = np.zeros(B, np.float32)
    ids, vals = np.zeros((B, S), np.int32), np.zeros((B, S), np.float32)
    for i, p in enumerate(params):
        if p is None:
            continue
        min_p[i] = p.min_p
        for j, (t, b) in enumerate(p.logit_bias or ()):
            ids[i, j], vals[i, j] = t, b
    return min_p, ids, vals


def penalty_arrays(params: Sequence[SamplingParams | None]):
    """Host side: (repetition_penalty, presence_penalty, frequency_penalty), each f32[B]
    (None: a padding row, penalties off)."""
    off = SamplingParams()
    return tuple(np.asarray([getattr(p or off, name) for p in params], np.float32)
                 for name in PENALTY_FIELDS)


def apply_logit_bias(logits: jax.Array, sp: "SamplingArrays", vocab_ids=None) -> jax.Array:
    """logits [B, ..., V] plus each row's logit_bias, in f32 (modes without logit processors:
    unchanged, not even cast). vocab_ids int32[N]: logits [B, N] are over that subset of the
    vocabulary (a draft vocabulary), biased by the entries of its ids."""
    if sp.mode not in FEATURE_MODES:
        return logits
    B = sp.bias_ids.shape[0]
    if vocab_ids is not None:
        # bias over the subset: entry n gets the biases whose id is vocab_ids[n]
        hit = sp.bias_ids[:, :, None] == jnp.asarray(vocab_ids)[None, None, :]   # [B, S, N]
        dense = jnp.sum(jnp.where(hit, sp.bias_vals[:, :, None], 0.0), axis=1)
    else:
        dense = jnp.zeros((B, logits.shape[-1]), jnp.float32).at[
            jnp.arange(B)[:, None], sp.bias_ids].add(sp.bias_vals)
    dense = dense.reshape((B,) + (1,) * (logits.ndim - 2) + dense.shape[-1:])
    return logits.astype(jnp.float32) + dense


def _check_mode(mode: str) -> None:
    if mode not in ALL_SAMPLING_MODES:
        raise ValueError(f"sampling mode {mode!r} is not one of {ALL_SAMPLING_MODES}")


def request_key(sp: SamplingParams, base_seed: int, index: int) -> np.ndarray:
    """A request's base key uint32[2]: from its own seed, else fold_in(key(base_seed), index),
    bit for bit what `jax.random.PRNGKey` / `fold_in` give, computed on the host: the eager
    JAX ops took a device dispatch each, and reading the key back waited for the step already
    in flight, for every new request (~25 ms a request on the test machine's CPU). Seeds are
    below 2**32 (`config.SEED_RANGE`); another PRNG implementation takes JAX's own path."""
    if getattr(jax.config, "jax_default_prng_impl", None) != "threefry2x32":
        key = jax.random.PRNGKey(sp.seed) if sp.seed is not None else \
            jax.random.fold_in(jax.random.PRNGKey(base_seed), index)
        return np.asarray(key, np.uint32)
    if sp.seed is not None:
        return np.asarray([0, sp.seed], np.uint32)          # PRNGKey(seed): (seed >> 32, low)
    return threefry2x32((0, base_seed), (0, index))      # fold_in: the key over (0, data)


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(key: tuple[int, int], count: tuple[int, int]) -> np.ndarray:
    """Threefry-2x32 (20 rounds; Salmon et al. 2011, the function under jax.random's default
    keys) of one pair `count` under the key pair `key`, on the host -> uint32[2]."""
    mask = 0xFFFFFFFF
    k0, k1 = int(key[0]) & mask, int(key[1]) & mask
    ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)
    x0, x1 = (int(count[0]) + ks[0]) & mask, (int(count[1]) + ks[1]) & mask
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = (x0 + x1) & mask
            x1 = ((x1 << r) | (x1 >> (32 - r))) & mask
            x1 ^= x0
        x0 = (x0 + ks[(i + 1) % 3]) & mask
        x1 = (x1 + ks[(i + 2) % 3] + i + 1) & mask
    return np.asarray([x0, x1], np.uint32)


def _expand(x, logits):
    """Per-request [B] parameter broadcast against logits [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (logits.ndim - 1))


def filtered_probs(logits: jax.Array, temperature, top_k, top_p, mode: str = "filter",
                   min_p=None) -> jax.Array:
    """f32 probabilities [B, ..., V] after temperature, top-k, then top-p (ties at a cut are kept).

    temperature/top_k/top_p are per-request [B]; top_k 0 (or >= V) and top_p >= 1 are off.
    mode (static, `sampling_mode`): "greedy" computes only the one-hot argmax rows (exactly
    the "filter" result for all-greedy rows). min_p f32[B] (read in mode "filter_full" only):
    also drop tokens below min_p times the row's largest probability. logit_bias is not
    applied here: callers pass `apply_logit_bias(logits, sp)`.
    """
    _check_mode(mode)
    logits = logits.astype(jnp.float32)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    if mode in GREEDY_MODES:
        return onehot
    return _sampled_probs(logits, onehot, temperature, top_k, top_p, _min_p(mode, min_p))


def _min_p(mode, min_p):
    """min_p where the mode applies it, else None (the mode's program never mentions it)."""
    return min_p if mode in MIN_P_MODES else None


def _sampled_probs(logits, onehot, temperature, top_k, top_p, min_p=None):
    """filtered_probs for a batch with sampled rows (onehot: the greedy rows' result). Rows
    without top-k / top-p pass through masks that change nothing."""
    greedy = ~_expand(temperature > 0, logits)
    return jnp.where(greedy, onehot, _row_probs(logits, temperature, top_k, top_p, min_p))


def _row_probs(logits, temperature, top_k, top_p, min_p=None):
    """f32 [B, ..., V]: each sampled row's distribution after temperature, top-k, top-p (and
    min_p when given); a greedy row's softmax at temperature 1, unfiltered. Sampling and
    processed logprobs both call it with the same arguments, so in one step XLA computes its
    sorts once for both."""
    sampled = temperature > 0                                   # [B]
    t = _expand(jnp.where(sampled, temperature, 1.0), logits)
    k = _expand(jnp.where(sampled, top_k, 0), logits)
    p = _expand(jnp.where(sampled, top_p, 1.0), logits)
    probs = _top_p_mask(jax.nn.softmax(_top_k_mask(logits / t, k), axis=-1), p)
    if min_p is not None:
        # relative to the row's top probability, which top-k / top-p always keep and only
        # rescale: the same cut as vLLM's min_p on the tempered distribution. 0 keeps all.
        m = _expand(jnp.where(sampled, min_p, 0.0), logits)
        probs = jnp.where(probs >= m * jnp.max(probs, axis=-1, keepdims=True), probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def processed_logprobs(logits: jax.Array, temperature, top_k, top_p, mode: str = "filter",
                       min_p=None) -> jax.Array:
    """f32 log-probabilities [B, ..., V] of the distribution each request samples from: after
    temperature, top-k and top-p, renormalised (-inf outside top-k / the nucleus), i.e. vLLM's
    "processed_logprobs". A greedy request (temperature 0) reports the target's own
    distribution, log_softmax(logits) at temperature 1 without top-k / top-p (as vLLM does: its
    greedy requests sample at temperature 1 too); its one-hot sampling distribution would say
    nothing. Shares `_row_probs` with `filtered_probs`, so a sampled token's logprob is exactly
    the log of the probability it was drawn with. mode "greedy" (every row greedy, static):
    no sorts, only the softmax. min_p: as in `filtered_probs`."""
    _check_mode(mode)
    logits = logits.astype(jnp.float32)
    if mode in GREEDY_MODES:
        return logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    return jnp.log(_row_probs(logits, temperature, top_k, top_p, _min_p(mode, min_p)))


def processed_logprob_top(logits: jax.Array, tokens: jax.Array, temperature, top_k, top_p,
                          n: int, mode: str = "filter", min_p=None):
    """What logprobs reporting needs from `processed_logprobs`, without writing its [B, ..., V]
    array: logits [B, ..., V], tokens int32[B, ...] -> (chosen f32[B, ...], the logprob of each
    token; top values f32[B, ..., n], descending; top ids int32[B, ..., n]).

    The n most likely ids are `lax.top_k` of the raw logits: temperature is monotone, and
    top-k / top-p keep a prefix of that same order, so they are the top n of the processed
    logprobs too (filtered ones come out as -inf). Values are then gathers: mode "greedy" the
    logits minus a log-sum-exp; "filter" the log of the `_row_probs` entries the step's
    sampling computes anyway (n + 1 gathers per row: no second full-vocabulary consumer of
    the filtered probabilities)."""
    _check_mode(mode)
    logits = logits.astype(jnp.float32)
    _, ids = jax.lax.top_k(logits, n)
    at = lambda x, i: jnp.take_along_axis(x, i, axis=-1)               # noqa: E731
    if mode in GREEDY_MODES:
        lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        return (at(logits, tokens[..., None]) - lse)[..., 0], at(logits, ids) - lse, \
            ids.astype(jnp.int32)
    probs = _row_probs(logits, temperature, top_k, top_p, _min_p(mode, min_p))
    return jnp.log(at(probs, tokens[..., None]))[..., 0], jnp.log(at(probs, ids)), \
        ids.astype(jnp.int32)


def _top_k_mask(scaled, k):
    """-inf below each row's k-th largest value (k <= 0 or k >= V: row unchanged)."""
    V = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, V - 1), axis=-1)
    return jnp.where((k > 0) & (scaled < kth), -jnp.inf, scaled)


def _top_p_mask(probs, p):
    """Zero outside each row's nucleus: the largest entries whose mass before them is < p
    (p >= 1: row unchanged, even where the float32 running sum reaches 1 early). The top entry
    (and its ties) is always kept, whatever float p is: a p of 0 (a tiny top_p underflowed or
    flushed to zero), negative or NaN would otherwise keep nothing, and the draw from an
    all-zero row returns token 0. For p > 0 the top entry is kept anyway (its mass before is
    exactly 0), so this changes no valid row."""
    sorted_p = -jnp.sort(-probs, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p        # mass strictly before each entry
    keep = (before < p) | (p >= 1)
    threshold = jnp.min(jnp.where(keep, sorted_p, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.minimum(threshold, sorted_p[..., :1])
    return jnp.where(probs >= threshold, probs, 0.0)


def position_keys(keys: jax.Array, positions: jax.Array) -> jax.Array:
    """Key of the token sampled at each position: fold_in(request key, position).

    keys uint32[B, 2], positions int32[B] -> uint32[B, 2]. Sampling thus depends only on the
    request and the position, never on batch composition or step count.
    """
    return jax.vmap(jax.random.fold_in)(keys, positions)


def sample_from_probs(probs: jax.Array, keys: jax.Array, mode: str = "filter") -> jax.Array:
    """probs [B, V], keys uint32[B, 2] -> int32[B] (a one-hot row returns its index exactly).

    mode "greedy" (static): every row is one-hot (filtered_probs of greedy requests), so the
    draw is skipped for the argmax, which is the same index.
    """
    _check_mode(mode)
    if mode in GREEDY_MODES:
        return jnp.argmax(probs, axis=-1).astype(jnp.int32)
    return jax.vmap(jax.random.categorical)(keys, jnp.log(probs)).astype(jnp.int32)


def sample(logits: jax.Array, sp: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Sample one token per request from logits [B, V]; greedy rows take the argmax (an
    all-greedy batch, mode "greedy", computes nothing else). The logit processors of the
    batch's mode (`logit_processors.process_logits`) apply first."""
    from mtpjax.logit_processors import process_logits     # it imports this module
    logits = process_logits(logits, sp)
    top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if sp.mode in GREEDY_MODES:
        return top1
    probs = filtered_probs(logits, sp.temperature, sp.top_k, sp.top_p, sp.mode, sp.min_p)
    tok = sample_from_probs(probs, position_keys(sp.keys, positions), sp.mode)
    return jnp.where(sp.temperature <= 0, top1, tok)


def as_sampling_list(sampling, n: int, arg: str = "sampling_params") -> list[SamplingParams]:
    """One SamplingParams per prompt from None (greedy), one SamplingParams (shared) or a
    list / tuple of n of them; ValueError naming `arg` (and the entry) otherwise."""
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    if isinstance(sampling, (list, tuple)):
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts ({arg} must "
                             f"hold one per prompt, or be one SamplingParams for all)")
        for j, sp in enumerate(sampling):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"{arg}[{j}] must be a SamplingParams, got {type(sp).__name__}")
        return list(sampling)
    raise ValueError(f"{arg} must be a SamplingParams, a list of them (one per prompt) or None, "
                     f"got {type(sampling).__name__}")


def validate_sampling_params(sampling, num_prompts: int, *, vocab_size: int,
                             num_speculative_tokens: int, max_logprobs: int,
                             caller: str = "LLM", arg: str = "sampling_params"
                             ) -> list[SamplingParams]:
    """The one check of a call's SamplingParams against what the caller serves, shared by
    `mtpjax.LLM` (generate, generate_stream, add_request) and `mtpjax.generate`, so both accept
    and refuse exactly the same requests. Returns one SamplingParams per prompt.

    `SamplingParams(...)` already checked each field on its own; this adds the limits of the
    model and the caller: stop ids inside the vocabulary [0, vocab_size); per-request
    num_speculative_tokens <= num_speculative_tokens (K, the compiled maximum; 0 without
    speculation); logprobs / prompt_logprobs <= max_logprobs, and any logprobs (0 included)
    only with max_logprobs >= 1, whose step computes them (caller "generate": None only,
    `mtpjax.generate` returns no logprobs). caller ("LLM" or "generate") words the hints. A
    ValueError names the entry (`sampling_params[i]`, or `sampling_params` when one object
    serves every prompt), the field, its value and what was expected. Nothing is changed."""
    sps = as_sampling_list(sampling, num_prompts, arg)
    shared = sampling is None or isinstance(sampling, SamplingParams)
    K = num_speculative_tokens
    for i, sp in enumerate(sps[:1] if shared else sps):
        where = arg if shared else f"{arg}[{i}]"
        k = sp.num_speculative_tokens
        if k is not None and k > K:
            if caller == "generate":
                why = (f"spec=SpecConfig(num_speculative_tokens={K})" if K else
                       "mtpjax.generate without spec")
                limit = f"mtpjax.generate's K={K} ({why})"
            else:
                why = ("its compiled maximum, SpecConfig.num_speculative_tokens" if K else
                       "an LLM without speculation")
                limit = f"the engine's K={K} ({why})"
            raise ValueError(f"{where}: num_speculative_tokens={k} exceeds {limit}; expected "
                             f"0 <= num_speculative_tokens <= {K}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(sp, name)
            if n is not None and (n > max_logprobs or caller == "generate"):
                if caller == "generate":
                    raise ValueError(
                        f"{where}: {name}={n}, but mtpjax.generate returns no logprobs; "
                        f"expected {name}=None, or use mtpjax.LLM(..., max_logprobs="
                        f"{max(n, 1)}), whose RequestOutput carries them")
                raise ValueError(f"{where}: {name}={n} exceeds the engine's max_logprobs="
                                 f"{max_logprobs} (compiled into its step): create the LLM with "
                                 f"max_logprobs >= {n}")
            if name == "logprobs" and n is not None and max_logprobs == 0:
                # the step computes token logprobs only when built with max_logprobs > 0;
                # logprobs=0 (the chosen token's alone) would come back as an empty list
                raise ValueError(f"{where}: logprobs={n} needs an engine built with "
                                 f"max_logprobs >= 1 (this one has max_logprobs=0: its step "
                                 f"computes no logprobs); create the LLM with max_logprobs >= 1")
        bad = [t for t, _ in sp.logit_bias or () if t >= vocab_size]
        if bad:
            raise ValueError(f"{where}: logit_bias has token id {bad[0]}, outside the "
                             f"vocabulary [0, {vocab_size}); expected ids < vocab_size="
                             f"{vocab_size}")
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: stop_token_ids has {bad[0]}, outside the vocabulary "
                             f"[0, {vocab_size}); expected ids < vocab_size={vocab_size}")
        if sp.has_penalties and caller == "generate":
            # the history lives in the engine's device state (logit_processors)
            raise ValueError(f"{where}: repetition_penalty={sp.repetition_penalty:g}, "
                             f"presence_penalty={sp.presence_penalty:g}, frequency_penalty="
                             f"{sp.frequency_penalty:g}, but mtpjax.generate does not apply "
                             f"penalties; expected 1, 0, 0 (off), or use mtpjax.LLM, which "
                             f"applies them (speculative decoding included)")
        if sp.structured_output is not None and caller == "generate":
            # the grammar's masks are built on the host after every step, along the drafts
            raise ValueError(f"{where}: structured_output={sp.structured_output.kind}: "
                             f"structured output needs the engine (mtpjax.LLM); generate's "
                             f"on-device loop cannot run a grammar matcher")
        if sp.stop and caller == "generate":
            # stop strings need the text, so a tokenizer on the host after every step
            raise ValueError(f"{where}: stop={list(sp.stop)!r}, but mtpjax.generate (the "
                             f"on-device loop) has no tokenizer; expected stop=(), or use "
                             f"mtpjax.LLM (with a tokenizer), which applies stop strings")
        if sp.n > 1 and caller == "generate":
            raise ValueError(f"{where}: n={sp.n}, but mtpjax.generate returns one completion "
                             f"per prompt; expected n=1 (repeat the prompt), or use "
                             f"mtpjax.LLM.generate, which runs n samples per prompt")
    return sps


def stop_id_array(params: Sequence[SamplingParams]) -> np.ndarray:
    """int32[B, S] stop ids padded with -1 (S >= 1)."""
    width = max([1] + [len(p.stop_token_ids) for p in params])
    out = np.full((len(params), width), -1, np.int32)
    for i, p in enumerate(params):
        out[i, :len(p.stop_token_ids)] = p.stop_token_ids
    return out


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens int32[B, ...] vs per-request stop ids int32[B, S] (-1 = none) -> bool[B, ...]."""
    stops = stop_ids.reshape(stop_ids.shape[:1] + (1,) * (tokens.ndim - 1) + stop_ids.shape[1:])
    return jnp.any((tokens[..., None] == stops) & (stops >= 0), axis=-1)


@struct.dataclass
class Limits:
    """When each request stops: after max_new tokens, or at (and including) a stop token."""

    max_new: jax.Array        # int32[B]
    stop_ids: jax.Array       # int32[B, S], -1 padded
