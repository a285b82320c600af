"""OpenAI request bodies -> validated engine requests; errors name the offending field.

Bodies are checked by hand rather than by pydantic models: every error is a 400 whose message
and `param` name the field and the bad value (`RequestError`), in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}), and unknown fields are refused, so a typo in
`extra_body` (e.g. "num_speculative_token") is reported instead of silently ignored.

MTP options per request (through the openai client's `extra_body`):
    num_speculative_tokens: 0..K drafts per verify step for this request (0: no drafts);
    acceptance: must equal the server's acceptance rule (`--acceptance`): the engine verifies
        every request of a batch with one rule, fixed when it starts.
Other extensions: top_k, min_p, stop_token_ids, return_token_ids (add the token ids to the
answer).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from mtpjax.config import SamplingParams

COMPLETIONS_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options",
                 "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                 "logprobs", "top_logprobs", "top_k", "stop_token_ids", "num_speculative_tokens",
                 "acceptance", "return_token_ids", "metadata", "store", "service_tier",
                 "min_p", "repetition_penalty", "response_format"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "tools", "tool_choice",
                               "parallel_tool_calls"}


class RequestError(Exception):
    """An HTTP error for the client: status, message, the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (message, param, status,
                                                                        type_, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ServeContext:
    """What request checking needs to know about the served model and engine."""
    model_name: str
    vocab_size: int
    num_speculative_tokens: int              # the engine's K (0: MTP off)
    acceptance: str | None                   # the engine's acceptance rule (None: MTP off)
    max_completion_tokens: Callable[[int], int]   # prompt length -> most completion tokens
    encode: Callable[[str], list[int]] | None     # the tokenizer (None: token-id prompts only)
    chat_template: Any = None                # serve.chat_template.ChatTemplate, None: no chat
    # a rendered chat -> ids, without the tokenizer's own special tokens (chat_encoder); None:
    # `encode`
    encode_chat: Callable[[str], list[int]] | None = None


@dataclasses.dataclass
class GenerationRequest:
    prompt_ids: list[int]
    sampling_params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _get(body: dict, name: str, check, want: str, default=None):
    """body[name] if absent/null -> default, if check(value) -> value, else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise RequestError(f"{name} must be {want}, got {name}={value!r}", name)
    return value


def _unknown_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (this server accepts: "
                           f"{', '.join(sorted(allowed))})", unknown[0])


def _unsupported(body: dict, name: str, ok: Callable[[Any], bool], why: str) -> None:
    value = body.get(name)
    if value is not None and not ok(value):
        raise RequestError(f"{name}={value!r} is not supported: {why}", name)


def _common(body: dict, ctx: ServeContext, prompt_ids: list[int], prompt_field: str,
            max_tokens_field: str, default_max_tokens: int | None) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string (the served model: {ctx.model_name!r}), got "
                           f"model={model!r}", "model")
    if model != ctx.model_name:
        raise RequestError(f"model {model!r} does not exist; this server serves "
                           f"{ctx.model_name!r}", "model", status=404, code="model_not_found")
    _get(body, "n", lambda v: v == 1 and _is_int(v), "1 (one choice per request)")
    _unsupported(body, "logprobs", lambda v: v is False, "no logprobs over HTTP yet")
    _unsupported(body, "top_logprobs", lambda v: v == 0, "no logprobs over HTTP yet")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, dict), "an object", {})
    if opts and not stream:
        raise RequestError("stream_options is only allowed with stream=true", "stream_options")
    extra = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if extra:
        raise RequestError(f"unknown field stream_options.{extra[0]}", "stream_options")
    include_usage = opts.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise RequestError(f"stream_options.include_usage must be true or false, got "
                           f"{include_usage!r}", "stream_options")

    temperature = _get(body, "temperature", lambda v: _is_number(v) and 0 <= v <= 2,
                       "a number in [0, 2]", 1.0)
    top_p = _get(body, "top_p", lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]", 1.0)
    top_k = _get(body, "top_k", lambda v: _is_int(v) and v >= -1,
                 "an int >= 0 (0 or -1: off)", 0)
    min_p = _get(body, "min_p", lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]",
                 0.0)
    # {"token id": bias}: JSON keys are strings; SamplingParams checks ids, biases and count
    logit_bias = _get(body, "logit_bias", lambda v: isinstance(v, dict),
                      "an object {token id: bias}")
    # vLLM's penalties (repetition_penalty is vLLM's extra_body field)
    presence = _get(body, "presence_penalty", lambda v: _is_number(v) and -2 <= v <= 2,
                    "a number in [-2, 2]", 0.0)
    frequency = _get(body, "frequency_penalty", lambda v: _is_number(v) and -2 <= v <= 2,
                     "a number in [-2, 2]", 0.0)
    repetition = _get(body, "repetition_penalty", lambda v: _is_number(v) and v > 0,
                      "a number > 0", 1.0)
    seed = _get(body, "seed", lambda v: _is_int(v) and -2**63 <= v < 2**64, "an int")
    stops = body.get("stop")
    if stops is None:
        stops = ()
    elif isinstance(stops, str):
        stops = (stops,)
    elif isinstance(stops, list) and all(isinstance(s, str) for s in stops):
        stops = tuple(stops)
    else:
        raise RequestError(f"stop must be a string or a list of strings, got stop={stops!r}",
                           "stop")
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise RequestError(f"stop must hold 1..{MAX_STOP_STRINGS} non-empty strings, got "
                           f"stop={list(stops)!r}", "stop")
    stop_ids = _get(body, "stop_token_ids", lambda v: isinstance(v, list) and all(
        _is_int(t) and 0 <= t < ctx.vocab_size for t in v),
        f"a list of token ids in [0, {ctx.vocab_size})", [])
    return_ids = _get(body, "return_token_ids", lambda v: isinstance(v, bool), "true or false",
                      False)
    # {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}
    from mtpjax.structured.spec import StructuredOutput
    try:
        structured = StructuredOutput.from_response_format(body.get("response_format"))
    except ValueError as e:
        raise RequestError(str(e), "response_format") from None

    K = ctx.num_speculative_tokens
    k = _get(body, "num_speculative_tokens", lambda v: _is_int(v) and 0 <= v <= K,
             f"an int in [0, {K}] (the server's --num-speculative-tokens)" if K else
             "0 (this server runs without MTP: --num-speculative-tokens 0)")
    acceptance = _get(body, "acceptance", lambda v: isinstance(v, str), "a string")
    if acceptance is not None and acceptance != ctx.acceptance:
        raise RequestError(
            f"acceptance={acceptance!r} differs from the server's acceptance rule "
            f"{ctx.acceptance!r}: one rule verifies every request of a batch, fixed at start "
            f"(`mtpjax serve --acceptance`)" if ctx.acceptance else
            f"acceptance={acceptance!r} needs MTP, which this server runs without",
            "acceptance")

    max_tokens = _get(body, max_tokens_field, lambda v: _is_int(v) and v >= 1,
                      "a positive int")
    if max_tokens_field == "max_completion_tokens" and max_tokens is None:
        max_tokens = _get(body, "max_tokens", lambda v: _is_int(v) and v >= 1, "a positive int")
        max_tokens_field = "max_tokens"
    limit = ctx.max_completion_tokens(len(prompt_ids))
    if limit < 1:
        raise RequestError(f"{prompt_field} is too long: {len(prompt_ids)} tokens leave no room "
                           f"for a completion (the server fits {len(prompt_ids) + limit} tokens "
                           f"per request)", prompt_field)
    if max_tokens is None:
        max_tokens = limit if default_max_tokens is None else min(default_max_tokens, limit)
    elif max_tokens > limit:
        raise RequestError(f"{max_tokens_field}={max_tokens} is too large: the prompt has "
                           f"{len(prompt_ids)} tokens and the server fits at most {limit} "
                           f"completion tokens after it", max_tokens_field)
    try:
        sp = SamplingParams(temperature=float(temperature), top_k=max(int(top_k), 0),
                            top_p=float(top_p), max_tokens=max_tokens,
                            stop_token_ids=tuple(stop_ids), seed=seed,
                            num_speculative_tokens=k if K else None, min_p=float(min_p),
                            logit_bias=logit_bias, presence_penalty=float(presence),
                            frequency_penalty=float(frequency),
                            repetition_penalty=float(repetition),
                            structured_output=structured)
    except ValueError as e:           # SamplingParams' messages start with the field's name
        word = str(e).split(" ", 1)[0]
        raise RequestError(str(e), word if word in body else None) from None
    bad = [t for t, _ in sp.logit_bias or () if t >= ctx.vocab_size]
    if bad:
        raise RequestError(f"logit_bias has token id {bad[0]}, outside the vocabulary "
                           f"[0, {ctx.vocab_size})", "logit_bias")
    return GenerationRequest(prompt_ids, sp, stops, stream, include_usage, return_ids)


def _encode(ctx: ServeContext, text: str, field: str) -> list[int]:
    if ctx.encode is None:
        raise RequestError(f"{field} is text but the model has no tokenizer.json: send token "
                           "ids", field)
    return list(ctx.encode(text))


def parse_completion(body: Any, ctx: ServeContext) -> GenerationRequest:
    """A /v1/completions body. prompt: a string, a list of token ids, or a one-element list of
    either (one prompt per request)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _unknown_fields(body, COMPLETION_FIELDS)
    _unsupported(body, "echo", lambda v: v is False, "the prompt is not echoed")
    _unsupported(body, "suffix", lambda v: v == "", "no insertion (suffix)")
    _unsupported(body, "best_of", lambda v: v == 1, "one candidate per request")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]              # the openai client's batch form, one prompt
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty: give at least one character or token", "prompt")
        ids = _encode(ctx, prompt, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < ctx.vocab_size]
        if bad:
            raise RequestError(f"prompt holds token id {bad[0]}, outside the vocabulary "
                               f"[0, {ctx.vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise RequestError(f"prompt must be a non-empty string or list of token ids (one prompt "
                           f"per request), got prompt={_short(prompt)}", "prompt")
    if not ids:
        raise RequestError("prompt encodes to no tokens", "prompt")
    return _common(body, ctx, ids, "prompt", "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):          # [{"type": "text", "text": ...}, ...]
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise RequestError(f"messages[{i}].content[{j}] must be a text part "
                                   f"{{'type': 'text', 'text': ...}}, got {_short(part)}",
                                   "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts, got "
                       f"{_short(content)}", "messages")


def render_messages(body: dict, ctx: ServeContext) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"messages must be a non-empty list of {{role, content}} objects, got "
                           f"messages={_short(messages)}", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role', got "
                               f"{_short(m)}", "messages")
        clean.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
    from mtpjax.serve.chat_template import ChatTemplateError
    try:
        return ctx.chat_template.render(clean, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise RequestError(str(e), "messages") from None


def parse_chat(body: Any, ctx: ServeContext) -> GenerationRequest:
    """A /v1/chat/completions body; the messages are rendered with the chat template."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _unknown_fields(body, CHAT_FIELDS)
    _unsupported(body, "tools", lambda v: v == [], "no tool calls")
    _unsupported(body, "tool_choice", lambda v: v == "none", "no tool calls")
    if ctx.chat_template is None:
        raise RequestError("this server has no chat template (no tokenizer)", "messages")
    text = render_messages(body, ctx)
    ids = list(ctx.encode_chat(text)) if ctx.encode_chat else _encode(ctx, text, "messages")
    if not ids:
        raise RequestError("messages render to an empty prompt", "messages")
    return _common(body, ctx, ids, "messages", "max_completion_tokens", None)


def _short(value, n: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= n else r[:n] + "..."
