"""Model assets shipped with mtpjax.

`tiny_model_path()` is a small trained MiMo-style code model (target + 1 MTP module, byte-level
BPE tokenizer), written by `python -m mtpjax.train.tiny`; see its README.md.
"""

from __future__ import annotations

import json
import os

TINY_MODEL = "tiny_code_mimo"


def tiny_model_path() -> str:
    """The folder of the shipped tiny model (a Hugging Face folder: `LLM.from_pretrained` it)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), TINY_MODEL)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path} has no config.json: the shipped model is missing from this install; "
            "rebuild it with `python -m mtpjax.train.tiny --out " + path + " --seconds 180`")
    return path


def tiny_model_prompts(path: str | None = None) -> list[str]:
    """Held-out Python snippets (from files the model was not trained on): the `prompts.json`
    that `mtpjax.train.tiny` writes into the model folder (default: the shipped model)."""
    with open(os.path.join(path or tiny_model_path(), "prompts.json")) as f:
        return [p["text"] for p in json.load(f)]
