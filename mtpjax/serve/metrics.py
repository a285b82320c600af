"""The server's counters and gauges, rendered in the Prometheus text format for `/metrics`.

Written by the engine thread after each step, read by `/metrics` on the event loop; one lock
keeps a scrape consistent. No prometheus_client dependency: the text format is a few lines.

Per-position acceptance: for a verify step of a request that proposed k drafts and kept a,
positions 1..k count one proposal and positions 1..a one acceptance, so
`accepted[i] / proposed[i]` estimates P(draft i accepted | it was proposed) -- the per-position
acceptance of docs/spec_decoding.md, read from the engine's per-request counters (kept drafts
are counted after max_tokens / eos truncation, as the engine counts them).
"""

from __future__ import annotations

import collections
import threading
import time

TOKENS_PER_SECOND_WINDOW_S = 10.0     # tokens/s gauge: generated tokens over this many seconds
OUTCOMES = ("finished", "aborted", "rejected", "invalid", "failed")


class ServerMetrics:
    """K: the engine's drafts per verify step (0: no speculation; the acceptance series are
    then absent). All methods are thread-safe."""

    def __init__(self, K: int, model_name: str = ""):
        self.K, self.model_name = K, model_name
        self._lock = threading.Lock()
        self.requests = {o: 0 for o in OUTCOMES}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.engine_steps = 0
        self.step_failures = 0
        self.step_seconds = 0.0
        self.verify_steps = 0
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.position_proposed = [0] * K
        self.position_accepted = [0] * K
        self.running = 0          # requests in the engine's running batch
        self.waiting = 0          # queue depth: waiting in the engine + submitted, not yet queued
        self.active = 0           # requests the server holds (admitted, not finished)
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self.started = time.time()

    # ---- engine thread ---------------------------------------------------------------------------
    def request_done(self, outcome: str, n: int = 1) -> None:
        with self._lock:
            self.requests[outcome] += n

    def admitted(self, num_prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += num_prompt_tokens

    def step(self, seconds: float, new_tokens: int, verifies: list[tuple[int, int, int]],
             failed: bool = False) -> None:
        """One engine step: its wall time, the tokens it committed, and per request that
        verified drafts (verify steps, drafts proposed, drafts kept) since the last step."""
        now = time.monotonic()
        with self._lock:
            self.engine_steps += 1
            self.step_failures += int(failed)
            self.step_seconds += seconds
            self.generation_tokens += new_tokens
            if new_tokens:
                self._recent.append((now, new_tokens))
            for dv, dd, da in verifies:
                self.verify_steps += dv
                self.draft_tokens += dd
                self.accepted_draft_tokens += da
                if dv == 1:               # one verify step: exactly which positions were kept
                    for i in range(min(dd, self.K)):
                        self.position_proposed[i] += 1
                    for i in range(min(da, self.K)):
                        self.position_accepted[i] += 1

    def set_queues(self, running: int, waiting: int, active: int) -> None:
        with self._lock:
            self.running, self.waiting, self.active = running, waiting, active

    # ---- readers ---------------------------------------------------------------------------------
    def tokens_per_second(self) -> float:
        with self._lock:
            return self._tokens_per_second(time.monotonic())

    def _tokens_per_second(self, now: float) -> float:
        while self._recent and self._recent[0][0] < now - TOKENS_PER_SECOND_WINDOW_S:
            self._recent.popleft()
        return sum(n for _, n in self._recent) / TOKENS_PER_SECOND_WINDOW_S

    def snapshot(self) -> dict:
        with self._lock:
            return dict(requests=dict(self.requests), running=self.running, waiting=self.waiting,
                        active=self.active, generation_tokens=self.generation_tokens,
                        draft_tokens=self.draft_tokens,
                        accepted_draft_tokens=self.accepted_draft_tokens,
                        position_proposed=list(self.position_proposed),
                        position_accepted=list(self.position_accepted))

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.append(f"# HELP mtpjax_{name} {help_}")
            lines.append(f"# TYPE mtpjax_{name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"mtpjax_{name}{'{' + lab + '}' if lab else ''} {value}")

        with self._lock:
            tps = self._tokens_per_second(time.monotonic())
            metric("requests_total", "counter", "Requests by outcome (finished: stop or length; "
                   "aborted: client gone or stop string; rejected: queue full; invalid: refused by "
                   "the engine's checks; failed: engine error).",
                   [({"outcome": o}, n) for o, n in self.requests.items()])
            metric("requests_running", "gauge", "Requests in the engine's running batch.",
                   [({}, self.running)])
            metric("requests_waiting", "gauge", "Queue depth: requests waiting for the engine.",
                   [({}, self.waiting)])
            metric("requests_active", "gauge", "Requests the server holds (admitted, not "
                   "finished).", [({}, self.active)])
            metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
                   [({}, self.prompt_tokens)])
            metric("generation_tokens_total", "counter", "Completion tokens committed.",
                   [({}, self.generation_tokens)])
            metric("tokens_per_second", "gauge", f"Completion tokens per second over the last "
                   f"{TOKENS_PER_SECOND_WINDOW_S:g} s.", [({}, f"{tps:.3f}")])
            metric("engine_steps_total", "counter", "Engine steps run.", [({}, self.engine_steps)])
            metric("engine_step_failures_total", "counter", "Engine steps that raised (the "
                   "engine recovered; its requests were recomputed).",
                   [({}, self.step_failures)])
            metric("engine_step_seconds_total", "counter", "Wall time spent in engine steps.",
                   [({}, f"{self.step_seconds:.6f}")])
            metric("num_speculative_tokens", "gauge", "Drafts per verify step (K; 0: MTP off).",
                   [({}, self.K)])
            if self.K:
                metric("spec_verify_steps_total", "counter", "Verify steps (per request).",
                       [({}, self.verify_steps)])
                metric("spec_draft_tokens_total", "counter", "Draft tokens proposed.",
                       [({}, self.draft_tokens)])
                metric("spec_accepted_draft_tokens_total", "counter", "Draft tokens accepted.",
                       [({}, self.accepted_draft_tokens)])
                rate = self.accepted_draft_tokens / max(self.draft_tokens, 1)
                metric("spec_acceptance_rate", "gauge", "Accepted / proposed draft tokens.",
                       [({}, f"{rate:.6f}")])
                steps = max(self.verify_steps, 1)
                length = (self.accepted_draft_tokens + self.verify_steps) / steps
                metric("spec_mean_acceptance_length", "gauge", "Tokens committed per verify step "
                       "(bonus token included).", [({}, f"{length:.6f}")])
                pos = [({"position": str(i + 1)}, n) for i, n in enumerate(self.position_proposed)]
                metric("spec_position_proposed_total", "counter", "Verify steps that proposed a "
                       "draft at this position.", pos)
                pos = [({"position": str(i + 1)}, n) for i, n in enumerate(self.position_accepted)]
                metric("spec_position_accepted_total", "counter", "Verify steps that accepted "
                       "the draft at this position.", pos)
                pos = [({"position": str(i + 1)},
                        f"{a / max(p, 1):.6f}")
                       for i, (p, a) in enumerate(zip(self.position_proposed,
                                                      self.position_accepted))]
                metric("spec_position_acceptance", "gauge", "Per-position acceptance: accepted "
                       "/ proposed at this draft position.", pos)
        return "\n".join(lines) + "\n"
