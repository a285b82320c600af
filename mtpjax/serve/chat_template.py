"""Chat templates: a list of chat messages -> the prompt text the checkpoint was trained on.

The template is the checkpoint's own, found as transformers finds it: `chat_template.jinja` in
the model folder, else `chat_template` in `tokenizer_config.json` (a string, or a list of
{"name", "template"} of which "default" is used). It is rendered as transformers'
`apply_chat_template` renders it: a sandboxed jinja2 environment with trim_blocks and
lstrip_blocks, the loop-control extension, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII characters, and the tokenizer's special tokens (bos_token, eos_token, ...) as
variables. A folder with neither gets DEFAULT_CHAT_TEMPLATE (documented in docs/serving.md).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Callable

# Used when the checkpoint has no template: "role: content" blocks and an "assistant:" cue. It
# only makes a chat readable to a base model; a model trained on a chat format needs its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template could not be read or rendered (the message says which and why)."""


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (it marks assistant tokens for
        training masks); for generation the body is rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """source: the jinja template text; special_tokens: {"eos_token": "<|endoftext|>", ...};
    origin: where the template came from (for messages and /v1/models)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None,
                 origin: str = "given"):
        import jinja2
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template from {origin} does not parse: {e}") from None

    @classmethod
    def from_folder(cls, path: str) -> "ChatTemplate":
        """The model folder's template (see the module docstring), else the default one."""
        config, where = {}, os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(where):
            try:
                with open(where, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise ChatTemplateError(f"{where} cannot be read as JSON: {e}") from None
            if not isinstance(config, dict):
                raise ChatTemplateError(f"{where} must hold a JSON object, got "
                                        f"{type(config).__name__}")
        special = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return cls(f.read(), special, jinja_file)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
            if source is None:
                raise ChatTemplateError(f"{where}: chat_template is a list without a 'default' "
                                        f"entry (names: {sorted(map(str, named))})")
        if source is None:
            return cls(DEFAULT_CHAT_TEMPLATE, special, "the default template (none in the folder)")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{where}: chat_template must be a string or a list of "
                                    f"{{name, template}}, got {type(source).__name__}")
        return cls(source, special, f"{where} (chat_template)")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """messages: [{"role": str, "content": str}, ...] -> the prompt text. Template errors
        (including its own raise_exception) raise ChatTemplateError."""
        import jinja2
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.origin}) refused the messages: "
                                    f"{e}") from None


def chat_encoder(path: str, fallback: Callable[[str], list[int]] | None = None
                 ) -> Callable[[str], list[int]] | None:
    """text -> ids for a rendered chat: the folder's tokenizer.json without its post-processor's
    special tokens (`add_special_tokens=False`, as transformers' apply_chat_template encodes),
    since the template writes them itself -- encoding with them would double a BOS.
    `fallback` (e.g. the checkpoint tokenizer's encode) when the folder has no tokenizer.json."""
    where = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(where):
        return fallback
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(where)
    return lambda text: tok.encode(text, add_special_tokens=False).ids
