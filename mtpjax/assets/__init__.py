"""Model assets shipped with mtpjax.

`tiny_model_path()` is a small trained MiMo-style code model (target + 1 MTP module, byte-level
BPE tokenizer), written by `python -m mtpjax.train.tiny`; see its README.md.
`tiny_model_path(MTP3_MODEL)` is its sibling with 3 MTP modules (chain vs multi_layer drafting
can be compared on it), trained the same way on the same corpus.
"""

from __future__ import annotations

import json
import os

TINY_MODEL = "tiny_code_mimo"
MTP3_MODEL = "tiny_code_mtp3"
SHIPPED = (TINY_MODEL, MTP3_MODEL)


def tiny_model_path(name: str = TINY_MODEL) -> str:
    """The folder of a shipped tiny model (a Hugging Face folder: `LLM.from_pretrained` it);
    name: one of SHIPPED."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped model named {name!r}; shipped: {SHIPPED}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
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
