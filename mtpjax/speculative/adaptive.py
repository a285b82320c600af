"""Adaptive K: how many drafts each request verifies this step, chosen on the host.

A request's effective k (0..K) masks drafts past k (never accepted), and the engine's step runs
as many draft passes as the largest k asked of the next step (one compiled program per count),
so changing k never changes outputs (acceptance stays lossless for every k). A masked draft is
a padding token in the verify pass (no KV write, no expert routed), which on MoE models saves
the experts it would have touched. The policy (docs/spec_decoding.md, "Adaptive K"):

    alpha_i  = (hits_i + prior * prior_weight) / (trials_i + prior_weight)
               estimated P(draft i accepted | drafts 1..i-1 accepted), from the request's own
               recent verify steps: a step that reached position i (drafts 1..i-1 accepted, i <= k
               used) adds 1 to trials_i and [draft i accepted] to hits_i; both counts decay by
               `decay` at every such update, so old steps fade.
    gain_i   = alpha_1 * ... * alpha_i      expected tokens draft i adds to a step
    cost(B)  = draft_cost * max(1, B / batch_knee)
               cost of one more draft per request, relative to a token: a draft pass and a verify
               token are nearly free while the step is memory bound (small batch B = decode rows
               of the step), and cost proportionally more once the batch is compute bound.
    k        = the number of leading positions i <= k_max with gain_i >= cost(B) (stop at the
               first position whose expected gain is below its cost), at least min_k;
               every `probe_interval`-th verify step of a request uses k + 1 (capped at k_max) so
               positions past k keep being measured.

On an MoE model (`expert_aware`, the default) the rule decides the step instead
(`AdaptiveK.choose_step`): the draft passes p that maximise the batch's expected tokens per
second of step, every request verifying min(p, its k_max). Seconds are the engine's measured
step times where it has them (`step_times.StepTimes`), else the step's bytes
(`expert_cost.ExpertStepCost`: the experts its verify tokens route to included) scaled by the
nearest measurement's seconds per byte.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from mtpjax.speculative.expert_cost import ExpertStepCost


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """Parameters of the adaptive-K policy (module docstring). Pass `LLM(adaptive_k=AdaptiveK())`;
    default off (every request verifies its SamplingParams.num_speculative_tokens, else K)."""

    draft_cost: float = 0.3
    batch_knee: int = 16
    decay: float = 0.9
    # the MoE step rule's counts decay slower: it weighs counts whose tokens per second may
    # differ by a few percent, where ten steps' worth of acceptance (decay 0.9) is too noisy
    step_decay: float = 0.98
    prior: float = 0.7
    prior_weight: float = 2.0
    probe_interval: int = 8
    # the MoE step rule's probes: two steps that draw every draft asked (each costs the batch
    # passes it may not need), the first `step_probe_interval` steps in; the interval then
    # doubles, up to `step_probe_max_interval`, while probes leave the rule's count as it was,
    # and falls back to `step_probe_interval` when the count changes
    step_probe_interval: int = 64
    step_probe_max_interval: int = 1024
    # ... and leaves its current pass count only for one expected to be this much better
    # (the acceptance estimates are noisy: near-equal counts would alternate)
    switch_margin: float = 0.03
    # the share of the step time that the MoE step rule's detours (probes, re-timing a count
    # out of use: up to four switches of compiled program each) may cost, once a switch's
    # cost is measured (`StepTimes.detour_wait`); the detours wait at least that long apart
    switch_budget: float = 0.01
    min_k: int = 0
    # MoE models: choose k by expected tokens per byte read, counting the experts each
    # verified draft routes to (`expert_cost.py`); off, or on a dense model, the threshold rule
    expert_aware: bool = True

    def __post_init__(self):
        checks = (("draft_cost", self.draft_cost, 0.0, None, "a number >= 0"),
                  ("decay", self.decay, 0.0, 1.0, "a number in [0, 1]"),
                  ("step_decay", self.step_decay, 0.0, 1.0, "a number in [0, 1]"),
                  ("prior", self.prior, 0.0, 1.0, "a number in [0, 1]"),
                  ("prior_weight", self.prior_weight, 0.0, None, "a number >= 0"),
                  ("switch_margin", self.switch_margin, 0.0, None, "a number >= 0"),
                  ("switch_budget", self.switch_budget, 0.0, 1.0, "a number in [0, 1]"))
        for name, v, lo, hi, what in checks:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not (v >= lo and (hi is None or v <= hi)):
                raise ValueError(f"AdaptiveK {name} must be {what}, got {name}={v!r}")
        if not isinstance(self.expert_aware, (bool, np.bool_)):
            raise ValueError(f"AdaptiveK expert_aware must be True or False, got "
                             f"expert_aware={self.expert_aware!r}")
        for name, v, lo in (("batch_knee", self.batch_knee, 1),
                            ("probe_interval", self.probe_interval, 0),
                            ("step_probe_interval", self.step_probe_interval, 0),
                            ("step_probe_max_interval", self.step_probe_max_interval, 0),
                            ("min_k", self.min_k, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"AdaptiveK {name} must be an int >= {lo}, got {name}={v!r}")

    def alphas(self, stats: "RequestAcceptance") -> np.ndarray:
        return (stats.hits + self.prior * self.prior_weight) / (stats.trials + self.prior_weight)

    def cost(self, batch_size: int) -> float:
        return self.draft_cost * max(1.0, batch_size / self.batch_knee)

    def choose(self, stats: "RequestAcceptance", k_max: int, batch_size: int,
               step_cost=None) -> int:
        """Effective k for the request's next verify step (0 <= k <= k_max)."""
        return int(self.choose_many(stats.trials[None], stats.hits[None],
                                    np.asarray([stats.steps]), np.asarray([k_max]),
                                    batch_size, step_cost)[0])

    def choose_many(self, trials, hits, steps, k_max, batch_size: int,
                    step_cost: "ExpertStepCost | None" = None) -> np.ndarray:
        """`choose` for n requests at once (the engine calls it once per step: a Python loop
        over a batch of 64 cost ~1.5 ms of host time per step, enough to leave the device
        waiting). trials, hits float[n, K]; steps int[n]; k_max int[n] -> int[n].
        step_cost: an MoE model's bytes per step (`expert_cost.ExpertStepCost`); with it each
        request takes the k that maximises the batch's expected tokens per byte."""
        K = trials.shape[1]
        alphas = (hits + self.prior * self.prior_weight) / (trials + self.prior_weight)
        gain = np.cumprod(alphas, axis=1)                                   # float[n, K]
        if step_cost is not None and self.expert_aware:
            k = _tokens_per_byte_k(gain, k_max, batch_size, step_cost)
        else:
            stop = (gain < self.cost(batch_size)) | (np.arange(K)[None, :] >= k_max[:, None])
            k = np.where(stop.any(1), stop.argmax(1), K)      # first position not worth it
        k = np.maximum(k, np.minimum(self.min_k, k_max))
        if self.probe_interval:
            probe = steps % self.probe_interval == self.probe_interval - 1
            k = np.where(probe, np.minimum(k + 1, k_max), k)
        return k.astype(np.int64)

    def rule_passes(self, trials, hits, k_max, batch_size: int, step_cost, times=None,
                    current: int | None = None) -> int:
        """The step rule's own pass count (`choose_step` before its measuring and probing
        steps): `_best_passes` with the switch margin, at least min_k."""
        k_max = np.asarray(k_max, np.int64)
        alphas = _step_alphas(trials, hits, self.prior, self.prior_weight)
        passes = _best_passes(np.cumprod(alphas, axis=1), k_max, batch_size, step_cost, times,
                              current, self.switch_margin)
        return max(passes, int(np.minimum(self.min_k, k_max).max()))

    def clear_lead(self, trials, hits, k_max, batch_size: int, step_cost, times,
                   passes: int) -> bool:
        """Does `passes` beat every other count by more than twice the switch margin? A
        probe that finds so lets the next wait longer (`ProbeSchedule`); a near-tie keeps
        probing often, as a few unlucky steps could hold the worse count."""
        alphas = _step_alphas(trials, hits, self.prior, self.prior_weight)
        score = _pass_scores(np.cumprod(alphas, axis=1), k_max, batch_size, step_cost, times)
        if not 0 <= passes < len(score) or len(score) < 2:
            return True
        others = np.delete(score, passes)
        return bool(score[passes] > others.max() * (1 + 2 * self.switch_margin))

    def choose_step(self, trials, hits, steps, k_max, batch_size: int,
                    step_cost: "ExpertStepCost | None" = None, times=None,
                    step_index: int = 0, current: int | None = None,
                    rule: int | None = None,
                    probe: bool | None = None) -> tuple[np.ndarray, int]:
        """The engine's choice for one step: (k int[n] each request verifies next, the step's
        draft passes). On an MoE model (`expert_aware`, a step_cost) one number of passes for
        the batch by expected tokens per second of step (`_best_passes`; `times`: measured
        `StepTimes`; `current`: the count the last such step chose, kept unless another is
        `switch_margin` better), every request at min(passes, its k_max); a count with fewer
        than MEASURED_STEPS steady steps timed at this batch bucket is run first; a probe step
        runs every draft asked, so every position's acceptance keeps being measured: `probe`
        (the engine's `ProbeSchedule`), or when None the last two steps of every
        `step_probe_interval` (at least 2). Otherwise the per-request threshold rule
        (`choose_many`) and as many passes as the largest k."""
        k_max = np.asarray(k_max, np.int64)
        if not len(k_max):
            return k_max, 0
        if step_cost is None or not self.expert_aware:
            ks = self.choose_many(trials, hits, steps, k_max, batch_size)
            return ks, int(ks.max())
        passes = rule if rule is not None else self.rule_passes(trials, hits, k_max, batch_size,
                                                                step_cost, times, current)
        unmeasured = [] if times is None else [
            p for p in range(int(k_max.max()) + 1)
            if times.count(batch_size, p) < MEASURED_STEPS]
        every = max(self.step_probe_interval, 2)
        if unmeasured:
            # measure every count per batch bucket first: the byte model scaled by one
            # count's time keeps the bytes' ranking, which overrates fewer passes (V2-Lite,
            # batch 1: it stayed at one draft where three gave 8% more tokens per second);
            # several steps each, as one step's time can be far off (CPU: 1.8 ms against a
            # median of 1.1)
            passes = unmeasured[0]
        elif probe if probe is not None else (
                self.step_probe_interval and step_index % every >= every - 2):
            # a probe runs every draft asked (every position's acceptance is judged again:
            # one more only would leave the rule stuck below a count two steps up) for two
            # steps: the first draws, the second verifies and is a steady step `StepTimes`
            # keeps
            passes = int(k_max.max())
        ks = np.maximum(np.minimum(k_max, passes), np.minimum(self.min_k, k_max))
        return ks.astype(np.int64), max(passes, int(ks.max()))


# steady steps the step rule times per pass count and batch bucket before trusting the count
MEASURED_STEPS = 3
# a new request's step-rule counts: this many steps' worth of the pooled acceptance
POOL_SEED_STEPS = 10.0


class ProbeSchedule:
    """When the MoE step rule probes (runs every draft asked for two steps, so positions past
    its count are judged again). A probe that leaves the rule's count where it was doubles the
    wait before the next (from `AdaptiveK.step_probe_interval` up to
    `step_probe_max_interval`); a changed count, by a probe or otherwise, restarts from the
    shortest wait. Each probe costs its two steps the passes they may not need (V2-Lite,
    batch 1, acceptance 0.5: three passes give 17% fewer tokens per second than one), so a
    fixed interval of 64 cost ~1% of the tokens for as long as the engine ran. Only a clear
    lead lets the wait grow: the positions past the count are judged at probes alone, so a
    count a few unlucky steps chose over a near-equal one must be checked again soon."""

    def __init__(self, shortest: int, longest: int):
        self.shortest = int(shortest)
        self.longest = max(int(longest), self.shortest)
        self.interval = self.shortest
        self.next_at: int | None = None    # step index of the next probe's first step
        self.before: int | None = None     # the rule's count when the running probe began
        self.left = 0                      # steps of the running probe still to come
        self.last_rule: int | None = None

    def due(self, step_index: int, rule: int, clear=lambda: True, min_wait: int = 0) -> bool:
        """Is the step at step_index (rule: the rule's own count for it) a probe step?
        clear(): does the rule's count lead clearly (`AdaptiveK.clear_lead`), asked when a
        probe has just ended. min_wait: no wait is shorter (`StepTimes.detour_wait`: what
        the probe's switches cost)."""
        if not self.shortest:
            return False
        if self.next_at is None:
            self.next_at = step_index + max(self.interval, min_wait) - 2
        if self.left:
            self.left -= 1
            return True
        if self.before is not None:                       # a probe just ended
            settled = rule == self.before and clear()
            self.interval = min(2 * self.interval, self.longest) if settled else self.shortest
            self.next_at = step_index + max(self.interval, min_wait) - 2
            self.before = None
        elif self.last_rule is not None and rule != self.last_rule:
            self.interval = self.shortest                 # the count moved on its own
            self.next_at = min(self.next_at, step_index + max(self.interval, min_wait) - 2)
        self.last_rule = rule
        if step_index >= self.next_at:
            self.before, self.left = rule, 1
            return True
        return False


def _step_alphas(trials, hits, prior: float, prior_weight: float) -> np.ndarray:
    """The step rule's per-position acceptance: position 1 shrunk toward `prior`, every later
    position toward the request's position-1 estimate (with twice the weight). A count that
    stops drafting position i stops judging it, so a low estimate from few trials would
    stay; shrinking toward position 1 (an optimistic guess: acceptance falls with depth)
    lets the rule return. trials, hits float[n, K] -> float[n, K]."""
    first = (hits[:, :1] + prior * prior_weight) / (trials[:, :1] + prior_weight)
    w = 2 * prior_weight
    later = (hits[:, 1:] + first * w) / (trials[:, 1:] + w)
    return np.concatenate([first, later], axis=1)


def _pass_scores(gain, k_max, batch_size: int, step_cost, times=None) -> np.ndarray:
    """Expected tokens per second of a step at draft passes 0..max k_max (`_best_passes`)."""
    n, K = gain.shape
    k_max = np.asarray(k_max, np.int64)
    cand = np.arange(int(k_max.max()) + 1 if n else 1)
    B = max(int(batch_size), n)
    tokens_at = 1.0 + np.concatenate([np.zeros((n, 1)), np.cumsum(gain, axis=1)], axis=1)
    ks = np.minimum(k_max[:, None], cand[None, :])                         # [n, P]
    tokens = np.take_along_axis(tokens_at, ks, axis=1).sum(0) + (B - n)    # others: plain
    routed = (ks + 1).sum(0) + (B - n)
    model = step_cost.step_bytes(B, routed, cand)
    seconds = model if times is None else times.estimate(B, model)
    return tokens / seconds


def _best_passes(gain, k_max, batch_size: int, step_cost, times=None, current=None,
                 margin: float = 0.0) -> int:
    """The step's draft passes p (0..max k_max) that maximise (tokens the batch expects) /
    (the step's time), every request verifying min(p, its k_max) next: the time is the
    measured step time where `times` (`step_times.StepTimes`) has one, else the byte model
    (`step_cost.step_bytes`) scaled by the nearest measurement's seconds per byte.
    gain float[n, K] (cumulative acceptance); k_max int[n]."""
    score = _pass_scores(gain, k_max, batch_size, step_cost, times)
    cand = np.arange(len(score))
    # the largest p within 1e-9 of the best (ties keep drafting)
    best = int(cand[score >= score.max() * (1 - 1e-9)].max())
    if current is not None and current < len(cand) and \
            score[best] <= score[current] * (1 + margin):
        return int(current)          # not enough better to leave the current count
    return best


def _tokens_per_byte_k(gain, k_max, batch_size: int, step_cost) -> np.ndarray:
    """Per request, the k (0..k_max) that maximises (expected tokens of the step) / (bytes it
    reads), the other requests held at their k_max: on an MoE model each verified draft adds
    the experts it routes to (`ExpertStepCost`), so a draft whose chance of being kept is low
    costs more than it brings. gain float[n, K] (cumulative acceptance); -> int[n]."""
    n, K = gain.shape
    k_max = np.asarray(k_max, np.int64)
    cols = np.arange(K + 1)[None, :]
    tokens = 1.0 + np.concatenate([np.zeros((n, 1)), np.cumsum(gain, axis=1)], axis=1)
    mine = np.take_along_axis(tokens, k_max[:, None], axis=1)[:, 0]     # each at its k_max
    B = max(int(batch_size), n)
    others_tokens = mine.sum() - mine + (B - n) * 1.0       # rows not choosing: plain, 1 each
    others_routed = (k_max + 1).sum() - (k_max + 1) + (B - n)
    score = ((others_tokens[:, None] + tokens)
             / step_cost.step_bytes(B, others_routed[:, None] + 1 + cols))
    score = np.where(cols <= k_max[:, None], score, -np.inf)
    # the largest k within 1e-9 of the best (ties, e.g. a dense-like cost, keep drafting)
    best = score.max(axis=1, keepdims=True)
    return np.where(score >= best * (1 - 1e-9), cols, -1).max(axis=1)


def judged_positions(k_used, accepted, K: int) -> tuple[np.ndarray, np.ndarray]:
    """For one verify step per request that proposed k_used int[n] drafts and accepted the
    first accepted int[n]: (judged, hit) bool[n, K], positions 1..min(k_used, accepted + 1)
    judged, the first `accepted` of them kept."""
    cols = np.arange(K)[None, :]
    judged = cols < np.minimum(k_used, accepted + 1)[:, None]
    return judged, judged & (cols < accepted[:, None])


def observe_steps(trials, hits, k_used, accepted, decay: float, judged_hit=None):
    """Decayed counts after one verify step per request (`judged_positions`, or judged_hit
    if given): each judged position's counts decay and gain the step. trials, hits
    float[n, K] -> new (trials, hits)."""
    judged, hit = judged_hit if judged_hit is not None else \
        judged_positions(k_used, accepted, trials.shape[1])
    return (np.where(judged, decay * trials + 1, trials),
            np.where(judged, decay * hits + hit, hits))


class RequestAcceptance:
    """One request's decayed per-position acceptance counts (host side)."""

    def __init__(self, K: int):
        self.trials = np.zeros(K)      # float[K]
        self.hits = np.zeros(K)        # float[K]
        self.steps = 0                 # verify steps observed

    def observe(self, k_used: int, accepted: int, decay: float) -> None:
        """A verify step that proposed k_used drafts and accepted the first `accepted`."""
        self.steps += 1
        t, h = observe_steps(self.trials[None], self.hits[None], np.asarray([k_used]),
                             np.asarray([accepted]), decay)
        self.trials, self.hits = t[0], h[0]


class AcceptanceTable:
    """Every running request's counts as rows of one array, so a step's choices and updates
    are a few numpy operations whatever the batch size."""

    def __init__(self, K: int):
        self.K = K
        self.row_of: dict[int, int] = {}          # seq_id -> row
        self.free: list[int] = []
        self.trials = np.zeros((0, K))            # float[rows, K]
        self.hits = np.zeros((0, K))              # float[rows, K]
        self.steps = np.zeros((0,), np.int64)     # int[rows]
        # the step rule's counts, decayed by AdaptiveK.step_decay
        self.step_trials = np.zeros((0, K))       # float[rows, K]
        self.step_hits = np.zeros((0, K))         # float[rows, K]
        self.chosen_passes: int | None = None      # the step rule's last choice
        self.probes: ProbeSchedule | None = None    # the step rule's, made on first use
        # every request's judged positions pooled (decayed by step_decay per step): a new
        # request's step-rule counts start from POOL_SEED_STEPS steps' worth of them, not
        # from the fixed prior (engines that serve one kind of text serve similar acceptance)
        self.pool_trials = np.zeros(K)              # float[K]
        self.pool_hits = np.zeros(K)                # float[K]

    def rows(self, seq_ids) -> np.ndarray:
        """Rows of these requests (new requests get a zeroed row). -> int[n]."""
        out = []
        for sid in seq_ids:
            r = self.row_of.get(sid)
            if r is None:
                if not self.free:
                    n = len(self.steps)
                    grow = max(n, 8)
                    self.trials = np.concatenate([self.trials, np.zeros((grow, self.K))])
                    self.hits = np.concatenate([self.hits, np.zeros((grow, self.K))])
                    self.steps = np.concatenate([self.steps, np.zeros(grow, np.int64)])
                    self.step_trials = np.concatenate([self.step_trials, np.zeros((grow, self.K))])
                    self.step_hits = np.concatenate([self.step_hits, np.zeros((grow, self.K))])
                    self.free = list(range(n + grow - 1, n - 1, -1))
                r = self.row_of[sid] = self.free.pop()
                self.trials[r] = self.hits[r] = 0
                seed = min(1.0, POOL_SEED_STEPS / max(self.pool_trials[0], 1.0))
                self.step_trials[r] = self.pool_trials * seed
                self.step_hits[r] = self.pool_hits * seed
                self.steps[r] = 0
            out.append(r)
        return np.asarray(out, np.int64)

    def drop(self, seq_id: int) -> None:
        r = self.row_of.pop(seq_id, None)
        if r is not None:
            self.free.append(r)

    def choose(self, policy: AdaptiveK, seq_ids, k_max, batch_size: int,
               step_cost=None) -> np.ndarray:
        r = self.rows(seq_ids)
        return policy.choose_many(self.trials[r], self.hits[r], self.steps[r],
                                  np.asarray(k_max, np.int64), batch_size, step_cost)

    def choose_step(self, policy: AdaptiveK, seq_ids, k_max, batch_size: int, step_cost=None,
                    times=None, step_index: int = 0) -> tuple[np.ndarray, int]:
        r = self.rows(seq_ids)
        k_max = np.asarray(k_max, np.int64)
        rule = probe = None
        if step_cost is not None and policy.expert_aware and len(k_max):
            args = (self.step_trials[r], self.step_hits[r], k_max, batch_size, step_cost,
                    times)
            rule = self.chosen_passes = policy.rule_passes(*args, self.chosen_passes)
            if self.probes is None:
                self.probes = ProbeSchedule(max(policy.step_probe_interval, 2)
                                            if policy.step_probe_interval else 0,
                                            policy.step_probe_max_interval)
            # switching is not free: detours wait long enough to keep their switches within
            # the budget, and so does re-timing a count out of use
            wait = 0 if times is None else times.detour_wait(batch_size, rule,
                                                             policy.switch_budget)
            if times is not None:
                times.min_age = wait
            probe = self.probes.due(step_index, rule, lambda: policy.clear_lead(
                *args, passes=rule), min_wait=wait)
        return policy.choose_step(self.trials[r], self.hits[r], self.steps[r], k_max,
                                  batch_size, step_cost, times, step_index, rule=rule,
                                  probe=probe)

    def observe(self, seq_ids, k_used, accepted, decay: float,
                step_decay: float | None = None) -> None:
        """Counts after a verify step (`observe_steps`); the step rule's decay by step_decay
        (default: decay)."""
        r = self.rows(seq_ids)
        k_used, accepted = np.asarray(k_used, np.int64), np.asarray(accepted, np.int64)
        judged, hit = judged_positions(k_used, accepted, self.K)         # bool[n, K]
        self.trials[r], self.hits[r] = observe_steps(self.trials[r], self.hits[r], k_used,
                                                     accepted, decay, (judged, hit))
        step_decay = decay if step_decay is None else step_decay
        self.step_trials[r], self.step_hits[r] = observe_steps(
            self.step_trials[r], self.step_hits[r], k_used, accepted, step_decay,
            (judged, hit))
        seen = judged.any(0)
        self.pool_trials = np.where(seen, step_decay * self.pool_trials + judged.sum(0),
                                    self.pool_trials)
        self.pool_hits = np.where(seen, step_decay * self.pool_hits + hit.sum(0),
                                  self.pool_hits)
        self.steps[r] += 1
