"""What a request's structured output asks for (no xgrammar needed to build or check one)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of:

      json_schema  a JSON schema (a dict, or its JSON text): the output is one JSON value that
                   validates against it (vLLM's guided_json; OpenAI's response_format
                   {"type": "json_schema"})
      regex        a regular expression the whole output matches (vLLM's guided_regex)
      grammar      an EBNF grammar in xgrammar's GBNF dialect, rule `root` (vLLM's
                   guided_grammar)
      json_object  True: any JSON object (OpenAI's response_format {"type": "json_object"})

    The output ends with the model's eos token once the grammar is complete (the eos token is
    allowed only where the grammar may end). A dict schema is stored as its JSON text, so equal
    specs are equal (and hash equal: one compile per distinct spec)."""

    json_schema: Any = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutput: json_object must be a bool, got "
                             f"json_object={self.json_object!r}")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of json_schema, regex, grammar, "
                             f"json_object=True; got {given or 'none'}")
        schema = self.json_schema
        if schema is not None:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"StructuredOutput: json_schema is not valid JSON text "
                                     f"({e}); expected a JSON schema (dict or JSON text)") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutput: json_schema must be a JSON schema (an object, "
                                 f"as a dict or JSON text), got {type(schema).__name__}")
            # key order kept: properties are generated in the schema's order
            object.__setattr__(self, "json_schema", json.dumps(schema))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutput: {name} must be a non-empty string, got "
                                 f"{name}={v!r}")

    @property
    def kind(self) -> str:
        """"json_schema", "regex", "grammar" or "json_object"."""
        for name in ("json_schema", "regex", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @classmethod
    def from_response_format(cls, response_format: dict | None) -> "StructuredOutput | None":
        """OpenAI's response_format: {"type": "text"} (None), {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}."""
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ValueError(f"response_format must be an object, got {response_format!r}")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            inner = response_format.get("json_schema")
            if not isinstance(inner, dict) or "schema" not in inner:
                raise ValueError("response_format json_schema must be an object with a 'schema' "
                                 f"field, got json_schema={inner!r}")
            return cls(json_schema=inner["schema"])
        raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                         f"got type={kind!r}")
