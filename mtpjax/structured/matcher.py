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

    def step_masks(self, completion: list[int], drafts, num_positions: int):
        """Bitmasks of one step: (int32[num_positions, W], n_valid). Position j's mask is the
        grammar's after the committed tokens and drafts[:j]; the matcher advances along the
        drafts until the first one the grammar refuses (n_valid drafts accepted), and the
        positions after it, which can never be accepted, stay all-ones. The matcher is rolled
        back to the committed tokens before returning."""
        masks, n_valid = batch_step_masks([(self, completion, drafts)], num_positions)
        return masks[0], int(n_valid[0])


_BATCHER = None


def _batcher():
    """One xgrammar BatchGrammarMatcher per process: it fills many matchers' masks on its
    own threads (xgrammar's default count)."""
    global _BATCHER
    if _BATCHER is None:
        from mtpjax.structured.compiler import import_xgrammar
        _BATCHER = import_xgrammar().BatchGrammarMatcher()
    return _BATCHER


def batch_step_masks(items, num_positions: int):
    """`RequestGrammar.step_masks` for several requests at once: items [(grammar, completion,
    drafts)] -> (int32[n, num_positions, W], n_valid int[n]). Position by position, every
    request still on its drafts has its mask filled in one multithreaded xgrammar call, where
    filling one matcher at a time left a batch of grammar rows waiting on the host."""
    n = len(items)
    W = items[0][0].width if n else 0
    out = np.full((n, num_positions, W), -1, np.int32)
    flat = out.reshape(n * num_positions, W)
    n_valid = np.zeros((n,), np.int64)
    for g, completion, _ in items:
        g.sync(completion)
    active = list(range(n))
    try:
        for j in range(num_positions):
            fillable = [i for i in active if items[i][0].broken_at is None
                        and not items[i][0].matcher.is_terminated()]
            filled = set(fillable)
            if fillable:
                _batcher().batch_fill_next_token_bitmask(
                    [items[i][0].matcher for i in fillable], flat,
                    indices=[i * num_positions + j for i in fillable])
            for i in active:
                if i not in filled or not out[i, j].any():
                    out[i, j] = 0           # nothing the grammar allows: end the request
                    for t in items[i][0].stop_token_ids:
                        allow_token(out[i, j], t)
            if j == num_positions - 1:
                break
            advanced = []
            for i in active:
                g, drafts = items[i][0], list(items[i][2])
                if j >= len(drafts):
                    continue
                d = int(drafts[j])
                # the mask already says whether the grammar takes d: asking the matcher about
                # a refused token costs more and makes xgrammar log a warning per draft
                if (g.broken_at is not None or not 0 <= d < g.vocab_size
                        or not token_allowed(out[i, j], d) or not g._accept(d)):
                    continue
                n_valid[i] += 1
                advanced.append(i)
            active = advanced
    finally:
        for i in range(n):
            if n_valid[i]:
                items[i][0].matcher.rollback(int(n_valid[i]))
    return out, n_valid
