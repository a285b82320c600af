"""Stop strings (OpenAI's `stop`, vLLM's `SamplingParams.stop`), applied to streamed text.

The engine stops on token ids only; a stop string can span several tokens or start in the middle
of one. So the text is checked as it grows: the text before the first stop string is the answer
(the stop string itself is not returned, as OpenAI does, unless include_stop: vLLM's
include_stop_str_in_output), and while streaming, the last `longest stop - 1` characters are held
back, since they may be the start of a stop string the next delta completes.

`StopStrings` works on text deltas (the HTTP server feeds it the detokenizer's deltas);
`TokenStopChecker` is the engine's: it is fed one committed token at a time, so the token in
which a stop string ends is known exactly, whatever grouping the tokens arrived in (speculative
decoding commits several per step, plain decoding one): the same tokens give the same cut.
"""

from __future__ import annotations

from typing import Callable, Sequence

from mtpjax.serve.detokenize import IncrementalDetokenizer


class StopStrings:
    """stops: the request's stop strings (possibly empty: then every delta passes through).

    feed(delta) -> (text safe to emit now, stopped); flush() -> the held-back text once the
    completion ended without a stop string. Once stopped, `stop_reason` is the stop string
    found (the earliest in the text; the first listed of those starting there)."""

    def __init__(self, stops: tuple[str, ...] | list[str], include_stop: bool = False):
        self.stops = tuple(stops)
        self.include_stop = bool(include_stop)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""          # text received, not emitted (may start a stop string)
        self.stopped = False
        self.stop_reason: str | None = None

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped or not delta:
            return "", self.stopped
        if not self.stops:
            return delta, False
        text = self._pending + delta
        hits = [(i, k) for k, i in enumerate(text.find(s) for s in self.stops) if i >= 0]
        if hits:
            i, k = min(hits)
            self.stopped, self._pending, self.stop_reason = True, "", self.stops[k]
            return text[:i + (len(self.stops[k]) if self.include_stop else 0)], True
        cut = max(len(text) - self._hold, 0)
        self._pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


class TokenStopChecker:
    """A request's stop strings over its committed tokens (mtpjax.LLM; one per request that has
    stop strings, so requests without any pay nothing).

    push(token_ids) -> True once the completion's text so far contains a stop string; token_ids
    is the request's prompt + completion (read in place: no copy per token). Each call looks at
    the completion ids it has not seen yet, one at a time, and stops at the first that completes
    a stop string: `num_seen` ids are then the completion (the token in which the stop string
    ends is kept, as vLLM keeps it); the caller drops any after it. `text` is the completion's
    text that is safe to show so far (never past the cut; once `finished`, all of it)."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int],
                 stops: Sequence[str], include_stop: bool = False):
        self._detok = IncrementalDetokenizer(decode, prompt_ids)
        self._num_prompt = len(prompt_ids)
        self._stops = StopStrings(tuple(stops), include_stop)
        self.num_seen = 0
        self.text = ""
        self.finished = False

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def stop_reason(self) -> str | None:
        return self._stops.stop_reason

    def push(self, token_ids: Sequence[int]) -> bool:
        while not self.stopped and self._num_prompt + self.num_seen < len(token_ids):
            delta = self._detok.push([token_ids[self._num_prompt + self.num_seen]])
            self.num_seen += 1
            out, _ = self._stops.feed(delta)
            self.text += out
        return self.stopped

    def finish(self) -> str:
        """Ends the text (the request finished): the held-back rest, cut at a stop string the
        whole completion's decoding shows only now. Returns what it added. Idempotent."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        out, _ = self._stops.feed(self._detok.finish())
        out += self._stops.flush()
        self.text += out
        return out
