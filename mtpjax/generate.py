"""On-device generation for research code: batched prefill into the paged cache, then a
`lax.while_loop` of jitted steps (autoregressive, or speculative with `spec=SpecConfig(...)`).

Position convention (docs/spec_decoding.md): `seq_len` counts tokens whose KV is in the cache;
the newest sampled token (`last_token`) sits at position `seq_len` and has no KV yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtpjax.cache import KVCache, PagedBatch, init_cache
from mtpjax.compilation_cache import enable_compilation_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig
from mtpjax.model.attention import resolve_impl
from mtpjax.model.transformer import forward_cached, logits_from_hidden
from mtpjax.sampling import (Limits, SamplingArrays, as_sampling_list, is_stop, sample,
                             stop_id_array)


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]          # generated ids per prompt (prompt excluded)
    stats: dict[str, Any]            # see docs/spec_decoding.md ("Statistics")


@struct.dataclass
class DecodeState:
    cache: KVCache
    block_tables: jax.Array   # int32[B, M]
    seq_len: jax.Array        # int32[B] tokens whose KV is committed
    last_token: jax.Array     # int32[B] newest token, at position seq_len, no KV yet
    out_tokens: jax.Array     # int32[B, max_new] generated ids, -1 past num_out
    num_out: jax.Array        # int32[B]
    done: jax.Array           # bool[B]
    steps: jax.Array          # int32[] decode steps taken


def validate_prompts(prompts, cfg: ModelConfig) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        ids = [int(t) for t in np.asarray(p).reshape(-1)] if not isinstance(p, str) else None
        if ids is None:
            raise ValueError(f"prompt {i} is a string; pass token ids (or use mtpjax.LLM with a tokenizer)")
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        out.append(ids)
    return out


def plan_pages(needed_tokens: Sequence[int], page_size: int, num_pages: int | None, seed: int):
    """Block tables int32[B, M] covering each request's tokens, pages in a random order.

    Returns (block_tables, num_pages). Raises if `num_pages` cannot hold every request.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    per_req = [math.ceil(n / page_size) for n in needed_tokens]
    total = sum(per_req)
    if num_pages is None:
        num_pages = total
    if total > num_pages:
        raise ValueError(
            f"the requests need {total} pages of {page_size} tokens (prompt + max_new_tokens + "
            f"lookahead per request: {list(needed_tokens)}) but the cache has num_pages={num_pages}")
    order = np.random.default_rng(seed).permutation(num_pages)
    M = max(per_req)
    tables = np.zeros((len(per_req), M), np.int32)
    start = 0
    for i, n in enumerate(per_req):
        tables[i, :n] = order[start:start + n]
        start += n
    return tables, num_pages


def bucket_size(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= n (and >= minimum): padded shapes compile only a few programs."""
    return max(minimum, 1 << (n - 1).bit_length())


def pack_prompts(prompts: list[list[int]]):
    """Left-padded tokens int32[B, T] (T bucketed) and positions (-1 at padding).

    Left padding aligns every prompt to the end of its row, so a prefill is a uniform batch whose
    queries end at each request's KV length (what the decode/verify kernels expect).
    """
    T = bucket_size(max(len(p) for p in prompts))
    tokens = np.zeros((len(prompts), T), np.int32)
    positions = np.full((len(prompts), T), -1, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, T - len(p):] = p
        positions[i, T - len(p):] = np.arange(len(p))
    return tokens, positions


@functools.partial(jax.jit, static_argnames=("cfg", "impl", "max_new"), donate_argnames=("cache",))
def _ar_prefill(params, cfg: ModelConfig, cache: KVCache, tokens, positions, lens, block_tables,
                sp: SamplingArrays, limits: Limits, *, impl: str, max_new: int):
    B, T = tokens.shape
    batch = PagedBatch.uniform(positions, block_tables)      # left padded: ends aligned
    hidden, cache = forward_cached(params, cfg, cache, tokens.reshape(-1), batch, impl=impl)
    last = hidden.reshape(B, T, -1)[:, T - 1]
    first = sample(logits_from_hidden(params, last), sp, lens)
    out = jnp.full((B, max_new), -1, jnp.int32).at[:, 0].set(first)
    done = is_stop(first, limits.stop_ids) | (limits.max_new <= 1)
    return DecodeState(cache=cache, block_tables=block_tables, seq_len=lens, last_token=first,
                       out_tokens=out, num_out=jnp.ones((B,), jnp.int32), done=done,
                       steps=jnp.zeros((), jnp.int32))


def ar_step(params, cfg: ModelConfig, state: DecodeState, sp: SamplingArrays,
            limits: Limits, *, impl: str) -> DecodeState:
    """One autoregressive step for every request (finished ones are frozen)."""
    B = state.seq_len.shape[0]
    live = ~state.done
    batch = PagedBatch.uniform(state.seq_len[:, None], state.block_tables)
    hidden, cache = forward_cached(params, cfg, state.cache, state.last_token, batch, impl=impl)
    tok = sample(logits_from_hidden(params, hidden), sp, state.seq_len + 1)
    idx = jnp.minimum(state.num_out, state.out_tokens.shape[1] - 1)
    out = state.out_tokens.at[jnp.arange(B), idx].set(
        jnp.where(live, tok, state.out_tokens[jnp.arange(B), idx]))
    num_out = state.num_out + live
    done = state.done | (live & (is_stop(tok, limits.stop_ids) | (num_out >= limits.max_new)))
    return DecodeState(cache=cache, block_tables=state.block_tables,
                       seq_len=state.seq_len + live, last_token=jnp.where(live, tok, state.last_token),
                       out_tokens=out, num_out=num_out, done=done, steps=state.steps + 1)


@functools.partial(jax.jit, static_argnames=("cfg", "impl"), donate_argnames=("state",))
def _ar_loop(params, cfg: ModelConfig, state: DecodeState, sp, limits, *, impl: str):
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: ar_step(params, cfg, s, sp, limits, impl=impl),
        state)


def generate(params, cfg: ModelConfig, prompts, *, max_new_tokens: int,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             spec: SpecConfig | None = None, seed: int = 0, page_size: int = 16,
             num_pages: int | None = None, attention_impl: str = "auto",
             cache_dtype=None, draft_source: str = "model",
             forced_drafts=None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt (fewer when `SamplingParams.max_tokens` is
    smaller or a stop token is produced; the stop token is included in the output).

    prompts: list of token-id lists. sampling: one SamplingParams for all, or one per prompt
    (default greedy). spec: None for autoregressive decoding, else speculative decoding with the
    model's MTP modules. seed: base of per-request keys (a request's own `seed` wins).
    page_size / num_pages size the paged cache (default: exactly what the requests need).
    attention_impl: "auto" | "reference" | "pallas" (see mtpjax.model.attention).
    JAX's persistent compilation cache is turned on first (mtpjax/compilation_cache.py).
    draft_source (experiments and tests): "model" (default), "random" (uniform random drafts) or
    "forced" (draft at position p is forced_drafts[b, p], e.g. the target's own continuation);
    a list gives one source per prompt (one compiled program serves them all).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    enable_compilation_cache()
    prompts = validate_prompts(prompts, cfg)
    sps = as_sampling_list(sampling, len(prompts))
    if spec is not None:
        if not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig or None, got {type(spec).__name__}")
        spec.check_model(cfg)
    max_new = [min(max_new_tokens, s.max_tokens or max_new_tokens) for s in sps]
    # chain drafting writes module KV up to position N + 2K - 1 (docs/spec_decoding.md)
    lookahead = 0 if spec is None else 2 * spec.num_speculative_tokens + 1
    lens = [len(p) for p in prompts]
    tables, num_pages = plan_pages([n + m + lookahead for n, m in zip(lens, max_new)],
                                   page_size, num_pages, seed)
    dtype = cache_dtype or params["embed"].dtype
    cache = init_cache(cfg, num_pages, page_size, dtype)
    tokens, positions = pack_prompts(prompts)
    sp_arrays = SamplingArrays.build(sps, seed)
    limits = Limits(max_new=jnp.asarray(max_new, jnp.int32),
                           stop_ids=jnp.asarray(stop_id_array(sps)))
    args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(lens, jnp.int32),
            jnp.asarray(tables))
    if spec is not None:
        from mtpjax.speculative.generate import speculative_generate
        from mtpjax.speculative.draft import DRAFT_SOURCES
        sources = [draft_source] if isinstance(draft_source, str) else list(draft_source)
        if len(sources) not in (1, len(prompts)):
            raise ValueError(f"draft_source has {len(sources)} entries for {len(prompts)} prompts")
        for src in sources:
            if src not in DRAFT_SOURCES:
                raise ValueError(f"draft_source {src!r} not in {DRAFT_SOURCES}")
        if ("forced" in sources) != (forced_drafts is not None):
            raise ValueError("forced_drafts must be given exactly when a draft_source is 'forced'")
        return speculative_generate(params, cfg, spec, cache, *args, sp_arrays, limits,
                                    max_new=max(max_new), impl=resolve_impl(attention_impl),
                                    draft_source=draft_source, forced_tokens=forced_drafts)
    impl = resolve_impl(attention_impl)
    state = _ar_prefill(params, cfg, cache, *args, sp_arrays, limits, impl=impl,
                        max_new=max(max_new))
    state = _ar_loop(params, cfg, state, sp_arrays, limits, impl=impl)
    num_out = np.asarray(state.num_out)
    out = np.asarray(state.out_tokens)
    toks = [out[i, :num_out[i]].tolist() for i in range(len(prompts))]
    total = int(num_out.sum())
    return GenerateOutput(tokens=toks, stats={
        "decode_steps": int(state.steps), "generated_tokens": total,
        "target_forward_passes": int(state.steps) + 1})
