"""The engine's step loop: schedule, dispatch, read back, apply; and recovery when a step raised.

`StepLoop` owns what lives across steps on the device side of `LLM`: the step in flight (async
scheduling dispatches step t+1 before reading step t back; docs/engine.md, "Asynchronous
scheduling"), the adaptive-K acceptance table, and the step and preemption counters. It never
decides who gets a request's news: each request with committed tokens or an end is passed to
`report`, and `LLM` routes it to its stream or to `step()`'s result.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Iterable

import jax

from mtpjax.config import SpecConfig
from mtpjax.engine.block_manager import BlockManager
from mtpjax.engine.runner import ModelRunner
from mtpjax.engine.scheduler import Scheduler
from mtpjax.engine.sequence import Sequence
from mtpjax.speculative.adaptive import AcceptanceTable, AdaptiveK
from mtpjax.speculative.step_times import StepTimes


class StepLoop:
    """Runs steps of `scheduler`'s batches on `runner`.

    max_logprobs: the engine's logprobs limit; requests: the engine's table of held requests
    (seq_id -> Sequence), shared with `LLM` and only read here; report(seq): called for each
    request with tokens or an end to report."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, block_manager: BlockManager,
                 spec: SpecConfig | None, *, adaptive_k: AdaptiveK | None,
                 async_scheduling: bool, max_logprobs: int, requests: dict[int, Sequence],
                 report: Callable[[Sequence], None]):
        self.scheduler, self.runner, self.block_manager = scheduler, runner, block_manager
        self.K = spec.num_speculative_tokens if spec else 0
        self.adaptive_k = adaptive_k
        self.async_scheduling = async_scheduling
        self.max_logprobs = max_logprobs        # 0: no step computes logprobs
        self.requests, self.report = requests, report
        self.acceptance = AcceptanceTable(self.K)
        self.step_times = StepTimes()   # measured pure-decode steps, for adaptive K
        self.passes_used: collections.Counter = collections.Counter()    # passes -> steps
        self.last_done = 0.0            # perf_counter when the last step's result was read
        self.last_program = None        # the runner's program of the last step read
        # (passes, seconds) of steady-looking steps right after a change of program: kept
        # apart from the rule's step times (see _complete), reported by the e2e bench
        self.switch_step_times: collections.deque = collections.deque(maxlen=64)
        # seconds of host work in step() and of waiting there for a step's result, and the
        # step() calls they sum over: with async scheduling the device is idle while the host
        # works (wait near 0) once the host takes longer than a step
        self.reset_host_split()
        # (passes, why) -> decode steps adaptive K did not time: what keeps a count unmeasured
        self.untimed_steps: collections.Counter = collections.Counter()
        # (SchedulerOutput, result, ks, passes, dispatched at, compiled, runner.num_compiles
        # after it, its program) dispatched, unread
        self.inflight = None
        self.needs_recovery = False     # a step raised and its recovery did not finish
        self.num_steps = 0
        self.num_preemptions = 0

    def step(self) -> None:
        """Schedules and dispatches one step, then completes one: this one (synchronous), or
        the one dispatched before it (async scheduling; this one is then in flight)."""
        entered, waited = time.perf_counter(), self.wait_seconds
        try:
            self._step()
        finally:
            self.timed_calls += 1
            self.host_seconds += (time.perf_counter() - entered) - (self.wait_seconds - waited)

    def reset_host_split(self) -> None:
        """Starts `host_split`'s sums afresh (e.g. after the steps that compiled)."""
        self.host_seconds = self.wait_seconds = 0.0
        self.timed_calls = 0

    def host_split(self) -> tuple[float, float]:
        """(host work, waiting for results) in seconds per step() call so far."""
        n = max(self.timed_calls, 1)
        return self.host_seconds / n, self.wait_seconds / n

    def _step(self) -> None:
        self._reclaim_slots()
        if self.inflight is not None and has_grammar(self.inflight[0]):
            # a grammar row's next masks follow the drafts and tokens this step returns: only
            # batches with such a row wait for their readback before the next schedule
            self.flush()
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self.runner.release(seq.seq_id)
        self.num_preemptions += len(out.preempted)
        if out.is_empty:
            launched = None
        else:
            ks, passes = self._draft_counts(out)
            t0 = time.perf_counter()
            result = self.runner.dispatch(out, None if all(k == self.K for k in ks) else ks,
                                          passes)
            launched = (out, result, ks, passes, t0, self.runner.last_step_compiled,
                        self.runner.num_compiles, self.runner.last_program)
            self.passes_used[passes] += 1
        if self.async_scheduling:
            launched, self.inflight = self.inflight, launched
        if launched is None:
            if out.preempted or self.inflight is not None or self.scheduler.is_finished():
                return
            raise RuntimeError("scheduler produced an empty step with unfinished requests")
        self._complete(*launched)

    def flush(self) -> None:
        """Reads back and applies the step in flight, if any."""
        launched, self.inflight = self.inflight, None
        if launched is not None:
            self._complete(*launched)

    def _reclaim_slots(self) -> None:
        """Slots of requests that left `running` behind the engine's back (Scheduler.abort):
        freed, and the request reported finished to its owner."""
        if len(self.runner.slot_of) > len(self.scheduler.running):
            running = {s.seq_id for s in self.scheduler.running}
            for sid in [k for k in self.runner.slot_of if k not in running]:
                self.runner.release(sid)
                seq = self.requests.get(sid)
                if seq is not None and seq.is_finished:
                    self.report(seq)

    def _draft_counts(self, out) -> tuple[list[int], int]:
        """(drafts each scheduled request verifies this step, the step's draft passes): its
        SamplingParams' num_speculative_tokens (default K), lowered by the adaptive-K policy
        if any, and at most the drafts its slot holds (`ModelRunner.verify_counts`). Chain
        drafting runs as many passes as the largest k asked (the policy's choice with
        adaptive K), so a batch that verifies fewer drafts also draws fewer; multi_layer
        runs all K."""
        K = self.K
        batch = len(out.decodes)
        ks = []
        for req in out.requests:
            k = getattr(req.seq.sampling_params, "num_speculative_tokens", None)
            ks.append(K if k is None else k)
        passes = max(ks, default=K)
        if self.adaptive_k is not None:
            pick = [i for i, req in enumerate(out.requests) if not req.is_prefill and ks[i]]
            if pick:
                chosen, passes = self.acceptance.choose_step(
                    self.adaptive_k, [out.requests[i].seq_id for i in pick],
                    [ks[i] for i in pick], batch, self._expert_cost(), self.step_times,
                    self.num_steps)
                for i, k in zip(pick, chosen.tolist()):
                    ks[i] = k
                # a request still in prefill drafts for its first verify at its own k
                passes = max([passes] + [ks[i] for i, r in enumerate(out.requests)
                                         if r.is_prefill])
        if not K or self.runner.spec.method != "chain":
            passes = K
        return self.runner.verify_counts(out, ks), passes

    def _expert_cost(self):
        """The model's ExpertStepCost (MoE models; None otherwise), built once."""
        if not hasattr(self, "_expert_cost_cache"):
            from mtpjax.speculative.expert_cost import ExpertStepCost
            self._expert_cost_cache = ExpertStepCost.from_config(self.runner.cfg, self.K)
        return self._expert_cost_cache

    def _complete(self, out, result, ks=None, passes=None, dispatched=None,
                  compiled=False, compiles_before=None, program=None) -> None:
        """Reads a dispatched step back, applies it and reports the news."""
        reading = time.perf_counter()
        jax.block_until_ready(result)
        self.wait_seconds += time.perf_counter() - reading
        committed = self.runner.collect(out, result)
        done = time.perf_counter()
        # a compile while it was in flight (async scheduling dispatches the next step, which
        # may compile, before this one is read) delays its readback: not a step time either
        steady = False
        if self.adaptive_k is not None and out.decodes:
            # why a decode step is not timed; None: it is steady
            why = ("compiled" if compiled or compiles_before != self.runner.num_compiles
                   else "not dispatched" if dispatched is None
                   else "prefill in batch" if len(out.decodes) != len(out.requests)
                   else "verified fewer" if max(ks) != passes else None)
            steady = why is None
            if not steady:
                self.untimed_steps[(passes, why)] += 1
        if steady:
            # a steady pure-decode step's time (it verified as many drafts as it drew: a step
            # after a change of passes costs neither count's time), from when the device
            # could start it (its dispatch, or the previous step's end when it queued behind
            # it) to its result
            seconds = done - max(dispatched, self.last_done)
            if program == self.last_program:
                self.step_times.record(len(out.decodes), passes, seconds)
            else:
                # the previous step ran another program (other draft passes, or the same
                # passes at another token bucket: the second step after a change of passes
                # verifies the new count), which may leave this one slower than in steady
                # running (a GPU program's first run after another's can re-record its
                # command buffers): timing it would judge the counts the rule switches among
                # by their switching cost
                self.switch_step_times.append((passes, seconds))
                self.step_times.record_switch(len(out.decodes), passes, seconds)
                self.untimed_steps[(passes, "after a switch")] += 1
        self.last_done = done
        self.last_program = program
        lps, lp_row = None, {}
        if self.max_logprobs:
            asked = [i for i, r in enumerate(out.requests) if r.seq.logprobs is not None]
            if asked:
                lps, lp_row = self.runner.logprobs(result, asked), {i: a for a, i in enumerate(asked)}
        live = [not self.scheduler.is_void(out, r) for r in out.requests]
        before = [r.seq.num_tokens for r in out.requests]
        K = self.K
        ks = [K] * len(out.requests) if ks is None else ks
        self.scheduler.postprocess(out, committed)
        if has_grammar(out):
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
            self.report(seq)
        if observed:
            sids, used, kept = zip(*observed)
            self.acceptance.observe(sids, used, kept, self.adaptive_k.decay,
                                    self.adaptive_k.step_decay)

    def recover(self, unqueued: Iterable[Sequence]) -> None:
        """Makes the engine consistent after an exception escaped a step part-way (or a previous
        recovery was interrupted; it is idempotent). The results of the steps in flight are lost,
        so every running request is preempted: blocks freed (the allocator is rebuilt, the prefix
        cache kept), slot released, recomputed later from its committed tokens, which the caller
        still receives exactly once. If the step's donated device state did not come back, the
        cache and slot state are rebuilt and the prefix cache is dropped.
        unqueued: held requests deliberately in no queue yet (streams feeding them in)."""
        self.needs_recovery = True
        self.inflight = None
        sched = self.scheduler
        queued = {id(s) for s in sched.running} | {id(s) for s in sched.waiting} | {
            id(s) for s in unqueued}
        orphans = [s for s in self.requests.values()
                   if not s.is_finished and id(s) not in queued]
        self.num_preemptions += len(sched.running)
        sched.requeue_all(orphans)
        lost = self._device_state_lost()
        if lost:
            self.runner.reset_state()
        else:
            self.runner.release_all()
        self.block_manager.reset(keep_prefix_cache=not lost)
        for seq in self.requests.values():
            if seq.is_finished or seq.num_reported_tokens < seq.num_completion_tokens:
                self.report(seq)
        self.needs_recovery = False

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


def has_grammar(out) -> bool:
    """Does a scheduled step hold a structured-output request?"""
    return any(req.seq.grammar is not None for req in out.requests)
