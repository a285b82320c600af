"""On-device generation for research code: batched prefill into the paged cache, then a
`lax.while_loop` of jitted steps (autoregressive, or speculative with `spec=SpecConfig(...)`).

Position convention (docs/spec_decoding.md): `seq_len` counts tokens whose KV is in the cache;
the newest sampled token (`last_token`) sits at position `seq_len` and has no KV yet.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtpjax.cache import init_cache
from mtpjax.compilation_cache import enable_compilation_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig, check_seed
from mtpjax.model.backend import resolve_backend
from mtpjax.model.fused import check_fusable, fuse_projections as fuse, fusion_groups
from mtpjax.parallel import check_mesh, sharded_inputs, to_host
from mtpjax.parallel.dp_attention import check_dp_attention, check_layout
from mtpjax.parallel.sharding import pin
from mtpjax.sampling import (Limits, SamplingArrays, is_stop, stop_id_array,
                             validate_sampling_params)
from mtpjax.speculative.draft import DRAFT_SOURCES, DraftOverride, draft_shape
from mtpjax.speculative.draft_vocab import attach as attach_draft_vocab
from mtpjax.speculative.draft_vocab import resolve_ids as draft_vocab_ids
from mtpjax.speculative.metrics import SpecStats
from mtpjax.speculative.mixed_step import (KIND_DECODE, KIND_LAST_CHUNK, KIND_PAD, MixedBatch,
                                           SlotState, mixed_step)
from mtpjax.speculative.rules.registry import acceptance_rule
from mtpjax.step_jit import LOOP_COMPILER_OPTIONS, step_jit


@dataclasses.dataclass
class GenerateOutput:
    tokens: list[list[int]]          # generated ids per prompt (prompt excluded)
    stats: dict[str, Any]            # see docs/spec_decoding.md ("Statistics")


@struct.dataclass
class GenerateState:
    """generate's loop state: the engine's slot state (slot b = request b) plus the outputs."""

    slots: SlotState          # cache, per-request seq_len, pending token, drafts, history
    block_tables: jax.Array   # int32[B, M]
    out_tokens: jax.Array     # int32[B, max_new + K + 1] generated ids, -1 past num_out
    num_out: jax.Array        # int32[B]
    done: jax.Array           # bool[B]
    stats: SpecStats          # acceptance statistics (K = 0 without speculation)


def validate_prompts(prompts, cfg: ModelConfig) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            raise ValueError(f"prompt {i} is a string; pass token ids (or use mtpjax.LLM with a tokenizer)")
        if isinstance(p, (int, np.integer)):
            raise ValueError(f"prompts must be a list of token-id lists; prompts[{i}] is the int "
                             f"{p!r} (for one prompt pass [[1, 2, 3]], not [1, 2, 3])")
        arr = np.asarray(p)
        if arr.dtype == object or arr.ndim != 1 or (
                arr.size and (arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer))):
            raise ValueError(f"prompt {i} must be a 1-D list of integer token ids, got {p!r}"[:200])
        ids = arr.tolist()
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(ids) > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, more than the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
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


MIN_TOKEN_BUCKET = 8    # the default smallest step shape (LLM min_token_bucket): few programs


def default_min_token_bucket(cfg) -> int:
    """The engine's smallest step shape when none is given: 1 for a MoE model, whose padded
    tokens would each run the experts (a batch-1 decode step at 8 tokens went through the
    16-token expert tiles: 3.96-4.00 against 3.64-3.67 ms on the DeepSeek-V2-Lite shape,
    docs/engine.md "Step buckets"), else MIN_TOKEN_BUCKET (dense layers read the same weights
    for 1 or 8 tokens, and three fewer programs compile)."""
    return 1 if cfg.ffn_kind == "moe" else MIN_TOKEN_BUCKET


def bucket_size(n: int, minimum: int = MIN_TOKEN_BUCKET) -> int:
    """Smallest power of two >= n (and >= minimum): padded shapes compile only a few programs."""
    return max(minimum, 1 << (n - 1).bit_length())


def commit(out_tokens, num_out, done, tokens, num_accepted, limits: Limits):
    """Truncates each accepted run (tokens int32[B, K+1], num_accepted int32[B]) at the first
    stop token / max_new and appends it to the output.

    Returns (num_committed int32[B] (0 for finished requests), out_tokens, num_out, done).
    """
    B, K1 = tokens.shape
    live = ~done
    j = jnp.arange(K1)[None, :]
    stop = is_stop(tokens, limits.stop_ids) & (j < num_accepted[:, None])
    first_stop = jnp.where(jnp.any(stop, 1), jnp.argmax(stop, 1) + 1, K1 + 1)
    n = jnp.minimum(jnp.minimum(num_accepted, first_stop), limits.max_new - num_out)
    n = jnp.where(live, n, 0).astype(jnp.int32)
    cols = num_out[:, None] + j
    cols = jnp.where(j < n[:, None], cols, out_tokens.shape[1])       # dropped
    out = out_tokens.at[jnp.arange(B)[:, None], cols].set(tokens, mode="drop")
    num_out = num_out + n
    done = done | (live & ((first_stop <= n) | (num_out >= limits.max_new)))
    return n, out, num_out, done


def prefill_batch(prompts: list[list[int]], spec: SpecConfig | None, sampling: SamplingArrays,
                  block_tables: np.ndarray) -> tuple[MixedBatch, int]:
    """Every prompt as one final prefill chunk of the engine's ragged batch (host numpy), and
    the first-pass bucket."""
    B = len(prompts)
    K, W = draft_shape(spec)
    lens = [len(p) for p in prompts]
    T = bucket_size(sum(lens))
    tokens = np.zeros(T, np.int32)
    positions = np.full(T, -1, np.int32)
    seq_ids = np.zeros(T, np.int32)
    cu = np.zeros(B + 1, np.int32)
    for i, p in enumerate(prompts):
        cu[i + 1] = cu[i] + len(p)
        tokens[cu[i]:cu[i + 1]] = p
        positions[cu[i]:cu[i + 1]] = np.arange(len(p))
        seq_ids[cu[i]:cu[i + 1]] = i
    # the acceptance rule's per-slot flag after each prompt (relaxed: inside thinking)
    flag_after = None if spec is None else acceptance_rule(spec.acceptance).slot_flag
    batch = MixedBatch(
        tokens=tokens, positions=positions, seq_ids=seq_ids, cu_q_lens=cu,
        kv_lens=np.asarray(lens, np.int32), block_tables=block_tables,
        slots=np.arange(B, dtype=np.int32), kinds=np.full(B, KIND_LAST_CHUNK, np.int32),
        next_tokens=np.full((B, K + 1), -1, np.int32),
        thinking=np.asarray([flag_after is not None and bool(flag_after(p, spec))
                             for p in prompts], bool),
        hist_from=np.zeros(B, np.int32), sampling=sampling)
    return batch, bucket_size(sum(max(W, n) for n in lens))


def decode_batch(state: GenerateState, sampling: SamplingArrays, K: int,
                 num_drafts=None) -> MixedBatch:
    """Every unfinished request as a decode row of K+1 tokens (finished ones: padding rows),
    built on device: a decode row's positions, tokens and drafts come from its slot.
    num_drafts: int32[B] drafts each row verifies (per-request num_speculative_tokens), None: K."""
    B, Q = state.done.shape[0], K + 1
    rows = jnp.arange(B, dtype=jnp.int32)
    return MixedBatch(
        tokens=jnp.zeros((B * Q,), jnp.int32),
        positions=jnp.repeat(jnp.where(state.done, -1, 0).astype(jnp.int32), Q),
        seq_ids=jnp.repeat(rows, Q), cu_q_lens=jnp.arange(B + 1, dtype=jnp.int32) * Q,
        kv_lens=jnp.zeros((B,), jnp.int32), block_tables=state.block_tables, slots=rows,
        kinds=jnp.where(state.done, KIND_PAD, KIND_DECODE).astype(jnp.int32),
        next_tokens=jnp.full((B, Q), -1, jnp.int32), thinking=jnp.zeros((B,), bool),
        hist_from=jnp.zeros((B,), jnp.int32), sampling=sampling, num_drafts=num_drafts)


def generate_prefill(params, cfg: ModelConfig, spec: SpecConfig | None, slots: SlotState,
                     batch: MixedBatch, limits: Limits, *, first_pass_len: int, max_new: int,
                     backend, draft_source: str = "model", forced=None) -> GenerateState:
    """The engine's step over the prompts: KV, first token, first drafts; -> GenerateState."""
    K, _ = draft_shape(spec)
    B = batch.kinds.shape[0]
    slots, acc, _ = mixed_step(params, cfg, spec, slots, batch, first_pass_len=first_pass_len,
                               backend=backend, draft_source=draft_source, forced=forced)
    first = acc[:, 0]
    out = jnp.full((B, max_new + K + 1), -1, jnp.int32).at[:, 0].set(first)
    done = is_stop(first, limits.stop_ids) | (limits.max_new <= 1)
    return GenerateState(slots=slots, block_tables=batch.block_tables, out_tokens=out,
                         num_out=jnp.ones((B,), jnp.int32), done=done, stats=SpecStats.zeros(K))


def generate_step(params, cfg: ModelConfig, spec: SpecConfig | None, state: GenerateState,
                  sampling: SamplingArrays, limits: Limits, *, backend,
                  draft_source: str = "model", forced=None, num_drafts=None) -> GenerateState:
    """One step of every unfinished request: the engine's step (`mixed_step`) on a batch of
    decode rows, then stop / max-token truncation into the outputs. num_drafts: int32[B]
    per-request drafts verified (the engine's per-request K, by masking), None: K."""
    K, W = draft_shape(spec)
    B = state.done.shape[0]
    slots, acc, num_accepted = mixed_step(
        params, cfg, spec, state.slots, decode_batch(state, sampling, K, num_drafts),
        first_pass_len=B * W, backend=backend, draft_source=draft_source, forced=forced)
    n, out, num_out, done = commit(state.out_tokens, state.num_out, state.done, acc,
                                   num_accepted, limits)
    return GenerateState(slots=slots, block_tables=state.block_tables, out_tokens=out,
                         num_out=num_out, done=done,
                         stats=state.stats.update(~state.done, num_accepted, n, num_drafts))


@step_jit(static_argnames=("cfg", "spec", "first_pass_len", "max_new", "backend", "draft_source"),
          donate_argnames=("slots",))
def _prefill(params, cfg, spec, slots, batch, limits, forced, *, first_pass_len, max_new,
             backend, draft_source):
    state = generate_prefill(params, cfg, spec, slots, batch, limits,
                             first_pass_len=first_pass_len, max_new=max_new, backend=backend,
                             draft_source=draft_source, forced=forced)
    return pin(state, cfg, backend.mesh)


def _decode_loop(params, cfg, spec, state: GenerateState, sampling, limits, forced, num_drafts,
                 *, backend, draft_source, steps_per_check):
    # On a GPU a while loop outside a CUDA graph copies its predicate to the host every
    # iteration and launches the next only after it: the device idles between steps. `_loop`
    # compiles it into the graph (LOOP_COMPILER_OPTIONS); where it is not (`_loop_host_checked`,
    # see loop_in_cuda_graph) or XLA cannot (collectives in the body), the fixed-trip inner loop
    # still makes only every `steps_per_check`-th step wait.
    # Steps after every request is done run on padding rows and change nothing.
    def steps(s):
        return jax.lax.fori_loop(0, steps_per_check, lambda _, t: pin(generate_step(
            params, cfg, spec, t, sampling, limits, backend=backend, draft_source=draft_source,
            forced=forced, num_drafts=num_drafts), cfg, backend.mesh), s)

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), steps, pin(state, cfg, backend.mesh))


_LOOP_STATICS = ("cfg", "spec", "backend", "draft_source", "steps_per_check")
# the loop inside the CUDA graph (WHILE / CONDITIONAL commands): the default
_loop = step_jit(_decode_loop, static_argnames=_LOOP_STATICS, donate_argnames=("state",),
                 extra_options=LOOP_COMPILER_OPTIONS)
# the same loop with XLA's default command buffers: the host checks "all done" every
# steps_per_check steps
_loop_host_checked = step_jit(_decode_loop, static_argnames=_LOOP_STATICS,
                              donate_argnames=("state",))


def loop_in_cuda_graph(cfg: ModelConfig, spec: SpecConfig | None) -> bool:
    """Whether generate's loop runs as WHILE / CONDITIONAL CUDA-graph commands. Not for
    speculative decoding on MoE models: measured on an H200 at the DeepSeek-V2-Lite shape, batch
    1, K=3, the graph loop took 10.72 ms a step against 5.91 ms host-checked (the engine: 5.97),
    while plain decoding and the dense 8B shape gain from it (docs/benchmarks.md)."""
    return not (spec is not None and cfg.ffn_kind == "moe")


def generate(params, cfg: ModelConfig, prompts, *, max_new_tokens: int,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None,
             spec: SpecConfig | None = None, seed: int = 0, page_size: int = 16,
             num_pages: int | None = None, attention_impl="auto",
             cache_dtype=None, draft_source: str = "model",
             forced_drafts=None, mesh=None, steps_per_check: int = 4,
             draft_vocab=None, fuse_projections: bool | str = False,
             layout: str | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per prompt (fewer when `SamplingParams.max_tokens` is
    smaller or a stop token is produced; the stop token is included in the output).

    prompts: list of token-id lists. sampling: one SamplingParams for all, or one per prompt
    (default greedy), checked exactly as `mtpjax.LLM` checks them
    (`sampling.validate_sampling_params`): stop ids must be in the vocabulary, a per-request
    `num_speculative_tokens` k <= K is honoured (the request verifies k drafts per step, as in
    the engine; k > K is refused), and `logprobs` / `prompt_logprobs` are refused (generate
    returns no logprobs; `mtpjax.LLM(..., max_logprobs=n)` does). spec: None for
    autoregressive decoding, else speculative decoding with the model's MTP modules. seed:
    base of per-request keys (a request's own `seed` wins), an int in [0, 2**32).
    page_size / num_pages size the paged cache (default: exactly what the requests need).
    attention_impl: "auto" | "reference" | "pallas" | "pallas_interpret" or an AttentionBackend
    (see mtpjax.model.backend).
    JAX's persistent compilation cache is turned on first (mtpjax/compilation_cache.py).
    draft_source (experiments and tests): "model" (default), "random" (uniform random drafts) or
    "forced" (draft at position p is forced_drafts[b, p], e.g. the target's own continuation);
    a list gives one source per prompt (one compiled program serves them all).
    mesh: a jax.sharding.Mesh with axes ("data", "model") (`mtpjax.make_mesh`): params, cache
    and state are placed by the sharding table (docs/parallel.md) and every step runs on it.
    steps_per_check: steps the on-device loop runs between two checks of "every request done"
    (a GPU while loop waits on the host at each check; up to steps_per_check - 1 steps after
    the last request finishes run on padding rows).
    draft_vocab: with `SpecConfig(draft_vocab_size=N)`, the token ids drafts come from (N ids,
    or ranked ids of which the first N are taken; speculative/draft_vocab.py).
    fuse_projections: run with q/k/v and gate/up weights concatenated once (model/fused.py;
    one device only): True / "all" both groups, "qkv" only q/k/v (less memory; on MLA also
    kv_b split into the absorbed attention's halves), False none.
    layout: None (the sharding table) or "dp_attention" (MLA + MoE models on a (d, 1) mesh:
    each device runs attention for its own B / d requests over its own latent pages, the
    routed experts split over the devices; num_pages then counts every device's pages;
    docs/parallel.md "DP attention").
    Params holding NaN or inf give a `NonFiniteParamsWarning` naming the first such leaf (the
    check runs beside the generation, one reduction over the weights per call).
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(steps_per_check, bool) or not isinstance(steps_per_check, int) \
            or steps_per_check <= 0:
        raise ValueError(f"steps_per_check must be a positive int, got {steps_per_check!r}")
    seed = check_seed("seed", seed)
    mesh = check_mesh(mesh)
    layout = check_layout(layout)
    fused_groups = fusion_groups(fuse_projections)
    if fused_groups:
        check_fusable(mesh)
    enable_compilation_cache()
    prompts = validate_prompts(prompts, cfg)
    if spec is not None:
        if not isinstance(spec, SpecConfig):
            raise ValueError(f"spec must be a SpecConfig or None, got {type(spec).__name__}")
        spec.check_model(cfg)
    K = spec.num_speculative_tokens if spec is not None else 0
    sps = validate_sampling_params(sampling, len(prompts), vocab_size=cfg.vocab_size,
                                   num_speculative_tokens=K, max_logprobs=0, caller="generate",
                                   arg="sampling")
    vocab_ids = draft_vocab_ids(cfg, spec, draft_vocab)
    # chain drafting writes module KV up to position N + 2K - 1 (docs/spec_decoding.md)
    lookahead = 0 if spec is None else 2 * spec.num_speculative_tokens + 1
    num_requests = len(prompts)
    if layout == "dp_attention":
        check_dp_attention(cfg, mesh, num_requests)
    max_new = [min(max_new_tokens, s.max_tokens or max_new_tokens) for s in sps]
    if num_requests == 1:
        # One request runs as two rows, the second a one-token request that finishes at
        # prefill and is a padding row from then on. With one row every projection is a
        # [1, E] x [E, N] dot, which model/linear.py must pad to two rows (a small pad kernel
        # before each of the step's ~7 projections per layer); two rows need none. The engine
        # pads its batches the same way (>= 8 tokens). Row 0's pages, key and tokens are
        # unchanged (tests/speculative/test_generate_padding_row.py).
        if num_pages is not None:   # checked for the real request first (its own error)
            plan_pages([len(prompts[0]) + max_new[0] + lookahead], page_size, num_pages, seed)
            num_pages += math.ceil((2 + lookahead) / page_size)
        prompts, sps, max_new = prompts + [[0]], sps + [SamplingParams(max_tokens=1)], max_new + [1]
        if forced_drafts is not None:
            forced_drafts = np.asarray(forced_drafts)
            forced_drafts = np.concatenate([forced_drafts, np.zeros_like(forced_drafts)])
    lens = [len(p) for p in prompts]
    needed_tokens = [n + m + lookahead for n, m in zip(lens, max_new)]
    if layout is None:
        tables, num_pages = plan_pages(needed_tokens, page_size, num_pages, seed)
    dtype = cache_dtype or params["embed"].dtype
    sp_arrays = SamplingArrays.build(sps, seed)
    limits = Limits(max_new=jnp.asarray(max_new, jnp.int32),
                    stop_ids=jnp.asarray(stop_id_array(sps)))
    # per-request K, by masking as in the engine; None (the K-draft program) when no request
    # asks for fewer, so the common case compiles and runs exactly as before
    ks = [K if sp.num_speculative_tokens is None else sp.num_speculative_tokens for sp in sps]
    num_drafts = jnp.asarray(ks, jnp.int32) if any(k != K for k in ks) else None
    draft_source, forced = _draft_override(draft_source, forced_drafts, len(prompts))
    if layout == "dp_attention":
        from mtpjax.parallel.dp_generate import generate_dp_attention
        params = attach_draft_vocab(params, vocab_ids, mesh)
        finite = finite_flags(params)
        state = generate_dp_attention(
            params, cfg, spec, prompts, mesh=mesh, needed_tokens=needed_tokens,
            page_size=page_size, num_pages=num_pages, seed=seed, dtype=dtype,
            sampling=sp_arrays, limits=limits, forced=forced, num_drafts=num_drafts,
            max_new=max(max_new), backend=resolve_backend(attention_impl, mesh=mesh),
            draft_source=draft_source, steps_per_check=steps_per_check)
        return _outputs(state, finite, num_requests, spec)
    batch, F = prefill_batch(prompts, spec, sp_arrays, tables)
    B = len(prompts)
    backend = resolve_backend(attention_impl, mesh=mesh)
    if mesh is None:
        slots = SlotState.create(cfg, spec, init_cache(cfg, num_pages, page_size, dtype), B, dtype)
        batch = jax.device_put(batch)
    else:
        params, slots, (batch, sp_arrays, limits, forced, num_drafts) = sharded_inputs(
            mesh, cfg, params, lambda: SlotState.create(
                cfg, spec, init_cache(cfg, num_pages, page_size, dtype), B, dtype),
            (batch, sp_arrays, limits, forced, num_drafts))
    if fused_groups:                # after placement: the table describes the unfused tree
        params = fuse(params, cfg, fused_groups)
    params = attach_draft_vocab(params, vocab_ids, mesh)
    finite = finite_flags(params)               # read after the loop: no wait before it
    state = _prefill(params, cfg, spec, slots, batch, limits, forced,
                     first_pass_len=F, max_new=max(max_new), backend=backend,
                     draft_source=draft_source)
    loop = _loop if loop_in_cuda_graph(cfg, spec) else _loop_host_checked
    state = loop(params, cfg, spec, state, sp_arrays, limits, forced, num_drafts,
                  backend=backend, draft_source=draft_source, steps_per_check=steps_per_check)
    return _outputs(state, finite, num_requests, spec)


def _outputs(state: GenerateState, finite, num_requests: int, spec) -> GenerateOutput:
    """The finished loop's tokens (the first num_requests rows) and statistics."""
    num_out = to_host(state.num_out)
    warn_non_finite(finite, "mtpjax.generate")
    out = to_host(state.out_tokens)
    toks = [out[i, :num_out[i]].tolist() for i in range(num_requests)]
    if spec is not None:
        return GenerateOutput(tokens=toks, stats=state.stats.finalize(prefill_tokens=num_requests))
    steps = int(state.stats.steps)
    return GenerateOutput(tokens=toks, stats={
        "decode_steps": steps, "generated_tokens": int(num_out[:num_requests].sum()),
        "target_forward_passes": steps + 1})


class NonFiniteParamsWarning(RuntimeWarning):
    """The model's parameters hold NaN or inf: logits computed through them are not finite,
    and sampling from a non-finite row returns token id 0 (no error is raised on the device)."""


def finite_flags(params):
    """Starts a check that every floating-point leaf of `params` is finite; read it with
    `warn_non_finite`. Leaves in host memory (numpy, or JAX arrays on the CPU) are checked
    here with numpy: no compile (a jitted reduction over a small model's leaves took 1-2 s to
    compile on the CPU, per model shape). Leaves on an accelerator get one jitted reduction,
    dispatched and not waited for, so it runs beside the work that follows."""
    host, device = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not (hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)):
            continue
        on_host = isinstance(x, np.ndarray) or (
            isinstance(x, jax.Array) and x.is_fully_addressable
            and all(d.platform == "cpu" for d in x.devices()))
        (host if on_host else device).append((_leaf_name(path), x))
    host_ok = [(name, bool(np.isfinite(np.asarray(x)).all())) for name, x in host]
    pending = ([name for name, _ in device], _all_finite([x for _, x in device])) \
        if device else ([], None)
    return host_ok, pending


def _leaf_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


@step_jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def warn_non_finite(flags, where: str) -> None:
    """NonFiniteParamsWarning naming the first non-finite leaf of a `finite_flags` result."""
    host_ok, (names, device_ok) = flags
    results = host_ok + (list(zip(names, to_host(device_ok).tolist()))
                         if device_ok is not None else [])
    bad = [name for name, good in results if not good]
    if bad:
        warnings.warn(
            f"{where}: params leaf {bad[0]!r} holds NaN or inf values ({len(bad)} of "
            f"{len(results)} floating-point leaves do): logits computed through it are not "
            f"finite, and a non-finite logit row samples token id 0 without any error; check "
            f"the checkpoint or the run that made these weights", NonFiniteParamsWarning,
            stacklevel=3)


def _draft_override(draft_source, forced_drafts, B: int):
    """(static source name, DraftOverride) for the test hooks of the draft loop."""
    sources = [draft_source] if isinstance(draft_source, str) else list(draft_source)
    if len(sources) not in (1, B):
        raise ValueError(f"draft_source has {len(sources)} entries for {B} prompts")
    for src in sources:
        if src not in DRAFT_SOURCES:
            raise ValueError(f"draft_source {src!r} not in {DRAFT_SOURCES}")
    if ("forced" in sources) != (forced_drafts is not None):
        raise ValueError("forced_drafts must be given exactly when a draft_source is 'forced'")
    sources = sources * B if len(sources) == 1 else sources
    forced = DraftOverride(
        modes=jnp.asarray([DRAFT_SOURCES.index(s) for s in sources], jnp.int32),
        tokens=(jnp.zeros((B, 1), jnp.int32) if forced_drafts is None
                else jnp.asarray(forced_drafts, jnp.int32)))
    return (sources[0] if len(set(sources)) == 1 else "mixed"), forced
