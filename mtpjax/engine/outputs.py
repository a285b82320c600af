"""What `LLM` hands back: RequestOutput, StreamEvent, the per-stream bookkeeping of
`generate_stream`, and the text a request's tokens make (whole or as stream deltas).

Nothing here touches the scheduler or the device: each function reads a Sequence (and the
tokenizer) and builds the caller's view of it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import time
from typing import Any, Iterator

from mtpjax.engine.logprobs import TokenLogprobs
from mtpjax.engine.sequence import Sequence


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_verify_steps: int = 0
    num_draft_tokens: int = 0          # drafts proposed to the target (this request's own k)
    num_accepted_draft_tokens: int = 0
    # SamplingParams.logprobs set: logprobs[i] = {token id: logprob} for the i-th generated token
    # (the token itself and the `logprobs` most likely tokens), else None. A read-only sequence
    # of dicts (`TokenLogprobs`, built on access; compares equal to the list of dicts)
    logprobs: TokenLogprobs | None = None
    # SamplingParams.prompt_logprobs set: [None, {prompt[1]: logprob, ...}, ...] (vLLM's layout:
    # the first prompt token has no logprob), else None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # finish_reason "stop": the stop string found (SamplingParams.stop) or the stop token id
    # (SamplingParams.stop_token_ids); None for eos and any other end (vLLM's field)
    stop_reason: str | int | None = None
    # which of its prompt's SamplingParams.n completions this is (0..n-1; 0 when n = 1)
    sample_index: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verify step (bonus included)."""
        return (self.num_accepted_draft_tokens + self.num_verify_steps) / max(self.num_verify_steps, 1)


@dataclasses.dataclass
class StreamEvent:
    request_index: int                 # index into the prompts given to generate_stream
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None       # set when finished (finish_reason "abort" if aborted)
    request_id: int = -1               # the engine's id of the request (for LLM.abort)
    # the text these tokens complete (with a tokenizer; else ""): the deltas of a request
    # concatenate to its output's text, also where a character spans several tokens
    text_delta: str = ""
    sample_index: int = 0              # which of the prompt's SamplingParams.n completions


def request_output(seq: Sequence, tokenizer) -> RequestOutput:
    """The RequestOutput of `seq` now: final once it is finished, a snapshot before."""
    toks = list(seq.completion_token_ids)
    chk, stop_reason = seq.stop_checker, None
    if chk is not None:
        # the text never goes past a stop string (held back until the request ends)
        if seq.is_finished:
            chk.finish()
        text, stop_reason = chk.text, chk.stop_reason
    else:
        text = tokenizer.decode(toks) if tokenizer is not None else None
    if seq.finish_reason == "stop" and stop_reason is None and toks \
            and toks[-1] in seq.stop_token_ids:
        stop_reason = toks[-1]
    lps = getattr(seq, "logprobs", None)
    return RequestOutput(seq.seq_id, list(seq.prompt_token_ids), toks, text,
                         seq.finish_reason, seq.num_verify_steps, seq.num_draft_tokens,
                         seq.num_accepted_draft_tokens,
                         None if lps is None else lps.snapshot(),
                         None if seq.prompt_lp is None else seq.prompt_lp.result(),
                         stop_reason, seq.sample_index)


class Stream:
    """One generate_stream call: its requests, those not yet queued (the waiting queue is bounded,
    so a long prompt list is fed in as room frees up) and those with events not yet yielded."""

    def __init__(self, seqs: list[Sequence], prompt_of: list[int] | None = None):
        self.seqs = seqs
        prompt_of = list(range(len(seqs))) if prompt_of is None else prompt_of
        self.index = {s.seq_id: i for s, i in zip(seqs, prompt_of)}    # -> prompt index
        self.position = {s.seq_id: k for k, s in enumerate(seqs)}       # -> index in seqs
        # SamplingParams.n > 1: a prompt's first sample is queued first; the others wait in
        # `todo` until its prompt is prefilled, so they find the prompt's blocks in the prefix
        # cache instead of prefilling them again side by side
        firsts = {i: s for s, i in zip(seqs, prompt_of) if s.sample_index == 0}
        self.parent = {s.seq_id: firsts[i] for s, i in zip(seqs, prompt_of) if s.sample_index}
        self.todo: collections.deque[Sequence] = collections.deque(    # not queued yet
            [s for s in seqs if not s.sample_index] + [s for s in seqs if s.sample_index])
        self.news: dict[int, Sequence] = {}      # seq_id -> request with something to report
        self.open = set(self.index)              # requests whose final event is not yet yielded
        # seq_id -> IncrementalDetokenizer (tokenizer), or, for a request with stop strings,
        # how many characters of its stop checker's text were streamed
        self.detok: dict[int, Any] = {}


def text_delta(stream: Stream, seq: Sequence, new: list[int], done: bool, tokenizer) -> str:
    """The text that `seq`'s `new` tokens complete in `stream` (the whole rest when `done`)."""
    if tokenizer is None:
        return ""
    chk = seq.stop_checker
    if chk is not None:
        # its checker already decoded the committed tokens: stream the text it deems safe
        if done:
            chk.finish()
        sent = stream.detok.pop(seq.seq_id, 0)
        if not done:
            stream.detok[seq.seq_id] = len(chk.text)
        return chk.text[sent:]
    from mtpjax.serve.detokenize import IncrementalDetokenizer
    detok = stream.detok.get(seq.seq_id)
    if detok is None:
        detok = stream.detok[seq.seq_id] = IncrementalDetokenizer(
            tokenizer.decode, list(seq.prompt_token_ids))
    delta = detok.push(new)
    if done:
        delta += detok.finish()
        del stream.detok[seq.seq_id]
    return delta


def collect_outputs(events: Iterator[StreamEvent], num_prompts: int,
                    progress: bool = False) -> list[RequestOutput]:
    """The final RequestOutputs of a generate_stream, in prompt order (the stream is closed
    at the end, early on an exception); with a progress bar when asked."""
    outputs: list[dict[int, Any]] = [{} for _ in range(num_prompts)]   # sample -> output
    bar = _Progress(num_prompts) if progress else None
    with contextlib.closing(events):
        for ev in events:
            if ev.finished:
                outputs[ev.request_index][ev.sample_index] = ev.output
                if bar:
                    bar.update(ev.output)
    if bar:
        bar.close()
    return [o.get(j) for o in outputs for j in (sorted(o) or [0])]


class _Progress:
    """Minimal progress line on stderr (no dependency)."""

    def __init__(self, total: int):
        self.total, self.done, self.tokens, self.t0, self.out = total, 0, 0, time.perf_counter(), sys.stderr

    def update(self, out: RequestOutput):
        self.done += 1
        self.tokens += len(out.token_ids)
        dt = time.perf_counter() - self.t0
        self.out.write(f"\r[{self.done}/{self.total}] {self.tokens} tokens, "
                       f"{self.tokens / max(dt, 1e-9):.1f} tok/s")
        self.out.flush()

    def close(self):
        self.out.write("\n")
