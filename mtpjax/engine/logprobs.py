"""A request's logprobs, kept as the step's arrays and turned into dicts only when read.

`RequestOutput.logprobs` is vLLM's `list[dict[token id, logprob]]`; building those dicts on the
engine's critical path cost ~0.4 ms of Python per step at 32 rows (K = 3, 5 alternatives), which
the device waits for once host time passes the step time. `TokenLogprobs` instead appends each
step's result arrays with the request's row (one tuple per request per step) and builds a
token's dict on first access. vLLM made a similar move for its garbage-collector cost
(`FlatLogprobs`, vllm-project/vllm PR #28171).
"""

from collections.abc import Sequence

import numpy as np


class TokenLogprobs(Sequence):
    """Read-only sequence of {token id: logprob} dicts, one per generated token: the token's
    own logprob and its `n` most likely alternatives (the token may be one of them)."""

    def __init__(self, n: int):
        self.n = n
        # (tokens list[k], (chosen f32[R, J], ids int32[R, J, >=n], vals f32[R, J, >=n]), row):
        # the request's k tokens are positions 0..k-1 of row `row` of one step's arrays
        self._chunks: list[tuple] = []
        self._len = 0
        self._built: list[dict[int, float]] = []

    def append_step(self, tokens: list[int], step: tuple, row: int) -> None:
        """One step's committed tokens (k of them) and that step's arrays `step` = (chosen
        f32[R, J], ids int32[R, J, >= n], vals f32[R, J, >= n]), J >= k; the request's row."""
        if tokens:
            self._chunks.append((tokens, step, row))
            self._len += len(tokens)

    def snapshot(self) -> "TokenLogprobs":
        """A copy that later appends do not change (shares the immutable chunks)."""
        other = TokenLogprobs(self.n)
        other._chunks, other._len, other._built = list(self._chunks), self._len, self._built[:]
        return other

    def _build_to(self, end: int) -> None:
        if end <= len(self._built):
            return
        seen = 0
        for tokens, (chosen, ids, vals), row in self._chunks:
            k = len(tokens)
            if seen + k > len(self._built):
                lo = len(self._built) - seen
                ids_l = np.asarray(ids)[row, lo:k, :self.n].tolist()
                vals_l = np.asarray(vals)[row, lo:k, :self.n].tolist()
                for t, c, i, v in zip(list(tokens)[lo:], np.asarray(chosen)[row, lo:k].tolist(),
                                      ids_l, vals_l):
                    d = dict(zip(i, v))
                    d[t] = c
                    self._built.append(d)
            seen += k
            if len(self._built) >= end:
                return

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i):
        if isinstance(i, slice):
            self._build_to(self._len)
            return [dict(d) for d in self._built[i]]
        if not -self._len <= i < self._len:
            raise IndexError(f"logprobs index {i} out of range for {self._len} tokens")
        i %= self._len
        self._build_to(i + 1)
        return dict(self._built[i])

    def __eq__(self, other) -> bool:
        if isinstance(other, (TokenLogprobs, list)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"
