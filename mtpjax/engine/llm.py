"""`mtpjax.LLM`: the batched generator (continuous batching, paged KV cache, MTP speculation).

Reliability contract (docs/engine.md, "Errors, abort, interrupts and threads"):
- a bad argument raises ValueError naming it before anything changes; a full waiting queue raises
  QueueFullError; nothing is ever half-queued;
- an exception or KeyboardInterrupt escaping a step leaves a working engine: every running request
  is preempted (recomputed later), in-flight steps are dropped, the device state is rebuilt if its
  donated buffers were lost;
- `abort` frees a request's blocks and engine slot at once, in any state; a stream that is closed,
  broken out of or garbage collected aborts its requests;
- each stream gets its own events; one lock serializes engine operations across threads.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import math
import os
import sys
import threading
import time
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from mtpjax.compilation_cache import enable_compilation_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig, check_seed
from mtpjax.engine.block_manager import BlockManager
from mtpjax.engine.executable_store import ExecutableStore
from mtpjax.engine.logprobs import TokenLogprobs
from mtpjax.engine.prompt_logprobs import PromptLogprobs
from mtpjax.engine.runner import ModelRunner
from mtpjax.engine.scheduler import Scheduler
from mtpjax.engine.sequence import Sequence, SequenceStatus
from mtpjax.engine.warmup import WarmupProgress, step_buckets
from mtpjax.generate import default_min_token_bucket, finite_flags, warn_non_finite
from mtpjax.sampling import validate_sampling_params
from mtpjax.speculative.adaptive import AcceptanceTable, AdaptiveK
from mtpjax.speculative.draft_vocab import resolve_ids as draft_vocab_ids


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0          # drafts proposed to the target (this request's own k)
    num_accepted_draft_tokens: int = 0
    # SamplingParams.logprobs set: logprobs[i] = {token id: logprob} for the i-th generated token
    # (the token itself and the `logprobs` most likely tokens), else None. A read-only sequence
    # of dicts (`TokenLogprobs`, built on access; compares equal to the list of dicts)
    logprobs: TokenLogprobs | None = None
    # SamplingParams.prompt_logprobs set: [None, {prompt[1]: logprob, ...}, ...] (vLLM's layout:
    # the first prompt token has no logprob), else None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # finish_reason "stop": the stop string found (SamplingParams.stop) or the stop token id
    # (SamplingParams.stop_token_ids); None for eos and any other end (vLLM's field)
    stop_reason: str | int | None = None
    # which of its prompt's SamplingParams.n completions this is (0..n-1; 0 when n = 1)
    sample_index: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (bonus included)."""
        return (self.num_accepted_draft_tokens + self.num_verify_steps) / max(self.num_verify_steps, 1)


@dataclasses.dataclass
class StreamEvent:
    request_index: int                 # index into the prompts given to generate_stream
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None       # set when finished (finish_reason "abort" if aborted)
    request_id: int = -1               # the engine's id of the request (for LLM.abort)
    # the text these tokens complete (with a tokenizer; else ""): the deltas of a request
    # concatenate to its output's text, also where a character spans several tokens
    text_delta: str = ""
    sample_index: int = 0              # which of the prompt's SamplingParams.n completions


class QueueFullError(RuntimeError):
    """add_request refused: the waiting queue already holds `max_waiting_requests` requests.
    Nothing was queued; retry once some requests have been admitted or finished."""


class _Stream:
    """One generate_stream call: its requests, those not yet queued (the waiting queue is bounded,
    so a long prompt list is fed in as room frees up) and those with events not yet yielded."""

    def __init__(self, seqs: list[Sequence], prompt_of: list[int] | None = None):
        self.seqs = seqs
        prompt_of = list(range(len(seqs))) if prompt_of is None else prompt_of
        self.index = {s.seq_id: i for s, i in zip(seqs, prompt_of)}    # -> prompt index
        self.position = {s.seq_id: k for k, s in enumerate(seqs)}       # -> index in seqs
        # SamplingParams.n > 1: a prompt's first sample is queued first; the others wait in
        # `todo` until its prompt is prefilled, so they find the prompt's blocks in the prefix
        # cache instead of prefilling them again side by side
        firsts = {i: s for s, i in zip(seqs, prompt_of) if s.sample_index == 0}
        self.parent = {s.seq_id: firsts[i] for s, i in zip(seqs, prompt_of) if s.sample_index}
        self.todo: collections.deque[Sequence] = collections.deque(    # not queued yet
            [s for s in seqs if not s.sample_index] + [s for s in seqs if s.sample_index])
        self.news: dict[int, Sequence] = {}      # seq_id -> request with something to report
        self.open = set(self.index)              # requests whose final event is not yet yielded
        # seq_id -> IncrementalDetokenizer (tokenizer), or, for a request with stop strings,
        # how many characters of its stop checker's text were streamed
        self.detok: dict[int, Any] = {}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _int_arg(name: str, value, lo: int, hi: int | None = None, *, none_ok: bool = False):
    """`value` as a Python int if it is an int (numpy ints too) in [lo, hi], else ValueError."""
    if value is None and none_ok:
        return None
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}{' or None' if none_ok else ''}, got "
                         f"{name}={value!r}")
    return int(value)


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def check_params(params, cfg: ModelConfig) -> None:
    """ValueError naming the first leaf whose path or shape differs from the config's parameter
    tree (`mtpjax.model.params.abstract_params(cfg)`); dtypes are not compared."""
    from mtpjax.model.fp8_weight import is_fp8
    from mtpjax.model.params import abstract_params
    want = {_path_str(p): tuple(x.shape) for p, x in
            jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]}
    try:
        leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_fp8)[0]   # FP8: one leaf
    except Exception as e:          # noqa: BLE001 -- anything that is not a tree of arrays
        raise ValueError(f"params must be a nested dict of arrays, got {type(params).__name__}") \
            from e
    have = {_path_str(p): x for p, x in leaves}
    for path, shape in want.items():
        if path not in have:
            raise ValueError(f"params do not match the config: missing leaf {path!r} (expected "
                             f"shape {shape})")
        got = getattr(have[path], "shape", None)
        if got is None or tuple(got) != shape:
            raise ValueError(f"params do not match the config: leaf {path!r} has shape "
                             f"{None if got is None else tuple(got)}, expected {shape}")
    extra = [p for p in have if p not in want]
    if extra:
        raise ValueError(f"params do not match the config: unexpected leaf {extra[0]!r} (shape "
                         f"{tuple(getattr(have[extra[0]], 'shape', ()))}) is not in the config's "
                         "parameter tree")


def _prompt_list(prompts) -> list:
    """The prompts argument as a list of prompts; refuses what is surely one prompt (a string, a
    flat list of ids, a 1-D array)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list of prompts; got a single string: pass [prompt]")
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts given as an array must be 2-D [num_prompts, length], got "
                             f"shape {arr.shape}; for one prompt pass [ids]")
        return list(arr)
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError("prompts must be a list of prompts (token-id lists or strings), got "
                         f"{type(prompts).__name__}") from None
    for i, p in enumerate(prompts):
        if _is_int(p):
            raise ValueError(f"prompts must be a list of prompts, each a list of token ids or a "
                             f"string; prompts[{i}] is the int {p!r}. For one prompt pass "
                             f"[[1, 2, 3]], not [1, 2, 3]")
    return prompts


class LLM:
    """Continuous-batching generator.

    params/cfg: the model (the params tree must match `cfg`); spec: SpecConfig for MTP
    speculative decoding, None for plain decoding. num_pages x page_size: the paged KV cache.
    max_num_seqs / max_num_batched_tokens: per-step limits. max_model_len: prompt + completion
    limit (default and maximum: cfg.max_position_embeddings). eos_token_id: finishes requests
    (unless ignore_eos). tokenizer: anything with encode(str) -> ids and decode(ids) -> str
    (optional); with it a prompt may be a string, outputs carry `text` and stream events
    `text_delta`. chat_template: a `mtpjax.serve.ChatTemplate` or jinja template text (or None;
    `from_pretrained` takes the folder's, as transformers finds it); with it and a tokenizer a
    prompt may be a list of chat messages [{"role": ..., "content": ...}], rendered with the
    generation cue and encoded without the tokenizer's own special tokens (the template writes
    them). seed: base of the per-request keys of unseeded sampled requests.
    async_scheduling (default True): schedule and dispatch step t+1 before reading step t back,
    so host work overlaps the device; each `step()` then returns the previous step's tokens.
    Outputs are identical either way (docs/engine.md, "Asynchronous scheduling").
    warmup: compile the step for every bucket the engine can reach (`engine/warmup.py`) before
    returning, with a progress bar and each bucket's compile time on stderr, so serving never
    compiles. Default (None): on when JAX's default backend is not the CPU (GPU/TPU steps take
    seconds to compile; on the CPU the tests' tiny engines would pay for buckets they never use).
    `MTPJAX_WARMUP_THREADS` (default min(4, CPU count)) compiles that many buckets at once.
    JAX's persistent compilation cache is turned on first (`mtpjax/compilation_cache.py`), and
    the warmed-up steps are kept whole in an executable store (`engine/executable_store.py`), so
    a second process loads them from disk without tracing them. executable_cache: None (the
    default store, on with the compilation cache), False (off), or a folder.
    mesh: a jax.sharding.Mesh with axes ("data", "model") (`mtpjax.make_mesh`); params and the
    device state are placed by the sharding table and the step runs on it (docs/parallel.md).
    max_waiting_requests (default 1024, None = unbounded): `add_request` raises QueueFullError
    when this many requests wait; `generate`/`generate_stream` feed their prompts in as room frees.
    draft_vocab: with `SpecConfig(draft_vocab_size=N)`, the token ids drafts come from (N ids,
    or ranked ids of which the first N are taken; speculative/draft_vocab.py).
    fuse_projections: serve with q/k/v and gate/up weights concatenated once (one GEMM each;
    `model/fused.py`; one device only; the fused matrices are new arrays beside the caller's):
    True / "all" both groups, "qkv" only q/k/v.
    min_token_bucket: the smallest step shape, a power of two. A step's tokens and its MTP
    first pass are padded to powers of two >= it, each compiled once; 1 adds the buckets 1, 2
    and 4 (three more compiles per first-pass size) and lets a batch-1 decode run unpadded.
    None (default): 1 for MoE models, 8 for dense ones (`default_min_token_bucket`;
    docs/engine.md, "Step buckets").

    Thread-safe: one lock serializes engine operations; several threads may call generate at once
    and share the batch. Errors and interrupts: see the module docstring and docs/engine.md.
    """

    def __init__(self, params, cfg: ModelConfig, spec: SpecConfig | None = None, *,
                 num_pages: int, page_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 tokenizer=None, chat_template=None, max_model_len: int | None = None,
                 eos_token_id: int | None = None,
                 attention_impl="auto", seed: int = 0, async_scheduling: bool = True,
                 max_waiting_requests: int | None = 1024, warmup: bool | None = None,
                 max_logprobs: int = 0, adaptive_k: AdaptiveK | None = None, mesh=None,
                 draft_vocab=None, executable_cache: str | bool | None = None,
                 fuse_projections: bool | str = False,
                 min_token_bucket: int | None = None):
        if not isinstance(cfg, ModelConfig):
            raise ValueError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        if spec is not None:
            if not isinstance(spec, SpecConfig):
                raise ValueError(f"spec must be a SpecConfig or None, got {type(spec).__name__}")
            spec.check_model(cfg)
        num_pages = _int_arg("num_pages", num_pages, 1)
        page_size = _int_arg("page_size", page_size, 1)
        max_num_seqs = _int_arg("max_num_seqs", max_num_seqs, 1)
        max_num_batched_tokens = _int_arg("max_num_batched_tokens", max_num_batched_tokens, 1)
        max_model_len = _int_arg("max_model_len", max_model_len, 1, cfg.max_position_embeddings,
                                 none_ok=True)
        eos_token_id = _int_arg("eos_token_id", eos_token_id, 0, cfg.vocab_size - 1, none_ok=True)
        self.max_waiting_requests = _int_arg("max_waiting_requests", max_waiting_requests, 1,
                                             none_ok=True)
        seed = check_seed("seed", seed)
        max_logprobs = _int_arg("max_logprobs", max_logprobs, 0, cfg.vocab_size)
        if min_token_bucket is None:
            min_token_bucket = default_min_token_bucket(cfg)
        min_token_bucket = _int_arg("min_token_bucket", min_token_bucket, 1)
        if min_token_bucket & (min_token_bucket - 1):
            raise ValueError(f"min_token_bucket must be a power of two, got "
                             f"min_token_bucket={min_token_bucket}")
        if adaptive_k is not None and not isinstance(adaptive_k, AdaptiveK):
            raise ValueError(f"adaptive_k must be an AdaptiveK or None, got "
                             f"{type(adaptive_k).__name__}")
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("async_scheduling", async_scheduling), ("warmup", warmup)):
            if not isinstance(flag, (bool, np.bool_)) and not (name == "warmup" and flag is None):
                raise ValueError(f"{name} must be a bool, got {name}={flag!r}")
        if tokenizer is not None and not (callable(getattr(tokenizer, "encode", None))
                                          and callable(getattr(tokenizer, "decode", None))):
            raise ValueError(f"tokenizer must have encode(str) and decode(ids), got "
                             f"{type(tokenizer).__name__}")
        if executable_cache is not None and executable_cache is not False and \
                not isinstance(executable_cache, (str, os.PathLike)):
            raise ValueError(f"executable_cache must be None, False or a folder, got "
                             f"executable_cache={executable_cache!r}")
        check_params(params, cfg)
        from mtpjax.model.fused import check_fusable, fusion_groups
        if fusion_groups(fuse_projections):
            from mtpjax.parallel import check_mesh
            check_fusable(check_mesh(mesh))
        vocab_ids = draft_vocab_ids(cfg, spec, draft_vocab)
        enable_compilation_cache()
        store = (ExecutableStore.default() if executable_cache is None else
                 None if executable_cache is False else ExecutableStore(os.fspath(executable_cache)))
        self.cfg, self.spec, self.tokenizer = cfg, spec, tokenizer
        self.chat_template = _chat_template(chat_template)
        K = spec.num_speculative_tokens if spec else 0
        chain = spec is not None and spec.method == "chain"
        # chain drafting writes MTP KV up to K-1 slots past the verify window (docs/engine.md);
        # a module's KV at position i depends on up to K tokens after i (1 for chain).
        lookahead = max(K - 1, 0) if chain else 0
        hash_lookahead = (1 if chain else K) if spec else 0
        self.max_model_len = cfg.max_position_embeddings if max_model_len is None else max_model_len
        self.block_manager = BlockManager(num_pages, page_size, bool(enable_prefix_caching),
                                          num_hash_lookahead_tokens=hash_lookahead)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   num_speculative_tokens=K, num_lookahead_tokens=lookahead,
                                   max_model_len=self.max_model_len, eos_token_id=eos_token_id,
                                   async_scheduling=bool(async_scheduling))
        self.async_scheduling = bool(async_scheduling)
        # the largest reservation: a decode with another in flight, P + M - 2 + 2(K + 1) + L
        max_blocks = math.ceil((self.max_model_len + 2 * (K + 1) + lookahead) / page_size)
        self.runner = ModelRunner(params, cfg, spec, num_pages=num_pages, page_size=page_size,
                                  max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks,
                                  seed=seed, attention_impl=attention_impl,
                                  max_logprobs=max_logprobs, mesh=mesh, draft_vocab=vocab_ids,
                                  fuse_projections=fuse_projections,
                                  executable_store=store, min_token_bucket=min_token_bucket)
        # NaN / inf weights make every token id 0; warned once here (read after the warm-up,
        # so nothing waits for it), never checked per step
        finite = finite_flags(self.runner.params)
        self.max_logprobs = max_logprobs
        self.adaptive_k = adaptive_k
        self._acceptance = AcceptanceTable(self.spec.num_speculative_tokens if self.spec else 0)
        self._inflight = None                       # (SchedulerOutput, result) dispatched, unread
        self._grammars = None       # structured.compiler.GrammarCache, on the first grammar
        self.warmup_times: list[tuple[int, int, float]] = []    # (T, F, compile seconds)
        if warmup is None:
            warmup = jax.default_backend() != "cpu"
        if warmup:
            self._warmup(max_num_batched_tokens, max_num_seqs)
        warn_non_finite(finite, "mtpjax.LLM")
        _freeze_startup_objects()
        self._next_id = 0
        # Every request the engine holds, until its final output is handed over (step() result,
        # a stream's final event, abort()'s return value); never longer.
        self._requests: dict[int, Sequence] = {}
        self._stream_of: dict[int, _Stream] = {}    # seq_id -> its generate_stream
        self._streams: list[_Stream] = []           # open streams, oldest first
        self._direct_news: dict[int, Sequence] = {}  # add_request requests with news for step()
        self._lock = threading.Lock()
        self._holder: int | None = None             # thread holding _lock
        self._deferred: list[_Stream] = []          # streams closed during an operation
        self._needs_recovery = False
        self.num_steps = 0
        self.num_preemptions = 0

    def _warmup(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        buckets = step_buckets(max_num_batched_tokens, max_num_seqs, self.runner.W,
                               self.runner.min_bucket)
        threads = int(os.environ.get("MTPJAX_WARMUP_THREADS", min(4, os.cpu_count() or 1)))
        # loading a stored executable is file reading and GPU module loading, not compiling:
        # more of them at once (measured at the 8B shape: 44 programs, 4 threads -> 14.6 s)
        load_threads = max(threads, min(16, os.cpu_count() or 1))
        with WarmupProgress(len(buckets)) as bar:
            def done(T, F, seconds):
                self.warmup_times.append((T, F, seconds))
                bar.update(T, F, seconds)
            self.runner.warmup(buckets, on_compiled=done, threads=threads,
                               load_threads=load_threads)
        store = self.runner.store
        if store is not None and store.hits:
            print(f"warm-up: {store.hits} step programs loaded from the executable store "
                  f"{store.folder} ({self.runner.load_seconds:.1f} s, {load_threads} threads), "
                  f"{store.misses} compiled", file=sys.stderr, flush=True)

    # ---- locking -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _engine(self):
        """Holds the engine lock for one operation; repairs the engine first if an earlier
        recovery was itself interrupted; closes streams finalized meanwhile."""
        if self._holder == threading.get_ident():
            raise RuntimeError("LLM is not re-entrant: an LLM method was called from inside "
                               "another LLM call on the same thread (e.g. from a tokenizer)")
        with self._lock:
            self._holder = threading.get_ident()
            try:
                if self._needs_recovery:
                    self._recover()
                yield
            finally:
                try:
                    while self._deferred and not self._needs_recovery:
                        self._close_stream(self._deferred.pop())
                finally:
                    self._holder = None

    # ---- requests ------------------------------------------------------------------------------
    def _encode(self, prompt, i: int) -> list[int]:
        """Prompt i (a string, chat messages, a list of ids, a 1-D integer array) as a list of
        valid ids."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict)
                                                                for m in prompt):
            prompt = self._encode_chat(prompt, i)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("got a string prompt but the LLM has no tokenizer")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            for j, t in enumerate(prompt):
                if not _is_int(t):
                    raise ValueError(f"prompt {i}: token ids must be ints, got {t!r} "
                                     f"({type(t).__name__}) at position {j}")
            ids = [int(t) for t in prompt]
        elif hasattr(prompt, "__array__"):
            arr = np.asarray(prompt)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"prompt {i} must be a 1-D sequence of integer token ids, got an "
                                 f"array of shape {arr.shape} and dtype {arr.dtype}")
            ids = arr.tolist()
        else:
            raise ValueError(f"prompt {i} must be a list of token ids or a string, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"empty prompt (prompt {i}): every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size}) "
                             f"(prompt {i})")
        return ids

    def _encode_chat(self, messages, i: int) -> list[int]:
        if self.tokenizer is None or self.chat_template is None:
            raise ValueError(f"prompt {i} is a list of chat messages, but the LLM has no "
                             f"{'tokenizer' if self.tokenizer is None else 'chat_template'} "
                             "(LLM(..., tokenizer=, chat_template=) or LLM.from_pretrained)")
        for j, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"prompt {i}, message {j}: expected {{'role': str, 'content': "
                                 f"str}}, got {m!r}")
        text = self.chat_template.render([dict(m) for m in messages])
        encode = getattr(self.tokenizer, "encode_chat", None) or self.tokenizer.encode
        return encode(text)

    def _new_requests(self, prompts: list, sampling_params, *, single: bool = False,
                      samples: bool = False):
        """Validated Sequences with the next free ids; nothing is queued or reserved (the caller
        commits the ids with `self._next_id += n`), so an error here changes nothing. Errors
        name the prompt's position in the call (single: add_request's one prompt).
        samples: expand SamplingParams.n into n requests per prompt, sample j seeded with
        (seed + j) mod 2**32 when the request has a seed (as vLLM derives them; unseeded ones
        get the engine's per-request keys, distinct by request id), and return (seqs, the
        prompt index of each); without it n > 1 is refused."""
        sps = validate_sampling_params(
            sampling_params, len(prompts), vocab_size=self.cfg.vocab_size,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
            max_logprobs=self.max_logprobs, caller="LLM")
        seqs, prompt_of = [], []
        shared = sampling_params is None or isinstance(sampling_params, SamplingParams)
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            where = "sampling_params" if shared else f"sampling_params[{i}]"
            if sp.stop and self.tokenizer is None:
                raise ValueError(f"{where}: stop={list(sp.stop)!r} (prompt {i}), but the LLM has "
                                 "no tokenizer to find stop strings in the text; pass "
                                 "LLM(..., tokenizer=) or use stop_token_ids")
            if sp.structured_output is not None:
                self._check_structured(sp, where, i)
            if sp.n > 1 and not samples:
                raise ValueError(f"{where}: n={sp.n} (prompt {i}): several samples per prompt "
                                 "need LLM.generate or LLM.generate_stream (add_request and "
                                 "DataParallelLLM run one completion per request); expected n=1")
            ids = self._encode(p, i)
            for j in range(sp.n):
                spj = sp if sp.n == 1 else dataclasses.replace(
                    sp, n=1, seed=None if sp.seed is None else (sp.seed + j) % 2**32)
                seq = Sequence(ids, sampling_params=spj, seq_id=self._next_id + len(seqs))
                seq.sample_index = j
                self.scheduler.check(seq, "the request" if single else f"prompt {i}")
                seq.logprobs = TokenLogprobs(sp.logprobs) if sp.logprobs is not None else None
                if sp.stop:
                    from mtpjax.serve.stop_strings import TokenStopChecker
                    seq.stop_checker = TokenStopChecker(self.tokenizer.decode,
                                                        seq.prompt_token_ids, sp.stop,
                                                        sp.include_stop_str_in_output)
                if sp.structured_output is not None:
                    seq.grammar = self._request_grammar(sp.structured_output, where, i)
                seqs.append(seq)
                prompt_of.append(i)
        for seq in seqs:         # all valid: dispatch the extra prompt passes (asynchronous)
            sp = seq.sampling_params
            if sp.prompt_logprobs is not None:
                seq.prompt_lp = PromptLogprobs(self.runner.params, self.cfg,
                                               list(seq.prompt_token_ids), sp, self.max_logprobs)
        return (seqs, prompt_of) if samples else seqs

    def _check_structured(self, sp: SamplingParams, where: str, i: int) -> None:
        """A request with structured output needs a tokenizer (the grammar is over text) and an
        eos token (where the grammar ends)."""
        if self.tokenizer is None or self.scheduler.eos_token_id is None:
            missing = "tokenizer" if self.tokenizer is None else "eos_token_id"
            raise ValueError(f"{where}: structured_output (prompt {i}) needs the LLM's "
                             f"{missing}: the grammar is matched on the tokenizer's text and "
                             f"the completion ends with the eos token; use "
                             f"LLM.from_pretrained or pass LLM(..., tokenizer=, eos_token_id=)")

    def _request_grammar(self, spec, where: str, i: int):
        """A fresh matcher of the spec's grammar (compiled once per distinct spec)."""
        from mtpjax.structured.compiler import GrammarCache
        from mtpjax.structured.matcher import RequestGrammar
        stops = [self.scheduler.eos_token_id]
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.cfg.vocab_size, stops)
        try:
            compiled = self._grammars.compile(spec)
        except ValueError as e:
            raise ValueError(f"{where} (prompt {i}): {e}") from None
        return RequestGrammar(compiled, self.cfg.vocab_size, stops)

    def _has_room(self) -> bool:
        return (self.max_waiting_requests is None
                or len(self.scheduler.waiting) < self.max_waiting_requests)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> Sequence:
        """Validates and queues one request (its id: `seq.seq_id`). Raises ValueError for a bad
        request, QueueFullError when `max_waiting_requests` wait; either way nothing changes.
        Its tokens come back from `step()`; the one `step()` result with `seq.is_finished` is
        its last, `get_output(seq)` turns it into a RequestOutput."""
        with self._engine():
            if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
                raise ValueError(f"sampling_params must be a SamplingParams or None, got "
                                 f"{type(sampling_params).__name__}")
            seq, = self._new_requests([prompt], sampling_params, single=True)
            if not self._has_room():
                raise QueueFullError(
                    f"the waiting queue holds max_waiting_requests={self.max_waiting_requests} "
                    "requests; retry after some are admitted (step()) or raise the limit")
            self._next_id += 1
            self._requests[seq.seq_id] = seq
            self.scheduler.waiting.append(seq)          # checked by _new_requests
            return seq

    def abort(self, request) -> RequestOutput:
        """Stops a request (a Sequence or its id) in any state — waiting, prefilling, decoding,
        preempted, with a step in flight — and frees its blocks and engine slot at once. Returns
        its output so far (finish_reason "abort"); a generate_stream owning it also yields that
        as the request's final event. A request the engine does not hold (unknown id, finished,
        already aborted) raises ValueError and nothing changes."""
        rid = request.seq_id if isinstance(request, Sequence) else request
        if not _is_int(rid):
            raise ValueError(f"abort takes a request id (int) or a Sequence, got {request!r}")
        with self._engine():
            seq = self._requests.get(int(rid))
            if seq is None or seq.is_finished:
                # ids are handed out in order and only to valid requests, so one below the next
                # id that the engine no longer holds was a request whose final output was
                # already handed over (finished or aborted)
                state = ("unknown (no request has this id)"
                         if seq is None and not 0 <= rid < self._next_id else
                         "already finished, and its final output was handed over"
                         if seq is None else f"already finished ({seq.finish_reason})")
                raise ValueError(f"cannot abort request {rid}: {state}; only requests the engine "
                                 "still runs or queues can be aborted")
            self._abort(seq)
            out = self._output(seq)
            stream = self._stream_of.get(seq.seq_id)
            if stream is not None:
                stream.news[seq.seq_id] = seq           # its stream yields the final event
            else:
                self._forget(seq)
            return out

    def _abort(self, seq: Sequence) -> None:
        sched = self.scheduler
        if seq in sched.running or seq in sched.waiting:
            sched.abort(seq)                            # blocks freed, in-flight rows void
        else:                                           # not queued yet (stream feeding)
            stream = self._stream_of.get(seq.seq_id)
            if stream is not None and seq in stream.todo:
                stream.todo.remove(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.runner.release(seq.seq_id)                 # the slot: free at once

    def get_output(self, request) -> RequestOutput:
        """The RequestOutput of a request (a Sequence, or the id of one the engine still holds):
        final once `request.is_finished`, a snapshot (finish_reason None) before."""
        if not isinstance(request, Sequence) and not _is_int(request):
            raise ValueError(f"get_output takes a Sequence or a request id, got {request!r}")
        with self._engine():
            seq = request if isinstance(request, Sequence) else self._requests.get(int(request))
            if seq is None:
                raise ValueError(f"request {request} is not held by the engine (unknown, or its "
                                 "final output was already handed over): pass the Sequence that "
                                 "add_request returned")
            return self._output(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        toks = list(seq.completion_token_ids)
        chk, stop_reason = seq.stop_checker, None
        if chk is not None:
            # the text never goes past a stop string (held back until the request ends)
            if seq.is_finished:
                chk.finish()
            text, stop_reason = chk.text, chk.stop_reason
        else:
            text = self.tokenizer.decode(toks) if self.tokenizer is not None else None
        if seq.finish_reason == "stop" and stop_reason is None and toks \
                and toks[-1] in seq.stop_token_ids:
            stop_reason = toks[-1]
        lps = getattr(seq, "logprobs", None)
        return RequestOutput(seq.seq_id, list(seq.prompt_token_ids), toks, text,
                             seq.finish_reason, seq.num_verify_steps, seq.num_draft_tokens,
                             seq.num_accepted_draft_tokens,
                             None if lps is None else lps.snapshot(),
                             None if seq.prompt_lp is None else seq.prompt_lp.result(),
                             stop_reason, seq.sample_index)

    @property
    def _metrics(self) -> dict[int, list[int]]:
        """(debugging) draft counters of the requests the engine holds."""
        return {i: [s.num_verify_steps, s.num_draft_tokens, s.num_accepted_draft_tokens]
                for i, s in self._requests.items()}

    # ---- reporting -----------------------------------------------------------------------------
    def _touch(self, seq: Sequence) -> None:
        """`seq` has committed tokens or an end to report: route it to its owner."""
        stream = self._stream_of.get(seq.seq_id)
        if stream is not None:
            stream.news[seq.seq_id] = seq
        elif seq.seq_id in self._requests:
            self._direct_news[seq.seq_id] = seq

    def _take(self, seq: Sequence) -> tuple[list[int], bool]:
        """The completion tokens not reported yet, and whether the request is done; a done
        request is forgotten (this is its final report)."""
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_reported_tokens:]
        seq.num_reported_tokens += len(new)
        if seq.is_finished:
            self._forget(seq)
        return new, seq.is_finished

    def _forget(self, seq: Sequence) -> None:
        self._acceptance.drop(seq.seq_id)
        self._requests.pop(seq.seq_id, None)
        self._stream_of.pop(seq.seq_id, None)
        self._direct_news.pop(seq.seq_id, None)

    def _direct_updates(self) -> list[tuple[Sequence, list[int]]]:
        news, self._direct_news = self._direct_news, {}
        return [(seq, self._take(seq)[0]) for seq in news.values()]

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One engine step. Returns (sequence, newly committed tokens) for the add_request
        requests that progressed: in the step that completed — this one (synchronous) or the
        previous one (async scheduling) — or in steps that generate calls ran meanwhile. A
        request appears with `seq.is_finished` exactly once, then the engine forgets it.
        If the step raises (any exception, KeyboardInterrupt included), the engine has already
        recovered: running requests were preempted and will be recomputed."""
        with self._engine():
            self._top_up()
            self._guarded(self._step)
            return self._direct_updates()

    def flush(self) -> list[tuple[Sequence, list[int]]]:
        """Reads back and applies the step still in flight (async scheduling), if any."""
        with self._engine():
            self._guarded(self._flush)
            return self._direct_updates()

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException:
            self._recover()
            raise

    def _step(self) -> None:
        self._reclaim_slots()
        if self._inflight is not None and _has_grammar(self._inflight[0]):
            # a grammar row's next masks follow the drafts and tokens this step returns: only
            # batches with such a row wait for their readback before the next schedule
            self._flush()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.runner.release(seq.seq_id)
        self.num_preemptions += len(out.preempted)
        if out.is_empty:
            launched = None
        else:
            ks = self._draft_counts(out)
            K = self.spec.num_speculative_tokens if self.spec else 0
            launched = (out, self.runner.dispatch(out, None if all(k == K for k in ks) else ks),
                        ks)
        if self.async_scheduling:
            launched, self._inflight = self._inflight, launched
        if launched is None:
            if out.preempted or self._inflight is not None or self.scheduler.is_finished():
                return
            raise RuntimeError("scheduler produced an empty step with unfinished requests")
        self._complete(*launched)

    def _flush(self) -> None:
        launched, self._inflight = self._inflight, None
        if launched is not None:
            self._complete(*launched)

    def _reclaim_slots(self) -> None:
        """Slots of requests that left `running` behind the engine's back (Scheduler.abort):
        freed, and the request reported finished to its owner."""
        if len(self.runner.slot_of) > len(self.scheduler.running):
            running = {s.seq_id for s in self.scheduler.running}
            for sid in [k for k in self.runner.slot_of if k not in running]:
                self.runner.release(sid)
                seq = self._requests.get(sid)
                if seq is not None and seq.is_finished:
                    self._touch(seq)

    def _draft_counts(self, out) -> list[int]:
        """Drafts each scheduled request verifies this step: its SamplingParams'
        num_speculative_tokens (default K), lowered by the adaptive-K policy if any."""
        K = self.spec.num_speculative_tokens if self.spec else 0
        batch = len(out.decodes)
        ks = []
        for req in out.requests:
            k = getattr(req.seq.sampling_params, "num_speculative_tokens", None)
            ks.append(K if k is None else k)
        if self.adaptive_k is not None:
            pick = [i for i, req in enumerate(out.requests) if not req.is_prefill and ks[i]]
            if pick:
                chosen = self._acceptance.choose(self.adaptive_k,
                                                 [out.requests[i].seq_id for i in pick],
                                                 [ks[i] for i in pick], batch)
                for i, k in zip(pick, chosen.tolist()):
                    ks[i] = k
        return ks

    def _complete(self, out, result, ks=None) -> None:
        """Reads a dispatched step back, applies it and routes the news."""
        committed = self.runner.collect(out, result)
        lps, lp_row = None, {}
        if self.max_logprobs:
            asked = [i for i, r in enumerate(out.requests) if r.seq.logprobs is not None]
            if asked:
                lps, lp_row = self.runner.logprobs(result, asked), {i: a for a, i in enumerate(asked)}
        live = [not self.scheduler.is_void(out, r) for r in out.requests]
        before = [r.seq.num_tokens for r in out.requests]
        K = self.spec.num_speculative_tokens if self.spec else 0
        ks = [K] * len(out.requests) if ks is None else ks
        self.scheduler.postprocess(out, committed)
        if _has_grammar(out):
            self.runner.record_drafts(out, result)
        self.num_steps += 1
        observed = []             # (seq_id, drafts proposed, drafts accepted) for adaptive K
        for i, (req, toks, was_live) in enumerate(zip(out.requests, committed, live)):
            if not was_live:
                continue      # preempted, finished or aborted after dispatch: a wasted row
            seq = req.seq
            if i in lp_row:                  # (rows whose request has a TokenLogprobs)
                seq.logprobs.append_step(toks[:seq.num_tokens - before[i]], lps, lp_row[i])
            if not req.is_prefill and K:
                seq.num_verify_steps += 1
                seq.num_draft_tokens += ks[i]
                seq.num_accepted_draft_tokens += len(toks) - 1
                if self.adaptive_k is not None and not seq.is_finished:
                    observed.append((seq.seq_id, ks[i], len(toks) - 1))
            if seq.is_finished:
                self.runner.release(seq.seq_id)
            self._touch(seq)
        if observed:
            sids, used, kept = zip(*observed)
            self._acceptance.observe(sids, used, kept, self.adaptive_k.decay)

    def _recover(self) -> None:
        """Makes the engine consistent after an exception escaped a step part-way (or a previous
        recovery was interrupted; it is idempotent). The results of the steps in flight are lost,
        so every running request is preempted: blocks freed (the allocator is rebuilt, the prefix
        cache kept), slot released, recomputed later from its committed tokens, which the caller
        still receives exactly once. If the step's donated device state did not come back, the
        cache and slot state are rebuilt and the prefix cache is dropped."""
        self._needs_recovery = True
        self._inflight = None
        sched = self.scheduler
        queued = {id(s) for s in sched.running} | {id(s) for s in sched.waiting} | {
            id(s) for st in self._streams for s in st.todo}
        orphans = [s for s in self._requests.values()
                   if not s.is_finished and id(s) not in queued]
        self.num_preemptions += len(sched.running)
        sched.requeue_all(orphans)
        lost = self._device_state_lost()
        if lost:
            self.runner.reset_state()
        else:
            self.runner.release_all()
        self.block_manager.reset(keep_prefix_cache=not lost)
        for seq in self._requests.values():
            if seq.is_finished or seq.num_reported_tokens < seq.num_completion_tokens:
                self._touch(seq)
        self._needs_recovery = False

    def _device_state_lost(self) -> bool:
        state = self.runner.state
        if state is None:
            return True
        try:
            if any(x.is_deleted() for x in jax.tree.leaves(state)):
                return True             # donated to a step whose new state never came back
            jax.block_until_ready(state)
            return False
        except Exception:               # noqa: BLE001 -- a step that failed on the device
            return True

    # ---- streams -------------------------------------------------------------------------------
    def _top_up(self) -> None:
        """Feed the open streams' requests into the waiting queue while it has room."""
        for stream in self._streams:
            while stream.todo and self._has_room():
                parent = stream.parent.get(stream.todo[0].seq_id)
                if parent is not None and not (parent.num_completion_tokens or parent.is_finished
                                               or not self.block_manager.enable_prefix_caching):
                    break       # n > 1: wait until the prompt's first sample has prefilled it
                self.scheduler.waiting.append(stream.todo[0])   # checked at creation
                stream.todo.popleft()

    def _stream_events(self, stream: _Stream) -> list[StreamEvent]:
        news, stream.news = stream.news, {}
        events = []
        for seq in news.values():
            new, done = self._take(seq)
            if new or done:
                events.append(StreamEvent(stream.index[seq.seq_id], new, done,
                                          self._output(seq) if done else None, seq.seq_id,
                                          self._text_delta(stream, seq, new, done),
                                          seq.sample_index))
            if done:
                stream.open.discard(seq.seq_id)
        return events

    def _text_delta(self, stream: _Stream, seq: Sequence, new: list[int], done: bool) -> str:
        if self.tokenizer is None:
            return ""
        chk = seq.stop_checker
        if chk is not None:
            # its checker already decoded the committed tokens: stream the text it deems safe
            if done:
                chk.finish()
            sent = stream.detok.pop(seq.seq_id, 0)
            if not done:
                stream.detok[seq.seq_id] = len(chk.text)
            return chk.text[sent:]
        from mtpjax.serve.detokenize import IncrementalDetokenizer
        detok = stream.detok.get(seq.seq_id)
        if detok is None:
            detok = stream.detok[seq.seq_id] = IncrementalDetokenizer(
                self.tokenizer.decode, list(seq.prompt_token_ids))
        delta = detok.push(new)
        if done:
            delta += detok.finish()
            del stream.detok[seq.seq_id]
        return delta

    def _close_stream(self, stream: _Stream) -> None:
        """Aborts what a closed stream still holds (its consumer is gone) and forgets it."""
        if stream in self._streams:
            self._streams.remove(stream)
        never_queued = {id(s) for s in stream.todo}
        stream.todo.clear()
        for seq in stream.seqs:
            if seq.seq_id in stream.open:
                if not seq.is_finished:
                    if id(seq) in never_queued:
                        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                    else:
                        self._abort(seq)
                self._forget(seq)
        stream.open.clear()
        stream.news.clear()

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """Yields StreamEvents as tokens commit. Every prompt is validated before any is queued
        (ValueError, nothing queued). Streams are independent: several may be consumed
        alternately, or from several threads. Closing the generator early (break, close(),
        garbage collection, an exception) aborts its unfinished requests."""
        stream = None
        # bound now: a generator finalized at interpreter exit runs its `finally` after module
        # teardown, when globals may already be None; the engine is going away then anyway
        finalizing = sys.is_finalizing
        try:
            with self._engine():
                seqs, prompt_of = self._new_requests(_prompt_list(prompts), sampling_params,
                                                     samples=True)
                self._next_id += len(seqs)
                stream = _Stream(seqs, prompt_of)
                for seq in seqs:
                    self._requests[seq.seq_id] = seq
                    self._stream_of[seq.seq_id] = stream
                self._streams.append(stream)
            while stream.open:
                with self._engine():
                    self._top_up()
                    if not stream.news:
                        self._guarded(self._step)
                        if not stream.news and self._idle():
                            self._lost_requests(stream)
                    events = self._stream_events(stream)
                yield from events
        finally:
            if stream is not None and not finalizing():
                if self._holder == threading.get_ident():
                    self._deferred.append(stream)      # finalized inside an engine operation
                else:
                    with self._engine():
                        self._close_stream(stream)

    def _idle(self) -> bool:
        return (self.scheduler.is_finished() and self._inflight is None
                and not any(st.todo for st in self._streams))

    def _lost_requests(self, stream: _Stream) -> None:
        """The engine is idle but the stream still waits: report requests that finished behind
        its back (Scheduler.abort); anything else would be a bug, never a hang."""
        for sid in list(stream.open):
            seq = stream.seqs[stream.position[sid]]
            if not seq.is_finished:
                raise RuntimeError(f"internal error: request {sid} is in no queue of an idle "
                                   f"engine ({seq!r})")
            stream.news[sid] = seq

    def generate(self, prompts, sampling_params=None, *, progress: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (token-id lists or strings); outputs in prompt order. A
        prompt with SamplingParams(n=k) has k outputs, one after another in sample order
        (`RequestOutput.sample_index`), so n = 1 everywhere gives one output per prompt."""
        prompts = _prompt_list(prompts)
        return collect_outputs(self.generate_stream(prompts, sampling_params), len(prompts),
                               progress)

    @classmethod
    def from_pretrained(cls, path: str, spec: SpecConfig | None = None, *, dtype=None,
                        mesh=None, fp8: str | None = None, **llm_kwargs) -> "LLM":
        """An LLM over a Hugging Face folder or an Orbax folder (`mtpjax convert`), with its
        tokenizer and eos id unless given, and, for `SpecConfig(draft_vocab_size=N)`, the
        folder's draft_vocab.json (ranked ids; the first N) unless `draft_vocab` is given;
        `llm_kwargs` as for `LLM(...)` (num_pages, ...). fp8: an FP8 checkpoint's weights "keep"
        (the default) or "dequantize" (docs/fp8.md)."""
        params, cfg, llm_kwargs = load_for_engine(path, spec, dtype, mesh, llm_kwargs, fp8)
        return cls(params, cfg, spec, mesh=mesh, **llm_kwargs)


def _has_grammar(out) -> bool:
    """Does a scheduled step hold a structured-output request?"""
    return any(req.seq.grammar is not None for req in out.requests)


def _chat_template(template):
    """LLM's chat_template argument as a ChatTemplate (or None)."""
    if template is None:
        return None
    from mtpjax.serve.chat_template import ChatTemplate
    if isinstance(template, str):
        return ChatTemplate(template)
    if not isinstance(template, ChatTemplate):
        raise ValueError(f"chat_template must be a ChatTemplate, jinja template text or None, got "
                         f"{type(template).__name__}")
    return template


class _ChatTokenizer:
    """A checkpoint's tokenizer plus `encode_chat`: rendered chats are encoded without the
    tokenizer's own special tokens, since the template writes them (as transformers does)."""

    def __init__(self, tokenizer, encode_chat):
        self._tokenizer, self.encode_chat = tokenizer, encode_chat

    def encode(self, text):
        return self._tokenizer.encode(text)

    def decode(self, ids):
        return self._tokenizer.decode(ids)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def collect_outputs(events: Iterator[StreamEvent], num_prompts: int,
                    progress: bool = False) -> list[RequestOutput]:
    """The final RequestOutputs of a generate_stream, in prompt order (the stream is closed
    at the end, early on an exception); with a progress bar when asked."""
    outputs: list[dict[int, Any]] = [{} for _ in range(num_prompts)]   # sample -> output
    bar = _Progress(num_prompts) if progress else None
    with contextlib.closing(events):
        for ev in events:
            if ev.finished:
                outputs[ev.request_index][ev.sample_index] = ev.output
                if bar:
                    bar.update(ev.output)
    if bar:
        bar.close()
    return [o.get(j) for o in outputs for j in (sorted(o) or [0])]


def load_for_engine(path: str, spec, dtype, mesh, llm_kwargs: dict, fp8: str | None = None):
    """(params, cfg, llm_kwargs with the folder's tokenizer, eos id and — for
    `SpecConfig(draft_vocab_size=N)` — draft_vocab.json unless given): `from_pretrained`'s load."""
    from mtpjax.checkpoint import load_pretrained
    from mtpjax.speculative.draft_vocab import load_ranked_ids
    ckpt = load_pretrained(path, dtype, spec=spec, mesh=mesh, fp8=fp8)
    llm_kwargs = dict(llm_kwargs)
    llm_kwargs.setdefault("tokenizer", ckpt.tokenizer)
    if "chat_template" not in llm_kwargs and llm_kwargs["tokenizer"] is ckpt.tokenizer \
            and ckpt.tokenizer is not None:
        from mtpjax.serve.chat_template import ChatTemplate, ChatTemplateError, chat_encoder
        try:
            llm_kwargs["chat_template"] = ChatTemplate.from_folder(path)
        except ChatTemplateError as e:
            # token-id and text prompts still work; chat prompts then say there is no template
            warnings.warn(f"{e}; chat prompts are refused (pass LLM(..., chat_template=))",
                          stacklevel=3)
        else:
            llm_kwargs["tokenizer"] = _ChatTokenizer(ckpt.tokenizer, chat_encoder(
                path, ckpt.tokenizer.encode))
    llm_kwargs.setdefault("eos_token_id", ckpt.eos_token_id)
    if spec is not None and spec.draft_vocab_size is not None \
            and llm_kwargs.get("draft_vocab") is None:
        llm_kwargs["draft_vocab"] = load_ranked_ids(path)
    return ckpt.params, ckpt.cfg, llm_kwargs


_FROZEN = False


def _freeze_startup_objects() -> None:
    """Once per process, at the first engine: move everything alive then (params, modules,
    compiled-code caches) out of the collector's reach, so a full collection between steps stays
    short (with async scheduling a host pause longer than a step stalls the device). Once only:
    a frozen object that later becomes cyclic garbage is never collected."""
    global _FROZEN
    if not _FROZEN:
        gc.collect()
        gc.freeze()
        _FROZEN = True


class _Progress:
    """Minimal progress line on stderr (no dependency)."""

    def __init__(self, total: int):
        import sys
        self.total, self.done, self.tokens, self.t0, self.out = total, 0, 0, time.perf_counter(), sys.stderr

    def update(self, out: RequestOutput):
        self.done += 1
        self.tokens += len(out.token_ids)
        dt = time.perf_counter() - self.t0
        self.out.write(f"\r[{self.done}/{self.total}] {self.tokens} tokens, "
                       f"{self.tokens / max(dt, 1e-9):.1f} tok/s")
        self.out.flush()

    def close(self):
        self.out.write("\n")
