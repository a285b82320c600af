"""Compiling StructuredOutput specs with xgrammar, once per distinct spec and tokenizer.

xgrammar (the grammar library vLLM and SGLang use by default) was chosen over llguidance /
outlines-core because it does everything this needs in one maintained wheel: JSON schema, regex
and EBNF front ends, a packed int32 token bitmask per position (the layout the device unpacks,
bitmask.py), a matcher with unlimited `rollback` (speculative drafts are accepted, masked, then
rolled back) and tokenizer metadata for byte-level BPE vocabularies. It is an optional
dependency (`pip install "mtpjax[structured]"`); only a request that asks for structured output
imports it.
"""

from __future__ import annotations

import functools
import re

from mtpjax.structured.spec import StructuredOutput


def import_xgrammar():
    """The xgrammar module, or an ImportError saying how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured output needs the xgrammar package ({e}); install it with "
                          "pip install \"mtpjax[structured]\" (a machine without network needs "
                          "the xgrammar wheel and its dependencies copied with it)") from None
    return xgrammar


def _inner_tokenizer(tokenizer):
    """The `tokenizers.Tokenizer` behind the project's tokenizer objects (checkpoint
    bundle.Tokenizer, LLM's chat wrapper), or a transformers tokenizer as is."""
    for attr in ("_tokenizer", "_tok"):
        inner = getattr(tokenizer, attr, None)
        if inner is not None:
            return _inner_tokenizer(inner)
    return tokenizer


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar.TokenizerInfo of a tokenizer, with the MODEL's vocab_size (it may exceed the
    tokenizer's: ids past the tokenizer's vocabulary are never allowed) and the engine's stop
    ids (allowed only where the grammar may end)."""
    xgr = import_xgrammar()
    tok = _inner_tokenizer(tokenizer)
    if hasattr(tok, "get_vocab") and hasattr(tok, "to_str"):          # tokenizers.Tokenizer
        vocab = tok.get_vocab(with_added_tokens=True)
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        size = max(vocab_size, max(vocab.values()) + 1)
        encoded = [""] * size
        for text, i in vocab.items():
            encoded[i] = text
        return xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                 stop_token_ids=list(stop_token_ids),
                                 add_prefix_space=meta["add_prefix_space"])
    if hasattr(tok, "backend_tokenizer"):                              # transformers
        return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
    raise ValueError(f"structured output needs a Hugging Face tokenizer (tokenizer.json, as "
                     f"LLM.from_pretrained loads) to map the grammar onto tokens; got "
                     f"{type(tokenizer).__name__}")


class GrammarCache:
    """Compiled grammars of one engine (one tokenizer), one compile per distinct spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 1):
        xgr = import_xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.compile = functools.lru_cache(maxsize=256)(self._compile)

    def _compile(self, spec: StructuredOutput):
        """xgrammar.CompiledGrammar of a spec; a bad schema / regex / grammar is a ValueError
        naming the kind and xgrammar's reason."""
        c = self._compiler
        try:
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.json_schema, any_whitespace=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.regex)
            if spec.kind == "grammar":
                return c.compile_grammar(spec.grammar)
            # OpenAI's json_object: any JSON object (xgrammar's builtin JSON grammar would
            # also allow arrays and scalars)
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            value = getattr(spec, spec.kind)
            # xgrammar's messages start with "[time] source.cc:line: "
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e).strip()).replace("\n", " ")
            raise ValueError(f"structured_output {spec.kind} cannot be compiled: {why}; got "
                             f"{spec.kind}={str(value)[:200]!r}") from None
