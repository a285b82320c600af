"""Incremental detokenization: text deltas from token ids that arrive a few at a time.

Decoding each new token on its own is wrong for byte-level BPE (one character can span several
tokens: a token may end in the middle of a UTF-8 sequence) and for tokenizers whose decode
merges or cleans up across token boundaries (SentencePiece's leading-space marker). So, as vLLM
does, a short window of ids is decoded twice: up to the last emitted position (`read_offset`)
and up to the end; the difference is the new text, held back while it ends in U+FFFD (an
incomplete character that the next token will complete). The window slides forward, so each
push decodes a few tokens, not the whole completion.

`finish()` decodes the whole completion once and emits whatever the window held back, so the
concatenated deltas equal `decode(completion)` whenever the window's text is a prefix of it
(always, for the shipped byte-level tokenizers; tests/engine/test_text_stream.py checks it).
"""

from __future__ import annotations

from typing import Callable, Sequence

# Prompt ids decoded ahead of the completion: enough context that the completion's first token
# decodes as it does in the middle of a text (a SentencePiece word start keeps its space).
PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """decode: ids (list[int]) -> str, e.g. the checkpoint tokenizer's `decode`.
    prompt_ids: the request's prompt (only its last PROMPT_CONTEXT_TOKENS ids are used).

    push(new_ids) -> the text those ids complete (possibly ""); finish() -> the rest.
    `text` is everything emitted so far; `token_ids` the completion ids pushed so far."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()):
        self._decode = decode
        context = [int(t) for t in prompt_ids[-PROMPT_CONTEXT_TOKENS:]] if len(prompt_ids) else []
        self._ids: list[int] = context            # context + completion
        self._num_context = len(context)
        self._prefix_offset = 0                   # window start
        self._read_offset = len(context)          # ids before this are emitted text
        self.text = ""
        self.finished = False

    @property
    def token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    def push(self, new_ids: Sequence[int]) -> str:
        if self.finished:
            raise RuntimeError("push after finish(): the completion is already complete")
        if not len(new_ids):
            return ""
        self._ids.extend(int(t) for t in new_ids)
        seen = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decode(self._ids[self._prefix_offset:])
        # an incomplete character decodes to U+FFFD; wait for the tokens that complete it
        if len(full) <= len(seen) or full.endswith("\ufffd") or not full.startswith(seen):
            return ""
        delta = full[len(seen):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The held-back rest of the text (the whole completion decoded once). Idempotent."""
        if self.finished:
            return ""
        self.finished = True
        whole = self._decode(self.token_ids)
        if whole.startswith(self.text):
            delta = whole[len(self.text):]
        else:
            # the window decoded differently from the whole (a decoder that cleans up across
            # far-apart tokens): emit the window's view of the unread tail rather than retract
            seen = self._decode(self._ids[self._prefix_offset:self._read_offset])
            full = self._decode(self._ids[self._prefix_offset:])
            delta = full[len(seen):] if full.startswith(seen) else ""
        self.text += delta
        return delta
