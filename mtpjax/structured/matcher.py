"""One request's grammar on the host: the matcher at the request's committed tokens, and the
per-position token bitmasks of a verify step along its drafts.

The matcher's state is a function of the committed completion tokens only: before each step it
accepts the tokens committed since the last one (`sync`), so a preempted and resumed request,
or one requeued after an engine error, finds its state again without any bookkeeping.
"""

from __future__ import annotations

import numpy as np

from mtpjax.structured.bitmask import allow_token, bitmask_width, token_allowed


class RequestGrammar:
    """compiled: an xgrammar.CompiledGrammar; vocab_size: the model's (mask width
    ceil(V / 32)); stop_token_ids: the engine's eos ids (allowed where the grammar may end)."""

    def __init__(self, compiled, vocab_size: int, stop_token_ids: list[int]):
        from mtpjax.structured.compiler import import_xgrammar
        xgr = import_xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.width = bitmask_width(vocab_size)
        self.num_synced = 0            # completion tokens the matcher has accepted
        self.drafts = np.zeros((0,), np.int32)   # the device's drafts for the next verify step
        self.drafts_at = -1            # completion length when they were read back
        self.broken_at: int | None = None        # completion index of a token it refused

    def sync(self, completion: list[int]) -> None:
        """Accepts the committed tokens the matcher has not seen. A refused token (it can only
        come from outside the masks, e.g. ignore_eos past the end) leaves the matcher where it
        was; from then on only stop tokens are allowed."""
        for t in completion[self.num_synced:]:
            if self.broken_at is None and not self._accept(int(t)):
                self.broken_at = self.num_synced
            self.num_synced += 1

    def _accept(self, token: int) -> bool:
        m = self.matcher
        if m.is_terminated() or not 0 <= token < self.vocab_size:
            return False
        return bool(m.accept_token(token))

    def _fill(self, out: np.ndarray, j: int) -> None:
        """Row j of out [J, W] <- the mask of the matcher's current state."""
        if self.broken_at is None and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(out, j)
            if out[j].any():
                return
        out[j] = 0                      # nothing the grammar allows: end the request
        for t in self.stop_token_ids:
            allow_token(out[j], t)

    def step_masks(self, completion: list[int], drafts, num_positions: int):
        """Bitmasks of one step: (int32[num_positions, W], n_valid). Position j's mask is the
        grammar's after the committed tokens and drafts[:j]; the matcher advances along the
        drafts until the first one the grammar refuses (n_valid drafts accepted), and the
        positions after it, which can never be accepted, stay all-ones. The matcher is rolled
        back to the committed tokens before returning."""
        self.sync(completion)
        out = np.full((num_positions, self.width), -1, np.int32)
        self._fill(out, 0)
        n_valid = 0
        try:
            for j, d in enumerate(list(drafts)[:num_positions - 1]):
                # the mask already says whether the grammar takes d: asking the matcher about a
                # refused token costs more and makes xgrammar log a warning per draft
                if (self.broken_at is not None or not 0 <= int(d) < self.vocab_size
                        or not token_allowed(out[j], int(d)) or not self._accept(int(d))):
                    break
                n_valid += 1
                self._fill(out, j + 1)
        finally:
            if n_valid:
                self.matcher.rollback(n_valid)
        return out, n_valid
