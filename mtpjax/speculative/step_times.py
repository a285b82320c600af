"""Measured decode-step times per (batch bucket, draft passes): the time side of adaptive K.

A byte count is a floor, not a time: DeepSeek-V2-Lite's batch-1 step runs at ~40% of its
floor without drafts and ~56% with three, so a rule on bytes alone overrates plain decoding
(docs/spec_decoding.md, "Adaptive K"). The engine measures each pure-decode step on the host
(from when the device could start it to when its result is read) and keeps the last `window`
samples per (batch bucket, passes). `estimate` returns the median where measured; elsewhere
the byte model scaled by the seconds-per-byte of the nearest measured passes (same bucket
first, then the nearest bucket), so one measurement already calibrates the others.

A key's samples expire together `max_age` records after its newest: a count the rule has left
is timed again (the rule runs unmeasured counts first) instead of being judged for the rest of the
engine's life by a few early steps. On an H200 (V2-Lite, batch 1) the first steps of a fresh
engine ran 1.5-2x slower than later ones, and a rule that timed one and two passes only then
stayed at three passes where one gave 12% more tokens per second. Each expiry doubles the
key's age limit (up to MAX_AGE_GROWTH x max_age): the samples that replace them are a running
engine's, and re-timing a count out of use costs the steps it is not the best for.

Switching costs too: a step that runs another compiled program than the step before (another
pass count, or the same count at another verify width) may take longer, and on an H200
(V2-Lite, batch 1) such a step took 4.6-17 ms where the count's steady steps took 3.9-5.6
(most likely its CUDA graphs being updated for buffers that moved meanwhile).
`record_switch` keeps what each such step took beyond its count's steady time;
`detour_wait` turns it into the fewest steps between two detours (a probe, a re-timing: up
to DETOUR_SWITCHES switches each) that keep their switching within a share of the time, and
no key's age limit is shorter than that wait (`min_age`).
"""
from __future__ import annotations

import collections
import statistics

import numpy as np


def batch_bucket(rows: int) -> int:
    """Decode rows -> the power of two >= rows (steps of similar batches share samples)."""
    return 1 << max(int(rows) - 1, 0).bit_length()

# program switches of one detour to another count and back: two at each change of count,
# as the step after it verifies the new count's drafts at that count's token bucket
DETOUR_SWITCHES = 4


class StepTimes:
    MAX_AGE_GROWTH = 16

    def __init__(self, window: int = 8, max_age: int = 256):
        if max_age < window:
            raise ValueError(f"StepTimes max_age must be >= window ({window}), got {max_age}")
        self.window = window
        self.max_age = max_age
        self.samples: dict[tuple[int, int], collections.deque] = {}   # (bucket, passes) -> s
        self._newest: dict[tuple[int, int], int] = {}         # key -> its newest record number
        self._medians: dict[tuple[int, int], float] = {}      # kept with each record
        self.recorded: collections.Counter = collections.Counter()   # key -> samples ever
        self._max_age: dict[tuple[int, int], int] = {}         # key -> its age limit now
        self.records = 0                                        # over every key
        # seconds a step after a change of program took beyond its count's steady time
        self.switch_extra: collections.deque = collections.deque(maxlen=window)
        self._switch_median = 0.0                               # kept with each switch
        self.min_age = 0            # no key expires sooner (set from `detour_wait`)

    def record(self, rows: int, passes: int, seconds: float) -> None:
        key = (batch_bucket(rows), int(passes))
        got = self.samples.setdefault(key, collections.deque(maxlen=self.window))
        got.append(float(seconds))
        self._newest[key] = self.records
        self.records += 1
        self.recorded[key] += 1
        # statistics, not numpy: the same median of <= window floats at a tenth of the host
        # time, which a batch-1 step (bound by host work on V2-Lite) pays every step
        self._medians[key] = float(statistics.median(got))

    def record_switch(self, rows: int, passes: int, seconds: float) -> None:
        """A step that ran right after a step of another pass count took `seconds`; what it
        took beyond the count's steady time is the switch's cost (unknown before the count
        is timed: not kept)."""
        steady = self.measured(rows, passes)
        if steady is not None:
            self.switch_extra.append(max(float(seconds) - steady, 0.0))
            self._switch_median = float(statistics.median(self.switch_extra))

    def switch_seconds(self) -> float:
        """The median extra time of a switch (0 before any was measured)."""
        return self._switch_median

    def detour_wait(self, rows: int, passes: int, budget: float) -> int:
        """Steps at `passes` between two detours (DETOUR_SWITCHES switches each) that keep
        the detours' switching within `budget` (a share) of the time at `passes`; 0 while
        either time is unmeasured or budget is 0."""
        steady, extra = self.measured(rows, passes), self.switch_seconds()
        if not steady or not extra or budget <= 0:
            return 0
        return int(np.ceil(DETOUR_SWITCHES * extra / (budget * steady)))

    def _fresh(self, key) -> collections.deque:
        """The key's samples, dropped all at once when the newest is older than the key's
        age limit (max_age, doubled at each expiry up to MAX_AGE_GROWTH x max_age)."""
        got = self.samples.get(key)
        if not got:
            return got if got is not None else collections.deque()
        limit = max(self._max_age.get(key, self.max_age), self.min_age)
        if self._newest[key] < self.records - limit:
            got.clear()
            del self._medians[key]
            # the key is timed again from here, by a running engine, whose steps do not
            # drift as a fresh one's do: its samples may stand twice as long each time, so a
            # count out of use costs fewer re-timings
            self._max_age[key] = min(2 * limit, self.MAX_AGE_GROWTH * self.max_age)
        return got

    def count(self, rows: int, passes: int) -> int:
        """Fresh samples held for this (batch bucket, passes)."""
        return len(self._fresh((batch_bucket(rows), int(passes))))

    def measured(self, rows: int, passes: int) -> float | None:
        key = (batch_bucket(rows), int(passes))
        self._fresh(key)
        return self._medians.get(key)

    def summary(self) -> dict[tuple[int, int], tuple[float, int]]:
        """(batch bucket, passes) -> (median seconds, samples ever recorded): what the rule
        sees now, and how often the count was timed."""
        return {k: (self._medians[k], self.recorded[k])
                for k in sorted(self.samples) if self._fresh(k)}

    def estimate(self, rows: int, model_bytes) -> np.ndarray:
        """Seconds for passes 0..P-1 (model_bytes float[P]: the byte model of each)."""
        model_bytes = np.asarray(model_bytes, np.float64)
        b = batch_bucket(rows)
        out = np.empty(len(model_bytes))
        for p in range(len(model_bytes)):
            t = self.measured(rows, p)
            if t is not None:
                out[p] = t
                continue
            ref = self._nearest(b, p, len(model_bytes))
            out[p] = model_bytes[p] if ref is None else \
                model_bytes[p] * self.measured(ref[0], ref[1]) / model_bytes[ref[1]]
        return out

    def _nearest(self, bucket: int, passes: int, P: int):
        """The measured (bucket, passes) closest to these: same bucket first, then passes."""
        keys = [k for k in self.samples if self._fresh(k) and k[1] < P]
        if not keys:
            return None
        return min(keys, key=lambda k: (abs(np.log2(k[0]) - np.log2(bucket)),
                                        abs(k[1] - passes)))
