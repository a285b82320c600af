"""OpenAI `stop` strings, applied to streamed text.

The engine stops on token ids only; a stop string can span several tokens or start in the middle
of one. So the text is checked as it grows: the text before the first stop string is the answer
(the stop string itself is not returned, as OpenAI does), and while streaming, the last
`longest stop - 1` characters are held back, since they may be the start of a stop string the
next delta completes.
"""

from __future__ import annotations


class StopStrings:
    """stops: the request's stop strings (possibly empty: then every delta passes through).

    feed(delta) -> (text safe to emit now, stopped); flush() -> the held-back text once the
    completion ended without a stop string."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""          # text received, not emitted (may start a stop string)
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped or not delta:
            return "", self.stopped
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return text[:min(hits)], True
        cut = max(len(text) - self._hold, 0)
        self._pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
