"""Loading a Hugging Face model directory (config.json + *.safetensors [+ tokenizer.json])."""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp

from mtpjax.checkpoint.hf_keys import from_hf_state_dict
from mtpjax.config import ModelConfig


def load_hf_dir(path: str, dtype=jnp.float32, **config_overrides):
    """-> (ModelConfig, params). Reads every *.safetensors file of the directory."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{path!r} has no config.json; expected a Hugging Face model directory")
    with open(cfg_path) as f:
        cfg = ModelConfig.from_hf(json.load(f), **config_overrides)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"{path!r} has no *.safetensors files")
    from safetensors.numpy import load_file
    tensors = {}
    for fname in files:
        for name, arr in load_file(fname).items():
            if name in tensors:
                raise ValueError(f"tensor {name} appears in two files (second: {fname})")
            tensors[name] = arr
    return cfg, from_hf_state_dict(cfg, tensors, dtype)


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` with encode(str) -> ids / decode(ids) -> str, or None."""
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        return None
    from tokenizers import Tokenizer

    class _Wrapped:
        def __init__(self, t):
            self._t = t

        def encode(self, text):
            return self._t.encode(text).ids

        def decode(self, ids):
            return self._t.decode(ids)

    return _Wrapped(Tokenizer.from_file(tok_path))
