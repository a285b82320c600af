"""Adaptive K: how many drafts each request verifies this step, chosen on the host.

The engine compiles its step for K drafts; a request's effective k (0..K) only masks drafts past
k (never accepted), so changing k never recompiles and never changes outputs (acceptance stays
lossless for every k). The policy (docs/spec_decoding.md, "Adaptive K"):

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
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class AdaptiveK:
    """Parameters of the adaptive-K policy (module docstring). Pass `LLM(adaptive_k=AdaptiveK())`;
    default off (every request verifies its SamplingParams.num_speculative_tokens, else K)."""

    draft_cost: float = 0.3
    batch_knee: int = 16
    decay: float = 0.9
    prior: float = 0.7
    prior_weight: float = 2.0
    probe_interval: int = 8
    min_k: int = 0

    def __post_init__(self):
        checks = (("draft_cost", self.draft_cost, 0.0, None, "a number >= 0"),
                  ("decay", self.decay, 0.0, 1.0, "a number in [0, 1]"),
                  ("prior", self.prior, 0.0, 1.0, "a number in [0, 1]"),
                  ("prior_weight", self.prior_weight, 0.0, None, "a number >= 0"))
        for name, v, lo, hi, what in checks:
            if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
                    or not (v >= lo and (hi is None or v <= hi)):
                raise ValueError(f"AdaptiveK {name} must be {what}, got {name}={v!r}")
        for name, v, lo in (("batch_knee", self.batch_knee, 1),
                            ("probe_interval", self.probe_interval, 0),
                            ("min_k", self.min_k, 0)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"AdaptiveK {name} must be an int >= {lo}, got {name}={v!r}")

    def alphas(self, stats: "RequestAcceptance") -> np.ndarray:
        return (stats.hits + self.prior * self.prior_weight) / (stats.trials + self.prior_weight)

    def cost(self, batch_size: int) -> float:
        return self.draft_cost * max(1.0, batch_size / self.batch_knee)

    def choose(self, stats: "RequestAcceptance", k_max: int, batch_size: int) -> int:
        """Effective k for the request's next verify step (0 <= k <= k_max)."""
        gain = np.cumprod(self.alphas(stats)[:k_max])
        below = np.flatnonzero(gain < self.cost(batch_size))
        k = int(below[0]) if below.size else k_max
        k = max(k, min(self.min_k, k_max))
        if self.probe_interval and stats.steps % self.probe_interval == self.probe_interval - 1:
            k = min(k + 1, k_max)
        return k


class RequestAcceptance:
    """One request's decayed per-position acceptance counts (host side)."""

    def __init__(self, K: int):
        self.trials = np.zeros(K)
        self.hits = np.zeros(K)
        self.steps = 0                 # verify steps observed

    def observe(self, k_used: int, accepted: int, decay: float) -> None:
        """A verify step that proposed k_used drafts and accepted the first `accepted`."""
        self.steps += 1
        reached = min(k_used, accepted + 1)           # positions 1..reached were judged
        self.trials[:reached] = decay * self.trials[:reached] + 1
        self.hits[:reached] = decay * self.hits[:reached] + (np.arange(reached) < accepted)
