"""The engine thread: one thread owns the (synchronous, step-driven) LLM; the HTTP handlers talk
to it through a thread-safe inbox and per-request callbacks.

Why a thread of its own: `LLM.step()` blocks for a whole device step, so calling it (or
`add_request`, which waits on the same engine lock) from the event loop would stall every
connection. Here the event loop only puts commands in the inbox; between steps the thread
admits new requests (`add_request`: a bad one or a full queue is answered at once), applies
aborts (a client that went away) and steps while any request is unfinished, then routes each
request's new tokens to its sink. When nothing runs it sleeps on the inbox.

Sinks are called on the engine thread with one `Update` at a time, in order; a sink must not
block (the app's sink hands the update to the event loop with `call_soon_threadsafe`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Callable

from mtpjax.config import SamplingParams
from mtpjax.serve.metrics import ServerMetrics

log = logging.getLogger("mtpjax.serve")

# kinds of Update
ADMITTED = "admitted"     # queued in the engine; nothing else in the update
REJECTED = "rejected"     # never queued: `error` is the ValueError / QueueFullError
TOKENS = "tokens"         # token_ids newly committed; finished with finish_reason on the last
FAILED = "failed"         # the engine could not serve it (repeated step errors, shutdown)


@dataclasses.dataclass
class Update:
    kind: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None       # "stop" | "length" | "abort" (engine's reasons)
    error: BaseException | None = None
    # on the final TOKENS update: (verify steps, drafts proposed, drafts accepted) of the request
    spec_counts: tuple[int, int, int] = (0, 0, 0)


Sink = Callable[[Update], None]


@dataclasses.dataclass
class _Active:
    seq: object                 # the engine's Sequence
    sink: Sink
    counts: tuple[int, int, int] = (0, 0, 0)   # spec counters already accounted in the metrics


class EngineLoop:
    """llm: an `mtpjax.LLM` (anything with add_request / step / abort / scheduler); metrics:
    where the thread reports (a fresh ServerMetrics by default). max_step_failures: consecutive
    failing steps after which every running request is failed (the LLM recovers from a failing
    step by itself; a step that keeps failing would otherwise loop forever)."""

    def __init__(self, llm, metrics: ServerMetrics | None = None, *, idle_wait_s: float = 0.5,
                 max_step_failures: int = 3):
        self.llm = llm
        K = llm.spec.num_speculative_tokens if getattr(llm, "spec", None) else 0
        self.metrics = metrics if metrics is not None else ServerMetrics(K)
        self.idle_wait_s = idle_wait_s
        self.max_step_failures = max_step_failures
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next_handle = 0
        self._handle_lock = threading.Lock()
        self._active: dict[int, _Active] = {}           # handle -> request (engine thread only)
        self._handle_of: dict[int, int] = {}            # seq_id -> handle
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fatal: BaseException | None = None          # the thread died of this (a bug)

    # ---- any thread ------------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mtpjax-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def submit(self, prompt_ids: list[int], sampling_params: SamplingParams, sink: Sink) -> int:
        """Queues a request for the engine thread; returns its handle (for `abort`). The sink
        first gets ADMITTED or REJECTED, then TOKENS updates up to one with finished=True (or a
        FAILED one)."""
        with self._handle_lock:
            handle = self._next_handle
            self._next_handle += 1
        if not self.alive:
            sink(Update(FAILED, error=RuntimeError("the engine is not running")))
            return handle
        self._inbox.put(("submit", handle, prompt_ids, sampling_params, sink))
        return handle

    def abort(self, handle: int) -> None:
        """Stops a request (its sink gets a final update with finish_reason "abort"); a request
        already finished or unknown is ignored."""
        self._inbox.put(("abort", handle))

    def close(self, timeout: float = 10.0) -> None:
        """Fails what is still running, stops the thread."""
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            while not self._stop.is_set():
                self._commands(block=not self._active)
                self._publish_queues()
                if self._stop.is_set() or not self._active:
                    continue
                t0 = time.perf_counter()
                try:
                    updates = self.llm.step()
                except Exception as e:      # noqa: BLE001 -- the LLM has recovered already
                    failures += 1
                    log.error("engine step failed (%d in a row): %s\n%s", failures, e,
                              traceback.format_exc())
                    self.metrics.step(time.perf_counter() - t0, 0, [], failed=True)
                    if failures >= self.max_step_failures:
                        self._fail_all(RuntimeError(f"the engine step failed {failures} times "
                                                    f"in a row: {e}"))
                        failures = 0
                    continue
                failures = 0
                self._route(updates, time.perf_counter() - t0)
                self._publish_queues()
        except BaseException as e:          # a bug: fail every request rather than hang them
            self.fatal = e
            log.critical("engine thread died: %s\n%s", e, traceback.format_exc())
        finally:
            self._stop.set()
            self._drain_after_stop()
            self._fail_all(RuntimeError("the server is shutting down" if self.fatal is None
                                        else f"the engine thread died: {self.fatal!r}"))
            self._publish_queues()

    def _commands(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._command(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _command(self, cmd) -> None:
        from mtpjax.engine.llm import QueueFullError
        if cmd[0] == "submit":
            _, handle, prompt_ids, sp, sink = cmd
            try:
                seq = self.llm.add_request(prompt_ids, sp)
            except (ValueError, QueueFullError) as e:
                full = isinstance(e, QueueFullError)
                self.metrics.request_done("rejected" if full else "invalid")
                _call(sink, Update(REJECTED, error=e))
                return
            except Exception as e:            # noqa: BLE001 -- a bug: fail this request only
                log.exception("add_request failed")
                self.metrics.request_done("failed")
                _call(sink, Update(FAILED, error=e))
                return
            self._active[handle] = _Active(seq, sink)
            self._handle_of[seq.seq_id] = handle
            self.metrics.admitted(len(prompt_ids))
            _call(sink, Update(ADMITTED))
        elif cmd[0] == "abort":
            req = self._active.pop(cmd[1], None)
            if req is None:
                return                        # finished meanwhile, or never admitted
            self._handle_of.pop(req.seq.seq_id, None)
            try:
                self.llm.abort(req.seq)
            except ValueError:
                pass                          # finished in the step just run; it is dropped
            except Exception:                 # noqa: BLE001 -- the request is gone either way
                log.exception("abort failed")
            self.metrics.request_done("aborted")
            _call(req.sink, Update(TOKENS, finished=True, finish_reason="abort",
                                   spec_counts=_counts(req.seq)))

    def _route(self, updates, seconds: float) -> None:
        new_tokens, verifies = 0, []
        for seq, new in updates:
            handle = self._handle_of.get(seq.seq_id)
            req = self._active.get(handle) if handle is not None else None
            if req is None:
                continue
            counts = _counts(seq)
            delta = tuple(c - p for c, p in zip(counts, req.counts))
            if delta[0]:
                verifies.append(delta)
            req.counts = counts
            new_tokens += len(new)
            done = seq.is_finished
            if done:
                del self._active[handle]
                del self._handle_of[seq.seq_id]
                self.metrics.request_done("aborted" if seq.finish_reason == "abort"
                                          else "finished")
            _call(req.sink, Update(TOKENS, list(new), done, seq.finish_reason if done else None,
                                   spec_counts=counts))
        self.metrics.step(seconds, new_tokens, verifies)

    def _fail_all(self, error: BaseException) -> None:
        for handle, req in list(self._active.items()):
            try:
                self.llm.abort(req.seq)
            except Exception:              # noqa: BLE001 -- already finished / engine broken
                pass
            self.metrics.request_done("failed")
            _call(req.sink, Update(FAILED, error=error))
        self._active.clear()
        self._handle_of.clear()

    def _drain_after_stop(self) -> None:
        """Requests submitted after the stop: answered FAILED, never left waiting."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                _call(cmd[4], Update(FAILED, error=RuntimeError("the server is shutting down")))

    def _publish_queues(self) -> None:
        sched = getattr(self.llm, "scheduler", None)
        running = len(sched.running) if sched is not None else 0
        waiting = (len(sched.waiting) if sched is not None else 0) + self._inbox.qsize()
        self.metrics.set_queues(running, waiting, len(self._active))


def _counts(seq) -> tuple[int, int, int]:
    return (seq.num_verify_steps, seq.num_draft_tokens, seq.num_accepted_draft_tokens)


def _call(sink: Sink, update: Update) -> None:
    """A failing sink (a bug in a handler) must not take the engine thread down."""
    try:
        sink(update)
    except Exception:                      # noqa: BLE001
        log.exception("request sink failed")
