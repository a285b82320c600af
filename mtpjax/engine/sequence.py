"""A request's host-side state: its tokens, where its KV lives, and how far it has been computed.

Position convention (used across mtpjax, see docs/engine.md):

    token_ids            x_0 .. x_{T-1}                 T = num_tokens (prompt + committed completion)
    num_computed_tokens  seq_len: tokens whose KV is committed in the paged cache
    decoding             seq_len == T - 1: the newest token x_{T-1} has no KV yet; it is the first
                         query token of the next verify step, at position T - 1.

Draft tokens never enter `token_ids`: they live on the device and only committed tokens come back.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Iterable, Sequence as _Seq

class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # queued (new or preempted); holds no blocks
    RUNNING = enum.auto()   # holds blocks; prefilling (possibly in chunks) or decoding
    FINISHED = enum.auto()  # stop token, max_tokens reached or aborted; blocks released


class Sequence:
    """One request. Mutated only by the Scheduler and the BlockManager (and the LLM's counters
    at the end of __init__).

    `sampling_params` (mtpjax.config.SamplingParams or anything with the same attributes) is read
    duck-typed: `max_tokens` (None: bounded by the Scheduler at add(), see Scheduler.add),
    `stop_token_ids` (default none) and `ignore_eos` (default False); the object is kept for the runner.
    """

    _ids = itertools.count()

    def __init__(self, token_ids: _Seq[int], *, sampling_params: Any = None,
                 seq_id: int | None = None):
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise ValueError("a sequence needs at least one prompt token, got token_ids=[]")
        self.seq_id: int = next(Sequence._ids) if seq_id is None else int(seq_id)
        self.sampling_params = sampling_params
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is not None and (isinstance(max_tokens, bool) or int(max_tokens) < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got max_tokens={max_tokens!r}")
        self.max_tokens: int | None = None if max_tokens is None else int(max_tokens)
        self.stop_token_ids: frozenset[int] = frozenset(
            int(t) for t in (getattr(sampling_params, "stop_token_ids", None) or ()))
        self.ignore_eos: bool = bool(getattr(sampling_params, "ignore_eos", False))

        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None          # "stop" | "length" | "abort" once FINISHED
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens: int = len(token_ids)
        # KV bookkeeping (owned by BlockManager / Scheduler).
        self.block_table: list[int] = []                # block ids, position p lives in block_table[p // block_size]
        self.block_hashes: list[bytes] = []             # chained hashes of this seq's registered-eligible full blocks
        self.num_cached_tokens: int = 0                 # tokens taken from the prefix cache at allocation
        self.num_computed_tokens: int = 0               # seq_len: tokens whose KV is committed
        self.num_prefill_tokens: int = len(token_ids)   # the current (re)prefill ends when seq_len reaches this
        self.num_preemptions: int = 0
        # Engine counters (mtpjax.LLM): speculation statistics, and how many completion tokens
        # have been handed to the caller (each committed token is reported exactly once).
        self.num_verify_steps: int = 0
        self.num_draft_tokens: int = 0                  # drafts proposed to the target
        self.num_accepted_draft_tokens: int = 0
        self.num_reported_tokens: int = 0
        # one {token id: logprob} dict per completion token, when the request asks for logprobs
        self.logprobs = None        # engine.logprobs.TokenLogprobs | None
        self.prompt_lp = None       # engine.prompt_logprobs.PromptLogprobs | None
        # stop strings: serve.stop_strings.TokenStopChecker, pushed every committed token by
        # the Scheduler (None when the request has none, so others pay nothing)
        self.stop_checker = None
        # structured.matcher.RequestGrammar of a request with structured output (LLM), else None
        self.grammar = None
        # which of its prompt's SamplingParams.n samples this request is (mtpjax.LLM.generate)
        self.sample_index: int = 0

    # ---- sizes -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Alias of num_computed_tokens (the project-wide name)."""
        return self.num_computed_tokens

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    # ---- phase -------------------------------------------------------------------------------
    @property
    def is_prefill(self) -> bool:
        """True until the current (re)prefill has committed KV for all its tokens."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def num_uncomputed_prefill_tokens(self) -> int:
        return max(0, self.num_prefill_tokens - self.num_computed_tokens)

    @property
    def prefill_target(self) -> int:
        """seq_len at which an admission's (re)prefill ends. A new request prefills its prompt
        and its last chunk samples x_P. A request that already has completion tokens (preempted,
        or requeued by recovery) *resumes*: it recomputes x_0..x_{T-2} and its last token x_{T-1}
        becomes the pending token again, without sampling anything, so the next verify step sees
        exactly the state (pending token, drafts) it would have seen without the preemption.
        That makes recomputation invisible to every acceptance rule (docs/engine.md)."""
        return self.num_tokens - 1 if self.num_completion_tokens else self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    # ---- mutation ----------------------------------------------------------------------------
    def append_tokens(self, ids: Iterable[int]) -> None:
        """Append committed tokens (sampled / accepted). KV bookkeeping is the caller's job."""
        self.token_ids.extend(int(t) for t in ids)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
                f"prompt={self.num_prompt_tokens}, computed={self.num_computed_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
