"""Continuous batching for MTP speculative decoding: mixed verify-decodes and chunked prefills.

One `schedule()` builds one device step, in this order (each group first come, first served):

1. running decodes: K + 1 query tokens each (pending token + K drafts); blocks reserved with
   `can_append`/`may_append(seq, K + 1 + num_lookahead_tokens)`; when blocks run out the newest
   running request is preempted (recomputation) until the check passes;
2. running partially-prefilled requests: the next chunk, as much as the token budget allows;
3. waiting requests (new or preempted), admitted while blocks, the token budget and the sequence
   limit allow; admission allocates blocks for the whole (re)prefill at once, so later chunks
   never allocate.

After the device step `postprocess(output, committed)` takes each request's committed tokens.

Asynchronous scheduling: the engine may call `schedule()` for step t+1 before `postprocess` of
step t (the device derives a decode's positions and pending token from its own state, so the host
need not know step t's tokens). Each request then has at most two steps in flight; the scheduler
tracks them (`_inflight`), reserves blocks for the in-flight step's worst case as well, skips a
decode whose in-flight step will surely finish it, and drops the results of steps whose request
was preempted or finished after they were scheduled. See docs/engine.md for the arithmetic and a
worked example.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterator, Sequence as _Seq

from mtpjax.engine.block_manager import BlockManager
from mtpjax.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step. Query tokens sit at positions
    start_position .. start_position + num_query_tokens - 1; their KV is written to the slots
    `block_table[p // block_size] * block_size + p % block_size`."""

    seq: Sequence
    is_prefill: bool
    start_position: int        # seq_len before the step == position of the first query token
                               # (a decode scheduled while an earlier step of its request is in
                               # flight: the host's seq_len then; the device adds what it accepted)
    num_query_tokens: int      # prefill: chunk length; decode: K + 1
    is_last_chunk: bool        # the step samples for this request (always True for a decode)
    token_ids: tuple[int, ...]  # host-known inputs: the chunk's tokens, or (the host's last token,)
                                # for a decode; the device step takes the decode's pending token
                                # and K drafts from the slot (they differ while a step is in flight)
    is_resume: bool = False     # the last chunk of a resuming request's re-prefill: commits
                                # nothing, its last token becomes pending again, it drafts

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def block_table(self) -> list[int]:
        return self.seq.block_table

    @property
    def context_len(self) -> int:
        """KV length attention sees after this step's writes (the runner's `seq_lens` entry)."""
        return self.start_position + self.num_query_tokens

    @property
    def max_committed_tokens(self) -> int:
        """How many tokens postprocess may receive: K+1 (decode), 1 (last chunk) or 0."""
        if not self.is_prefill:
            return self.num_query_tokens
        return 1 if self.is_last_chunk else 0


@dataclasses.dataclass
class SchedulerOutput:
    """One step. `requests` lists decodes first, then prefill chunks, each group in FCFS order."""

    requests: list[ScheduledRequest]
    preempted: list[Sequence]      # preempted by this schedule() (drop their device-side drafts)
    num_speculative_tokens: int
    step_id: int = -1              # order of schedule() calls; postprocess goes in this order

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_query_tokens for r in self.requests)

    @property
    def decodes(self) -> list[ScheduledRequest]:
        return [r for r in self.requests if not r.is_prefill]

    @property
    def prefills(self) -> list[ScheduledRequest]:
        return [r for r in self.requests if r.is_prefill]

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self.requests)


def _positive(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


def _non_negative(name, value):
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {name}={value!r}")
    return value


class Scheduler:
    """FCFS continuous batching over a BlockManager.

    num_lookahead_tokens (L): extra KV slots the device step may write past its own query tokens
    (the chain draft loop writes MTP KV for draft positions; see docs/engine.md; L = K - 1 covers
    chain drafting, 0 suffices for multi_layer). Decodes reserve K + 1 + L new tokens, admission
    reserves L.
    eos_token_id: finishes a request unless its sampling params say ignore_eos (stop_token_ids
    always finish).
    async_scheduling: the caller may schedule step t+1 before postprocessing step t; the refusal
    limit at add() then keeps room for the extra in-flight step (K more tokens).
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, num_speculative_tokens: int = 0,
                 chunked_prefill: bool = True, num_lookahead_tokens: int = 0,
                 max_model_len: int | None = None, eos_token_id: int | None = None,
                 async_scheduling: bool = False):
        self.block_manager = block_manager
        self.max_num_seqs = _positive("max_num_seqs", max_num_seqs)
        self.max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        self.num_speculative_tokens = _non_negative("num_speculative_tokens", num_speculative_tokens)
        self.num_lookahead_tokens = _non_negative("num_lookahead_tokens", num_lookahead_tokens)
        if max_model_len is not None:
            _positive("max_model_len", max_model_len)
        self.max_model_len = max_model_len
        self.chunked_prefill = bool(chunked_prefill)
        self.eos_token_id = eos_token_id
        self.async_scheduling = bool(async_scheduling)
        if self.max_num_batched_tokens < self.num_decode_tokens:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one verify step of "
                f"K + 1 = {self.num_decode_tokens} tokens")
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []   # admission order: oldest first, newest last
        # seq_id -> steps scheduled but not yet postprocessed, oldest first:
        # (step_id, prefill tokens, most tokens the step may commit)
        self._inflight: dict[int, collections.deque[tuple[int, int, int]]] = {}
        self._dropped: set[tuple[int, int]] = set()   # (step_id, seq_id) whose results are void
        self._next_step_id = 0

    @property
    def num_decode_tokens(self) -> int:
        """Query tokens of one verify step: the pending token plus K drafts."""
        return self.num_speculative_tokens + 1

    # ---- queue -------------------------------------------------------------------------------
    def max_completion_tokens(self, num_prompt_tokens: int) -> int:
        """Most completion tokens a prompt can reach with the whole cache to itself: its last
        decode step (num_tokens = P + M - 1) reserves ceil((P + M + K + L) / block_size) blocks;
        with async scheduling the last one (num_tokens <= P + M - 2, one decode in flight)
        reserves ceil((P + M + 2K + L) / block_size)."""
        bm = self.block_manager
        limit = bm.num_blocks * bm.block_size - num_prompt_tokens - self._reserve_extra
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - num_prompt_tokens)
        if not self.chunked_prefill:  # a recompute prefill holds up to P + M - 1 tokens
            limit = min(limit, self.max_num_batched_tokens - num_prompt_tokens + 1)
        return limit

    def check(self, seq: Sequence, name: str | None = None) -> None:
        """What `add` checks, without queueing: raises ValueError for a request that could never
        finish; a request with max_tokens=None gets the largest max_tokens that fits
        (finish_reason "length" there). Changes nothing else. name: what the error calls the
        request (the engine passes the prompt's position in the caller's call, e.g.
        "prompt 2"; default "request <seq_id>")."""
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_completion_tokens:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh request ({seq!r})")
        limit = self.max_completion_tokens(seq.num_prompt_tokens)
        if seq.max_tokens is None:
            if limit < 1:
                raise ValueError(self._oversize_message(seq, 1, name))
            seq.max_tokens = limit
        elif seq.max_tokens > limit:
            raise ValueError(self._oversize_message(seq, seq.max_tokens, name))

    def add(self, seq: Sequence) -> None:
        """Queue a new request after `check` (ValueError, nothing queued, if it fails)."""
        self.check(seq)
        self.waiting.append(seq)

    @property
    def _reserve_extra(self) -> int:
        """Slots the last decode reserves past P + M: K + L (K more with a step in flight)."""
        K = self.num_speculative_tokens
        return K * (2 if self.async_scheduling else 1) + self.num_lookahead_tokens

    def _oversize_message(self, seq: Sequence, max_tokens: int, name: str | None = None) -> str:
        bm = self.block_manager
        need = bm.num_blocks_for(seq.num_prompt_tokens + max_tokens + self._reserve_extra)
        name = f"request {seq.seq_id}" if name is None else name
        msg = (f"{name} can never be served: prompt of {seq.num_prompt_tokens} tokens "
               f"+ max_tokens={max_tokens} (+ {self._reserve_extra} slots for "
               f"K={self.num_speculative_tokens} drafts{' x2 (async)' if self.async_scheduling else ''}"
               f", lookahead {self.num_lookahead_tokens}) needs {need} blocks of {bm.block_size}, "
               f"the cache has {bm.num_blocks}")
        if self.max_model_len is not None:
            msg += f"; max_model_len={self.max_model_len}"
        if not self.chunked_prefill:
            msg += (f"; without chunked prefill a (re)prefill must fit max_num_batched_tokens="
                    f"{self.max_num_batched_tokens}")
        return msg

    def abort(self, seq: Sequence) -> None:
        """Drop a waiting or running request and free its blocks (finish_reason "abort"); rows of
        steps in flight become void. The engine's slot is the caller's: use `mtpjax.LLM.abort`."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
            self._drop_inflight(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:
            raise ValueError(f"sequence {seq.seq_id} is neither waiting nor running")
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- schedule ----------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it at the front of waiting; its generated tokens become part
        of the prompt it recomputes (the prefix cache may still hold its full blocks)."""
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        self._drop_inflight(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_prefill_tokens = seq.prefill_target
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def requeue_all(self, orphans: _Seq[Sequence] = ()) -> list[Sequence]:
        """Recovery after an engine step failed part-way (its results, and those of any other
        step in flight, are lost): forget every in-flight step and put every running request,
        then `orphans` (unfinished requests found in no queue), at the front of `waiting`,
        oldest first, to be recomputed like preempted ones. Every queued request's block table
        is dropped WITHOUT freeing: the caller then calls `BlockManager.reset()`. A request
        whose committed tokens already end it (a stop token or max_tokens that postprocess
        appended but had not yet acted on) is finished instead. Returns the finished ones."""
        self._inflight.clear()
        self._dropped.clear()
        requeue, finished = [], []
        for seq in list(self.running) + [s for s in orphans if s not in self.running]:
            if seq.finish_reason is None:
                last = seq.token_ids[-1]
                if seq.num_completion_tokens and self._is_stop(seq, last):
                    seq.finish_reason = "stop"
                elif seq.stop_checker is not None and seq.stop_checker.push(seq.token_ids):
                    del seq.token_ids[seq.num_prompt_tokens + seq.stop_checker.num_seen:]
                    seq.finish_reason = "stop"
                elif seq.max_tokens is not None and seq.num_completion_tokens >= seq.max_tokens:
                    seq.finish_reason = "length"
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                finished.append(seq)
            else:
                if seq.status is SequenceStatus.RUNNING:
                    seq.num_preemptions += 1
                seq.status = SequenceStatus.WAITING
                requeue.append(seq)
        queued = set(map(id, requeue))
        self.running = []
        self.waiting = collections.deque(requeue + [s for s in self.waiting if id(s) not in queued])
        for seq in list(self.waiting) + finished:
            seq.block_table, seq.block_hashes = [], []
            seq.num_cached_tokens = seq.num_computed_tokens = 0
            seq.num_prefill_tokens = seq.prefill_target
        return finished

    # ---- in-flight steps (async scheduling) --------------------------------------------------
    def _drop_inflight(self, seq: Sequence) -> None:
        """The request's in-flight steps no longer count: postprocess will skip their rows."""
        for step_id, _, _ in self._inflight.pop(seq.seq_id, ()):
            self._dropped.add((step_id, seq.seq_id))

    def _scheduled_len(self, seq: Sequence) -> int:
        """seq_len once every in-flight prefill chunk has run."""
        return seq.num_computed_tokens + sum(p for _, p, _ in self._inflight.get(seq.seq_id, ()))

    def _prefilling(self, seq: Sequence) -> bool:
        return self._scheduled_len(seq) < seq.num_prefill_tokens

    def _will_finish(self, seq: Sequence) -> bool:
        """In-flight steps each commit >= 1 token: do they surely reach max_tokens?"""
        committing = sum(1 for _, _, c in self._inflight.get(seq.seq_id, ()) if c)
        return committing > 0 and seq.num_completion_tokens + committing >= seq.max_tokens

    def _track(self, req: ScheduledRequest, step_id: int) -> None:
        self._inflight.setdefault(req.seq_id, collections.deque()).append(
            (step_id, req.num_query_tokens if req.is_prefill else 0, req.max_committed_tokens))

    def is_void(self, output: SchedulerOutput, req: ScheduledRequest) -> bool:
        """True if postprocess will skip this row: its request was preempted or finished after
        the step was scheduled."""
        return (output.step_id, req.seq_id) in self._dropped

    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledRequest] = []
        prefills: list[ScheduledRequest] = []
        preempted: list[Sequence] = []
        step_id = self._next_step_id
        self._next_step_id += 1

        # 1. Verify-decodes of running requests, oldest first; preempt newest when out of blocks.
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or self._prefilling(seq):
                continue  # preempted above, or prefilling (pass 2)
            if self._will_finish(seq):
                continue  # its in-flight step ends it: a further step would be wasted
            if budget < self.num_decode_tokens or len(decodes) >= self.max_num_seqs:
                break
            # room for this step and for what the in-flight step may still commit
            num_new = self.num_decode_tokens + self.num_lookahead_tokens + sum(
                c for _, _, c in self._inflight.get(seq.seq_id, ()))
            while not bm.can_append(seq, num_new):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.may_append(seq, num_new)
            decodes.append(ScheduledRequest(
                seq=seq, is_prefill=False, start_position=seq.num_computed_tokens,
                num_query_tokens=self.num_decode_tokens, is_last_chunk=True,
                token_ids=(seq.last_token_id,)))
            budget -= self.num_decode_tokens

        # 2. Next chunk of partially prefilled running requests.
        for seq in self.running:
            if not self._prefilling(seq):
                continue
            if budget <= 0 or len(decodes) + len(prefills) >= self.max_num_seqs:
                break
            start = self._scheduled_len(seq)
            chunk = self._chunk(seq.num_prefill_tokens - start, budget)
            if chunk == 0:
                break
            prefills.append(self._prefill_request(seq, chunk, start))
            budget -= chunk

        # 3. Admit waiting requests (FCFS: stop at the first that does not fit).
        while (self.waiting and not preempted and budget > 0
               and len(self.running) < self.max_num_seqs
               and len(decodes) + len(prefills) < self.max_num_seqs):
            seq = self.waiting[0]
            remaining = seq.prefill_target - bm.num_prefix_cached_tokens(seq)
            chunk = self._chunk(remaining, budget)
            if chunk == 0 or not bm.can_allocate(seq, self.num_lookahead_tokens):
                break
            bm.allocate(seq, self.num_lookahead_tokens)
            seq.num_prefill_tokens = seq.prefill_target
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            prefills.append(self._prefill_request(seq, chunk, seq.num_computed_tokens))
            budget -= chunk

        for req in decodes + prefills:
            self._track(req, step_id)
        return SchedulerOutput(requests=decodes + prefills, preempted=preempted,
                               num_speculative_tokens=self.num_speculative_tokens, step_id=step_id)

    def _chunk(self, remaining: int, budget: int) -> int:
        if self.chunked_prefill:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    @staticmethod
    def _prefill_request(seq: Sequence, chunk: int, start: int) -> ScheduledRequest:
        ends = start + chunk == seq.num_prefill_tokens
        resume = ends and seq.num_prefill_tokens < seq.num_tokens
        return ScheduledRequest(
            seq=seq, is_prefill=True, start_position=start, num_query_tokens=chunk,
            is_last_chunk=ends and not resume, token_ids=tuple(seq.token_ids[start:start + chunk]),
            is_resume=resume)

    # ---- postprocess -------------------------------------------------------------------------
    def _is_stop(self, seq: Sequence, token_id: int) -> bool:
        if token_id in seq.stop_token_ids:
            return True
        return self.eos_token_id is not None and not seq.ignore_eos and token_id == self.eos_token_id

    def postprocess(self, output: SchedulerOutput,
                    committed_token_ids: _Seq[_Seq[int]]) -> list[Sequence]:
        """Apply one step's results. `committed_token_ids[i]` are the tokens request
        `output.requests[i]` committed: 1..K+1 for a decode (accepted drafts + bonus), 1 for a last
        prefill chunk, 0 (empty) for a non-final chunk. Tokens after a stop token, after the token
        that completes a stop string (`seq.stop_checker`) or beyond
        max_tokens are dropped. Returns the requests that finished (their blocks are freed)."""
        if len(committed_token_ids) != len(output.requests):
            raise ValueError(f"got committed tokens for {len(committed_token_ids)} requests, the step "
                             f"scheduled {len(output.requests)}")
        # Validate everything first, so a bad call changes nothing.
        for req, toks in zip(output.requests, committed_token_ids):
            seq, n = req.seq, len(toks)
            lo = 1 if req.is_last_chunk else 0
            if not lo <= n <= req.max_committed_tokens:
                raise ValueError(f"sequence {seq.seq_id} committed {n} tokens; a "
                                 f"{'decode' if not req.is_prefill else 'prefill chunk'} here commits "
                                 f"{lo}..{req.max_committed_tokens}")
            if (output.step_id, seq.seq_id) in self._dropped:
                continue
            queue = self._inflight.get(seq.seq_id)
            if (seq.status is not SequenceStatus.RUNNING or not queue
                    or queue[0][0] != output.step_id
                    or (req.is_prefill and seq.num_computed_tokens != req.start_position)):
                raise ValueError(f"sequence {seq.seq_id} is not in the state this step was scheduled "
                                 f"from (status={seq.status.name}, seq_len={seq.num_computed_tokens}, "
                                 f"scheduled start_position={req.start_position}, step "
                                 f"{output.step_id}, oldest step in flight "
                                 f"{queue[0][0] if queue else None}); postprocess steps once each, "
                                 f"in the order they were scheduled")
        finished = []
        for req, toks in zip(output.requests, committed_token_ids):
            seq = req.seq
            if (output.step_id, seq.seq_id) in self._dropped:
                # preempted or finished after this step was scheduled: its results are void
                self._dropped.discard((output.step_id, seq.seq_id))
                continue
            queue = self._inflight[seq.seq_id]
            queue.popleft()
            if not queue:
                del self._inflight[seq.seq_id]
            if req.is_prefill:
                seq.num_computed_tokens += req.num_query_tokens
            kept = 0
            for t in toks:
                t = int(t)
                seq.append_token(t)
                kept += 1
                if self._is_stop(seq, t):
                    seq.finish_reason = "stop"
                elif seq.stop_checker is not None and seq.stop_checker.push(seq.token_ids):
                    seq.finish_reason = "stop"      # a stop string ends in this token
                elif seq.num_completion_tokens >= seq.max_tokens:
                    seq.finish_reason = "length"
                if seq.finish_reason is not None:
                    break
            if not req.is_prefill:
                seq.num_computed_tokens += kept  # KV of the pending token + accepted drafts
            self.block_manager.commit(seq)
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                self.block_manager.deallocate(seq)
                self.running.remove(seq)
                self._drop_inflight(seq)       # a step scheduled after this one is wasted
                finished.append(seq)
        return finished
