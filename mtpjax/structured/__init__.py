"""Structured output: JSON schema, regex and EBNF grammars constrain a request's tokens.

`StructuredOutput` (spec.py) is what a request asks for (SamplingParams.structured_output);
`GrammarCache` (compiler.py) compiles each distinct spec once with xgrammar; `RequestGrammar`
(matcher.py) is one request's matcher on the host, which builds the step's per-position token
bitmasks along the drafts; `apply_token_bitmask` (bitmask.py) masks the logits on the device.
docs/structured_output.md describes how it stays lossless under speculative decoding.
"""

from mtpjax.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
