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

`LLM` is the front: its public methods, the engine lock, and the table of the requests it holds
with the routing of their news (to a `generate_stream` or to `step()`'s result). The rest is
composed from one module per concern, each with its inputs passed in explicitly:
`engine/intake.py` (prompts and SamplingParams checked and turned into Sequences),
`engine/step_loop.py` (schedule, dispatch, read back, recover), `engine/outputs.py`
(RequestOutput, StreamEvent, stream bookkeeping, text) and `engine/loading.py` (checkpoint
loading for `from_pretrained`, the params check). Names other modules import from here
(RequestOutput, StreamEvent, QueueFullError, collect_outputs, load_for_engine, check_params)
are re-exported.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from typing import Iterator

import jax
import numpy as np

from mtpjax.compilation_cache import enable_compilation_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig, check_seed
from mtpjax.engine.background_warmup import warm_up_background
from mtpjax.engine.block_manager import BlockManager
from mtpjax.engine.executable_store import ExecutableStore
from mtpjax.engine.intake import (QueueFullError, RequestIntake, chat_template_arg, int_arg,
                                  is_int, prompt_list)
from mtpjax.engine.loading import check_params, freeze_startup_objects, load_for_engine
from mtpjax.engine.outputs import (RequestOutput, Stream, StreamEvent, collect_outputs,
                                   request_output, text_delta)
from mtpjax.engine.runner import ModelRunner
from mtpjax.engine.scheduler import Scheduler
from mtpjax.engine.sequence import Sequence, SequenceStatus
from mtpjax.engine.step_loop import StepLoop
from mtpjax.engine.warmup import warm_up
from mtpjax.generate import default_min_token_bucket, finite_flags, warn_non_finite
from mtpjax.speculative.adaptive import AdaptiveK
from mtpjax.speculative.draft_vocab import resolve_ids as draft_vocab_ids

__all__ = ["LLM", "QueueFullError", "RequestOutput", "StreamEvent", "check_params",
           "collect_outputs", "load_for_engine"]


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
    warmup: True compiles the step for every bucket the engine can reach (`engine/warmup.py`)
    before returning, with a progress bar and each bucket's compile time on stderr, so serving
    never compiles. "background" compiles only the largest bucket before returning (it serves
    every step, padded up, with the same tokens) and the rest on daemon threads while the
    engine serves (`engine/background_warmup.py`; `warmup_done()`, `wait_for_warmup()`).
    False: none. Default (None): "background" when JAX's default backend is not the CPU
    (GPU/TPU steps take seconds to compile), False on the CPU (the tests' tiny engines would
    pay for buckets they never use).
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
    True / "all" both groups, "qkv" only q/k/v (on MLA: its query and kv_a projections, and
    kv_b split into the absorbed attention's two halves).
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
        num_pages = int_arg("num_pages", num_pages, 1)
        page_size = int_arg("page_size", page_size, 1)
        max_num_seqs = int_arg("max_num_seqs", max_num_seqs, 1)
        max_num_batched_tokens = int_arg("max_num_batched_tokens", max_num_batched_tokens, 1)
        max_model_len = int_arg("max_model_len", max_model_len, 1, cfg.max_position_embeddings,
                                 none_ok=True)
        eos_token_id = int_arg("eos_token_id", eos_token_id, 0, cfg.vocab_size - 1, none_ok=True)
        self.max_waiting_requests = int_arg("max_waiting_requests", max_waiting_requests, 1,
                                             none_ok=True)
        seed = check_seed("seed", seed)
        max_logprobs = int_arg("max_logprobs", max_logprobs, 0, cfg.vocab_size)
        if min_token_bucket is None:
            min_token_bucket = default_min_token_bucket(cfg)
        min_token_bucket = int_arg("min_token_bucket", min_token_bucket, 1)
        if min_token_bucket & (min_token_bucket - 1):
            raise ValueError(f"min_token_bucket must be a power of two, got "
                             f"min_token_bucket={min_token_bucket}")
        if adaptive_k is not None and not isinstance(adaptive_k, AdaptiveK):
            raise ValueError(f"adaptive_k must be an AdaptiveK or None, got "
                             f"{type(adaptive_k).__name__}")
        for name, flag in (("enable_prefix_caching", enable_prefix_caching),
                           ("async_scheduling", async_scheduling)):
            if not isinstance(flag, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {name}={flag!r}")
        if not (warmup is None or isinstance(warmup, (bool, np.bool_)) or
                (isinstance(warmup, str) and warmup == "background")):
            raise ValueError(f"warmup must be True, False, None or 'background', got "
                             f"warmup={warmup!r}")
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
        self.cfg, self.spec = cfg, spec
        chat_template = chat_template_arg(chat_template)
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
        # the largest reservation: a decode with another in flight, P + M - 2 + 2(K + 1) + L
        max_blocks = math.ceil((self.max_model_len + 2 * (K + 1) + lookahead) / page_size)
        self.runner = ModelRunner(params, cfg, spec, num_pages=num_pages, page_size=page_size,
                                  max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks,
                                  seed=seed, attention_impl=attention_impl,
                                  max_logprobs=max_logprobs, mesh=mesh, draft_vocab=vocab_ids,
                                  fuse_projections=fuse_projections,
                                  executable_store=store, min_token_bucket=min_token_bucket)
        if adaptive_k is not None and spec is not None and spec.method == "chain":
            # adaptive K runs as many draft passes as the step's largest k: every count is
            # a program of its own, all compiled at warm-up
            self.runner.warm_passes = tuple(range(spec.num_speculative_tokens + 1))
        # NaN / inf weights make every token id 0; warned once here (read after the warm-up,
        # so nothing waits for it), never checked per step
        finite = finite_flags(self.runner.params)
        self.max_logprobs = max_logprobs
        self.warmup_times: list[tuple[int, int, float]] = []    # (T, F, compile seconds)
        if warmup is None:
            warmup = "background" if jax.default_backend() != "cpu" else False
        self._background_warmup = None
        if isinstance(warmup, str):
            self._background_warmup = warm_up_background(
                self.runner, max_num_batched_tokens, max_num_seqs, self.warmup_times)
        elif warmup:
            warm_up(self.runner, max_num_batched_tokens, max_num_seqs, self.warmup_times)
        warn_non_finite(finite, "mtpjax.LLM")
        freeze_startup_objects()
        self._next_id = 0
        # Every request the engine holds, until its final output is handed over (step() result,
        # a stream's final event, abort()'s return value); never longer.
        self._requests: dict[int, Sequence] = {}
        self._stream_of: dict[int, Stream] = {}     # seq_id -> its generate_stream
        self._streams: list[Stream] = []            # open streams, oldest first
        self._direct_news: dict[int, Sequence] = {}  # add_request requests with news for step()
        self._lock = threading.Lock()
        self._holder: int | None = None             # thread holding _lock
        self._deferred: list[Stream] = []           # streams closed during an operation
        self._intake = RequestIntake(cfg, spec, self.scheduler, self.runner, tokenizer=tokenizer,
                                     chat_template=chat_template, max_logprobs=max_logprobs)
        self._loop = StepLoop(self.scheduler, self.runner, self.block_manager, spec,
                              adaptive_k=adaptive_k, async_scheduling=bool(async_scheduling),
                              max_logprobs=max_logprobs, requests=self._requests,
                              report=self._touch)

    # the intake's tokenizer and chat template, as attributes of the engine: one object holds
    # them, so setting either here changes what requests are checked and encoded with
    @property
    def tokenizer(self):
        return self._intake.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._intake.tokenizer = tokenizer

    @property
    def chat_template(self):
        return self._intake.chat_template

    @chat_template.setter
    def chat_template(self, template) -> None:
        self._intake.chat_template = chat_template_arg(template)

    # the step loop's settings and counters, as attributes of the engine
    @property
    def num_steps(self) -> int:
        return self._loop.num_steps

    @property
    def num_preemptions(self) -> int:
        return self._loop.num_preemptions

    @property
    def adaptive_k(self) -> AdaptiveK | None:
        return self._loop.adaptive_k

    @adaptive_k.setter
    def adaptive_k(self, policy: AdaptiveK | None) -> None:
        self._loop.adaptive_k = policy

    @property
    def async_scheduling(self) -> bool:
        return self._loop.async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        self._loop.async_scheduling = on

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
                if self._loop.needs_recovery:
                    self._recover()
                yield
            finally:
                try:
                    while self._deferred and not self._loop.needs_recovery:
                        self._close_stream(self._deferred.pop())
                finally:
                    self._holder = None

    # ---- requests ------------------------------------------------------------------------------
    def _new_requests(self, prompts: list, sampling_params, **kwargs):
        """`RequestIntake.new_requests` from the next free id: validated Sequences, nothing
        queued (the caller commits the ids with `self._next_id += n`)."""
        return self._intake.new_requests(prompts, sampling_params, self._next_id, **kwargs)

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
        if not is_int(rid):
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
            out = request_output(seq, self.tokenizer)
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
        if not isinstance(request, Sequence) and not is_int(request):
            raise ValueError(f"get_output takes a Sequence or a request id, got {request!r}")
        with self._engine():
            seq = request if isinstance(request, Sequence) else self._requests.get(int(request))
            if seq is None:
                raise ValueError(f"request {request} is not held by the engine (unknown, or its "
                                 "final output was already handed over): pass the Sequence that "
                                 "add_request returned")
            return request_output(seq, self.tokenizer)

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
        self._loop.acceptance.drop(seq.seq_id)
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
            self._guarded(self._loop.step)
            return self._direct_updates()

    def flush(self) -> list[tuple[Sequence, list[int]]]:
        """Reads back and applies the step still in flight (async scheduling), if any."""
        with self._engine():
            self._guarded(self._loop.flush)
            return self._direct_updates()

    def _guarded(self, fn) -> None:
        try:
            fn()
        except BaseException:
            self._recover()
            raise

    def _recover(self) -> None:
        """`StepLoop.recover`: the requests that streams have not queued yet are not orphans."""
        self._loop.recover(s for st in self._streams for s in st.todo)

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

    def _stream_events(self, stream: Stream) -> list[StreamEvent]:
        news, stream.news = stream.news, {}
        events = []
        for seq in news.values():
            new, done = self._take(seq)
            if new or done:
                events.append(StreamEvent(stream.index[seq.seq_id], new, done,
                                          request_output(seq, self.tokenizer) if done else None,
                                          seq.seq_id,
                                          text_delta(stream, seq, new, done, self.tokenizer),
                                          seq.sample_index))
            if done:
                stream.open.discard(seq.seq_id)
        return events

    def _close_stream(self, stream: Stream) -> None:
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
                seqs, prompt_of = self._new_requests(prompt_list(prompts), sampling_params,
                                                     samples=True)
                self._next_id += len(seqs)
                stream = Stream(seqs, prompt_of)
                for seq in seqs:
                    self._requests[seq.seq_id] = seq
                    self._stream_of[seq.seq_id] = stream
                self._streams.append(stream)
            while stream.open:
                with self._engine():
                    self._top_up()
                    if not stream.news:
                        self._guarded(self._loop.step)
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
        return (self.scheduler.is_finished() and self._loop.inflight is None
                and not any(st.todo for st in self._streams))

    def _lost_requests(self, stream: Stream) -> None:
        """The engine is idle but the stream still waits: report requests that finished behind
        its back (Scheduler.abort); anything else would be a bug, never a hang."""
        for sid in list(stream.open):
            seq = stream.seqs[stream.position[sid]]
            if not seq.is_finished:
                raise RuntimeError(f"internal error: request {sid} is in no queue of an idle "
                                   f"engine ({seq!r})")
            stream.news[sid] = seq

    def warmup_done(self) -> bool:
        """True once every step bucket is compiled: at once after a blocking warm-up (or none),
        when the background threads finish after `warmup="background"` (also when they failed
        or were stopped: such a bucket compiles when a step first needs it)."""
        return self._background_warmup is None or self._background_warmup.done()

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Blocks until `warmup_done()` or `timeout` seconds (None: no limit); returns
        `warmup_done()`."""
        return self._background_warmup is None or self._background_warmup.wait(timeout)

    def generate(self, prompts, sampling_params=None, *, progress: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (token-id lists or strings); outputs in prompt order. A
        prompt with SamplingParams(n=k) has k outputs, one after another in sample order
        (`RequestOutput.sample_index`), so n = 1 everywhere gives one output per prompt."""
        prompts = prompt_list(prompts)
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
