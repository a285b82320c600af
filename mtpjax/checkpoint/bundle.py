"""What a checkpoint folder holds besides its arrays, and the loaded result.

`Assets` are the files that travel with the weights through every conversion: the original
`config.json` (as a dict, so keys mtpjax does not model - bos/eos ids, architectures - survive an
HF -> Orbax -> HF round trip) and the tokenizer / generation files, copied byte for byte.
`Checkpoint` is what the loaders return: config, params and assets, with the tokenizer and the
eos id derived from the assets.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from mtpjax.checkpoint.errors import CheckpointError, json_object
from mtpjax.config import ModelConfig
from mtpjax.model.params import param_specs, tree_items

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Copied verbatim between formats when present.
ASSET_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
               "chat_template.jinja", GENERATION_CONFIG_FILE)


class Tokenizer:
    """encode(str) -> ids, decode(ids) -> str over a `tokenizers` tokenizer.json (no network)."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer as _HFTokenizer
        self._tok = _HFTokenizer.from_str(tokenizer_json)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))


@dataclasses.dataclass(frozen=True)
class Assets:
    hf_config: dict | None = None                       # config.json as read
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dir(cls, path: str, hf_config: dict | None = None) -> "Assets":
        """The folder's asset files; generation_config.json is checked here (when present), so
        a damaged one fails at load, naming its path."""
        files = {}
        for name in ASSET_FILES:
            p = os.path.join(path, name)
            if os.path.isfile(p):
                with open(p, "rb") as f:
                    files[name] = f.read()
        if GENERATION_CONFIG_FILE in files:
            where = os.path.join(path, GENERATION_CONFIG_FILE)
            _eos_id(json_object(files[GENERATION_CONFIG_FILE], where), where)
        return cls(hf_config, files)

    def write(self, path: str) -> None:
        """The tokenizer / generation files (config.json is the writer's business)."""
        for name, data in self.files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)

    def tokenizer(self) -> Tokenizer | None:
        data = self.files.get(TOKENIZER_FILE)
        if data is None:
            return None
        try:
            return Tokenizer(data.decode())
        except Exception as e:   # tokenizers raises its own Exception type
            raise CheckpointError(f"{TOKENIZER_FILE} cannot be read by `tokenizers`: {e}") from None

    def eos_token_id(self) -> int | None:
        """generation_config.json's eos_token_id, else config.json's; the first of a list."""
        sources: list[tuple[Any, str]] = []
        if GENERATION_CONFIG_FILE in self.files:
            sources.append((json_object(self.files[GENERATION_CONFIG_FILE],
                                         GENERATION_CONFIG_FILE), GENERATION_CONFIG_FILE))
        sources.append((self.hf_config or {}, "config.json"))
        for src, where in sources:
            eos = _eos_id(src, where)
            if eos is not None:
                return eos
        return None


def _eos_id(config: dict, where: str) -> int | None:
    """A config's eos_token_id: a token id, or a list of them (the first is used); None if
    absent, null or an empty list."""
    eos = config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise CheckpointError(f"{where}: eos_token_id must be a token id (an int >= 0) or a "
                                  f"list of them, got {json.dumps(eos)}")
    return ids[0] if ids else None


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    cfg: ModelConfig
    params: dict
    assets: Assets = dataclasses.field(default_factory=Assets)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer | None:
        """None when the folder has no tokenizer.json (token ids only)."""
        return self.assets.tokenizer()

    @property
    def eos_token_id(self) -> int | None:
        return self.assets.eos_token_id()


def flat_items(tree):
    """("a/0/b", leaf) of a param tree, in order."""
    for p, leaf in tree_items(tree):
        yield "/".join(map(str, p)), leaf


def check_params(params, cfg: ModelConfig) -> None:
    """Raises unless the tree has exactly the leaves and shapes `param_specs(cfg)` declares."""
    got = {p: tuple(a.shape) for p, a in flat_items(params)}
    want = {p: tuple(s.shape) for p, s in flat_items(param_specs(cfg))}
    if got != want:
        bad = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
        raise CheckpointError(
            "params do not match the config: " + ", ".join(
                f"{k}: {list(got[k]) if k in got else 'absent'} (expected "
                f"{list(want[k]) if k in want else 'no such leaf'})" for k in bad[:10]))
