"""Request intake: what `LLM` accepts as prompts and SamplingParams, turned into Sequences.

Every check happens before anything is queued, so a bad request raises a ValueError naming the
bad value and changes nothing (docs/engine.md, "Errors, abort, interrupts and threads").
`RequestIntake` holds what the checks need (the model's vocabulary, the tokenizer and chat
template, the scheduler's limits); the engine queues what it returns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtpjax.config import ModelConfig, SamplingParams, SpecConfig
from mtpjax.engine.logprobs import TokenLogprobs
from mtpjax.engine.prompt_logprobs import PromptLogprobs
from mtpjax.engine.scheduler import Scheduler
from mtpjax.engine.sequence import Sequence
from mtpjax.sampling import validate_sampling_params


class QueueFullError(RuntimeError):
    """add_request refused: the waiting queue already holds `max_waiting_requests` requests.
    Nothing was queued; retry once some requests have been admitted or finished."""


def is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def int_arg(name: str, value, lo: int, hi: int | None = None, *, none_ok: bool = False):
    """`value` as a Python int if it is an int (numpy ints too) in [lo, hi], else ValueError."""
    if value is None and none_ok:
        return None
    if not is_int(value) or value < lo or (hi is not None and value > hi):
        want = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {want}{' or None' if none_ok else ''}, got "
                         f"{name}={value!r}")
    return int(value)


def prompt_list(prompts) -> list:
    """The prompts argument as a list of prompts; refuses what is surely one prompt (a string, a
    flat list of ids, a 1-D array)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts must be a list of prompts; got a single string: pass [prompt]")
    if hasattr(prompts, "__array__") and not isinstance(prompts, (list, tuple)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts given as an array must be 2-D [num_prompts, length], got "
                             f"shape {arr.shape}; for one prompt pass [ids]")
        return list(arr)
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError("prompts must be a list of prompts (token-id lists or strings), got "
                         f"{type(prompts).__name__}") from None
    for i, p in enumerate(prompts):
        if is_int(p):
            raise ValueError(f"prompts must be a list of prompts, each a list of token ids or a "
                             f"string; prompts[{i}] is the int {p!r}. For one prompt pass "
                             f"[[1, 2, 3]], not [1, 2, 3]")
    return prompts


def chat_template_arg(template):
    """LLM's chat_template argument as a ChatTemplate (or None)."""
    if template is None:
        return None
    from mtpjax.serve.chat_template import ChatTemplate
    if isinstance(template, str):
        return ChatTemplate(template)
    if not isinstance(template, ChatTemplate):
        raise ValueError(f"chat_template must be a ChatTemplate, jinja template text or None, got "
                         f"{type(template).__name__}")
    return template


class RequestIntake:
    """Validates prompts and SamplingParams and builds the Sequences the engine queues.

    runner: the ModelRunner, whose (possibly fused) params the prompt-logprobs passes read;
    max_logprobs: the engine's logprobs limit; the tokenizer and chat template may be None."""

    def __init__(self, cfg: ModelConfig, spec: SpecConfig | None, scheduler: Scheduler, runner,
                 *, tokenizer, chat_template, max_logprobs: int):
        self.cfg, self.spec, self.scheduler, self.runner = cfg, spec, scheduler, runner
        self.tokenizer, self.chat_template, self.max_logprobs = tokenizer, chat_template, max_logprobs
        self._grammars = None       # structured.compiler.GrammarCache, on the first grammar

    def new_requests(self, prompts: list, sampling_params, first_id: int, *,
                     single: bool = False, samples: bool = False):
        """Validated Sequences with ids from `first_id` on; nothing is queued or reserved (the
        caller commits the ids), so an error here changes nothing. Errors name the prompt's
        position in the call (single: add_request's one prompt).
        samples: expand SamplingParams.n into n requests per prompt, sample j seeded with
        (seed + j) mod 2**32 when the request has a seed (as vLLM derives them; unseeded ones
        get the engine's per-request keys, distinct by request id), and return (seqs, the
        prompt index of each); without it n > 1 is refused."""
        sps = validate_sampling_params(
            sampling_params, len(prompts), vocab_size=self.cfg.vocab_size,
            num_speculative_tokens=self.spec.num_speculative_tokens if self.spec else 0,
            max_logprobs=self.max_logprobs, caller="LLM")
        seqs, prompt_of = [], []
        shared = sampling_params is None or isinstance(sampling_params, SamplingParams)
        for i, (p, sp) in enumerate(zip(prompts, sps)):
            where = "sampling_params" if shared else f"sampling_params[{i}]"
            if sp.stop and self.tokenizer is None:
                raise ValueError(f"{where}: stop={list(sp.stop)!r} (prompt {i}), but the LLM has "
                                 "no tokenizer to find stop strings in the text; pass "
                                 "LLM(..., tokenizer=) or use stop_token_ids")
            if sp.structured_output is not None:
                self._check_structured(where, i)
            if sp.n > 1 and not samples:
                raise ValueError(f"{where}: n={sp.n} (prompt {i}): several samples per prompt "
                                 "need LLM.generate or LLM.generate_stream (add_request and "
                                 "DataParallelLLM run one completion per request); expected n=1")
            ids = self.encode(p, i)
            for j in range(sp.n):
                spj = sp if sp.n == 1 else dataclasses.replace(
                    sp, n=1, seed=None if sp.seed is None else (sp.seed + j) % 2**32)
                seq = Sequence(ids, sampling_params=spj, seq_id=first_id + len(seqs))
                seq.sample_index = j
                self.scheduler.check(seq, "the request" if single else f"prompt {i}")
                seq.logprobs = TokenLogprobs(sp.logprobs) if sp.logprobs is not None else None
                if sp.stop:
                    from mtpjax.serve.stop_strings import TokenStopChecker
                    seq.stop_checker = TokenStopChecker(self.tokenizer.decode,
                                                        seq.prompt_token_ids, sp.stop,
                                                        sp.include_stop_str_in_output)
                if sp.structured_output is not None:
                    seq.grammar = self._request_grammar(sp.structured_output, where, i)
                seqs.append(seq)
                prompt_of.append(i)
        for seq in seqs:         # all valid: dispatch the extra prompt passes (asynchronous)
            sp = seq.sampling_params
            if sp.prompt_logprobs is not None:
                seq.prompt_lp = PromptLogprobs(self.runner.params, self.cfg,
                                               list(seq.prompt_token_ids), sp, self.max_logprobs)
        return (seqs, prompt_of) if samples else seqs

    def encode(self, prompt, i: int) -> list[int]:
        """Prompt i (a string, chat messages, a list of ids, a 1-D integer array) as a list of
        valid ids."""
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict)
                                                                for m in prompt):
            prompt = self._encode_chat(prompt, i)
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("got a string prompt but the LLM has no tokenizer")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            for j, t in enumerate(prompt):
                if not is_int(t):
                    raise ValueError(f"prompt {i}: token ids must be ints, got {t!r} "
                                     f"({type(t).__name__}) at position {j}")
            ids = [int(t) for t in prompt]
        elif hasattr(prompt, "__array__"):
            arr = np.asarray(prompt)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise ValueError(f"prompt {i} must be a 1-D sequence of integer token ids, got an "
                                 f"array of shape {arr.shape} and dtype {arr.dtype}")
            ids = arr.tolist()
        else:
            raise ValueError(f"prompt {i} must be a list of token ids or a string, got "
                             f"{type(prompt).__name__}")
        if not ids:
            raise ValueError(f"empty prompt (prompt {i}): every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size}) "
                             f"(prompt {i})")
        return ids

    def _encode_chat(self, messages, i: int) -> list[int]:
        if self.tokenizer is None or self.chat_template is None:
            raise ValueError(f"prompt {i} is a list of chat messages, but the LLM has no "
                             f"{'tokenizer' if self.tokenizer is None else 'chat_template'} "
                             "(LLM(..., tokenizer=, chat_template=) or LLM.from_pretrained)")
        for j, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"prompt {i}, message {j}: expected {{'role': str, 'content': "
                                 f"str}}, got {m!r}")
        text = self.chat_template.render([dict(m) for m in messages])
        encode = getattr(self.tokenizer, "encode_chat", None) or self.tokenizer.encode
        return encode(text)

    def _check_structured(self, where: str, i: int) -> None:
        """A request with structured output needs a tokenizer (the grammar is over text) and an
        eos token (where the grammar ends)."""
        if self.tokenizer is None or self.scheduler.eos_token_id is None:
            missing = "tokenizer" if self.tokenizer is None else "eos_token_id"
            raise ValueError(f"{where}: structured_output (prompt {i}) needs the LLM's "
                             f"{missing}: the grammar is matched on the tokenizer's text and "
                             f"the completion ends with the eos token; use "
                             f"LLM.from_pretrained or pass LLM(..., tokenizer=, eos_token_id=)")

    def _request_grammar(self, spec, where: str, i: int):
        """A fresh matcher of the spec's grammar (compiled once per distinct spec)."""
        from mtpjax.structured.compiler import GrammarCache
        from mtpjax.structured.matcher import RequestGrammar
        stops = [self.scheduler.eos_token_id]
        if self._grammars is None:
            self._grammars = GrammarCache(self.tokenizer, self.cfg.vocab_size, stops)
        try:
            compiled = self._grammars.compile(spec)
        except ValueError as e:
            raise ValueError(f"{where} (prompt {i}): {e}") from None
        return RequestGrammar(compiled, self.cfg.vocab_size, stops)
