"""`mtpjax.LLM`: the batched generator (continuous batching, paged KV cache, MTP speculation)."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import os
import time
from typing import Any, Iterator

import jax
import numpy as np

from mtpjax.compilation_cache import enable_compilation_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig
from mtpjax.engine.block_manager import BlockManager
from mtpjax.engine.runner import ModelRunner
from mtpjax.engine.scheduler import Scheduler
from mtpjax.engine.sequence import Sequence
from mtpjax.engine.warmup import WarmupProgress, step_buckets
from mtpjax.sampling import as_sampling_list


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0          # drafts proposed to the target
    num_accepted_draft_tokens: int = 0

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
    output: RequestOutput | None       # set when finished


class LLM:
    """Continuous-batching generator.

    params/cfg: the model; spec: SpecConfig for MTP speculative decoding, None for plain decoding.
    num_pages x page_size: the paged KV cache. max_num_seqs / max_num_batched_tokens: per-step
    limits. tokenizer: anything with encode(str) -> ids and decode(ids) -> str (optional).
    async_scheduling (default True): schedule and dispatch step t+1 before reading step t back,
    so host work overlaps the device; each `step()` then returns the previous step's tokens.
    Outputs are identical either way (docs/engine.md, "Asynchronous scheduling").
    warmup: compile the step for every bucket the engine can reach (`engine/warmup.py`) before
    returning, with a progress bar and each bucket's compile time on stderr, so serving never
    compiles. Default (None): on when JAX's default backend is not the CPU (GPU/TPU steps take
    seconds to compile; on the CPU the tests' tiny engines would pay for buckets they never use).
    `MTPJAX_WARMUP_THREADS` (default min(4, CPU count)) compiles that many buckets at once.
    JAX's persistent compilation cache is turned on first (`mtpjax/compilation_cache.py`), so a
    second process loads the compiled steps from disk.
    """

    def __init__(self, params, cfg: ModelConfig, spec: SpecConfig | None = None, *,
                 num_pages: int, page_size: int = 16, max_num_seqs: int = 16,
                 max_num_batched_tokens: int = 512, enable_prefix_caching: bool = True,
                 tokenizer=None, max_model_len: int | None = None, eos_token_id: int | None = None,
                 attention_impl: str = "auto", seed: int = 0, async_scheduling: bool = True,
                 warmup: bool | None = None):
        if spec is not None:
            if not isinstance(spec, SpecConfig):
                raise ValueError(f"spec must be a SpecConfig or None, got {type(spec).__name__}")
            spec.check_model(cfg)
        enable_compilation_cache()
        self.cfg, self.spec, self.tokenizer = cfg, spec, tokenizer
        K = spec.num_speculative_tokens if spec else 0
        chain = spec is not None and spec.method == "chain"
        # chain drafting writes MTP KV up to K-1 slots past the verify window (docs/engine.md);
        # a module's KV at position i depends on up to K tokens after i (1 for chain).
        lookahead = max(K - 1, 0) if chain else 0
        hash_lookahead = (1 if chain else K) if spec else 0
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching,
                                          num_hash_lookahead_tokens=hash_lookahead)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   num_speculative_tokens=K, num_lookahead_tokens=lookahead,
                                   max_model_len=self.max_model_len, eos_token_id=eos_token_id,
                                   async_scheduling=async_scheduling)
        self.async_scheduling = bool(async_scheduling)
        # the largest reservation: a decode with another in flight, P + M - 2 + 2(K + 1) + L
        max_blocks = math.ceil((self.max_model_len + 2 * (K + 1) + lookahead) / page_size)
        self.runner = ModelRunner(params, cfg, spec, num_pages=num_pages, page_size=page_size,
                                  max_num_seqs=max_num_seqs, max_blocks_per_seq=max_blocks,
                                  seed=seed, attention_impl=attention_impl)
        self._inflight = None                       # (SchedulerOutput, result) dispatched, unread
        self.warmup_times: list[tuple[int, int, float]] = []    # (T, F, compile seconds)
        if warmup is None:
            warmup = jax.default_backend() != "cpu"
        if warmup:
            self._warmup(max_num_batched_tokens, max_num_seqs)
        _freeze_startup_objects()
        self._ids = itertools.count()
        self._metrics: dict[int, list[int]] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    def _warmup(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        buckets = step_buckets(max_num_batched_tokens, max_num_seqs, self.runner.W)
        threads = int(os.environ.get("MTPJAX_WARMUP_THREADS", min(4, os.cpu_count() or 1)))
        with WarmupProgress(len(buckets)) as bar:
            def done(T, F, seconds):
                self.warmup_times.append((T, F, seconds))
                bar.update(T, F, seconds)
            self.runner.warmup(buckets, on_compiled=done, threads=threads)

    # ---- requests ------------------------------------------------------------------------------
    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("got a string prompt but the LLM has no tokenizer")
            prompt = self.tokenizer.encode(prompt)
        ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
        if not ids:
            raise ValueError("empty prompt: every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        return ids

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> Sequence:
        """Validates and queues one request; raises ValueError (engine state unchanged) if bad."""
        sp = as_sampling_list(sampling_params, 1)[0]
        seq = Sequence(self._encode(prompt), sampling_params=sp, seq_id=next(self._ids))
        self.scheduler.add(seq)
        self._metrics[seq.seq_id] = [0, 0, 0]
        return seq

    def _output(self, seq: Sequence) -> RequestOutput:
        steps, proposed, accepted = self._metrics.pop(seq.seq_id, (0, 0, 0))
        toks = list(seq.completion_token_ids)
        text = self.tokenizer.decode(toks) if self.tokenizer is not None else None
        return RequestOutput(seq.seq_id, list(seq.prompt_token_ids), toks, text,
                             seq.finish_reason, steps, proposed, accepted)

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[tuple[Sequence, list[int]]]:
        """One engine step; returns (sequence, newly committed tokens) for the requests of the step
        that completed: this one (synchronous) or the previous one (async scheduling)."""
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.runner.release(seq.seq_id)
        self.num_preemptions += len(out.preempted)
        launched = None if out.is_empty else (out, self.runner.dispatch(out))
        if self.async_scheduling:
            launched, self._inflight = self._inflight, launched
        if launched is None:
            if out.preempted or self._inflight is not None or self.scheduler.is_finished():
                return []
            raise RuntimeError("scheduler produced an empty step with unfinished requests")
        return self._complete(*launched)

    def flush(self) -> list[tuple[Sequence, list[int]]]:
        """Reads back and applies the step still in flight (async scheduling), if any."""
        launched, self._inflight = self._inflight, None
        return [] if launched is None else self._complete(*launched)

    def _complete(self, out, result) -> list[tuple[Sequence, list[int]]]:
        """Reads a dispatched step back and applies it."""
        committed = self.runner.collect(out, result)
        before = [r.seq.num_completion_tokens for r in out.requests]
        live = [not self.scheduler.is_void(out, r) for r in out.requests]
        K = self.spec.num_speculative_tokens if self.spec else 0
        self.scheduler.postprocess(out, committed)
        self.num_steps += 1
        result = []
        for req, toks, b, was_live in zip(out.requests, committed, before, live):
            seq = req.seq
            if not was_live:
                continue      # preempted or finished after this step was dispatched: wasted row
            if not req.is_prefill and K:
                m = self._metrics[req.seq_id]
                m[0] += 1
                m[1] += K
                m[2] += len(toks) - 1
            result.append((seq, list(seq.completion_token_ids[b:])))
            if seq.is_finished:
                self.runner.release(seq.seq_id)
        return result

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        prompts = list(prompts)
        sps = as_sampling_list(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]          # validate all before queueing any
        seqs = [self.add_request(p, sp) for p, sp in zip(encoded, sps)]
        index = {s.seq_id: i for i, s in enumerate(seqs)}
        pending = set(index)
        while pending:
            for seq, new in self.step():
                if seq.seq_id not in index:
                    continue
                done = seq.is_finished
                if new or done:
                    yield StreamEvent(index[seq.seq_id], new, done,
                                      self._output(seq) if done else None)
                if done:
                    pending.discard(seq.seq_id)

    def generate(self, prompts, sampling_params=None, *, progress: bool = False) -> list[RequestOutput]:
        """Generates for every prompt (token-id lists or strings); outputs in prompt order."""
        prompts = list(prompts)
        outputs: list[Any] = [None] * len(prompts)
        bar = _Progress(len(prompts)) if progress else None
        for ev in self.generate_stream(prompts, sampling_params):
            if ev.finished:
                outputs[ev.request_index] = ev.output
                if bar:
                    bar.update(ev.output)
        if bar:
            bar.close()
        return outputs

    @classmethod
    def from_pretrained(cls, path: str, spec: SpecConfig | None = None, *, dtype=None,
                        **llm_kwargs) -> "LLM":
        """An LLM over a Hugging Face folder or an Orbax folder (`mtpjax convert`), with its
        tokenizer and eos id unless given; `llm_kwargs` as for `LLM(...)` (num_pages, ...)."""
        from mtpjax.checkpoint import load_pretrained
        ckpt = load_pretrained(path, dtype, spec=spec)
        llm_kwargs.setdefault("tokenizer", ckpt.tokenizer)
        llm_kwargs.setdefault("eos_token_id", ckpt.eos_token_id)
        return cls(ckpt.params, ckpt.cfg, spec, **llm_kwargs)


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
