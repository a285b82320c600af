"""Families "llama", "qwen2", "qwen3": dense GQA models, MTP modules in DeepSeek's layout.

They differ only in two attention details: Qwen2 adds q/k/v biases by default
(`attention_bias` absent means True), Qwen3 always has per-head q/k RMSNorms. Everything else
is the shared Llama-style config.json read by `ModelConfig.from_hf`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from mtpjax.config import FLAG, _hf_value
from mtpjax.models.registry import Family, register_family


def _read_llama(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    return {}


def _read_qwen2(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    return {"qkv_bias": functools.partial(_hf_value, config)("attention_bias", FLAG, True)}


def _read_qwen3(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    return {"qk_norm": True}


def _write_nothing(cfg, d: dict[str, Any]) -> None:
    return None       # attention_bias (qkv_bias) is one of the shared keys


LLAMA = register_family(Family("llama", {"llama": "LlamaForCausalLM"}, "deepseek",
                               _read_llama, _write_nothing))
QWEN2 = register_family(Family("qwen2", {"qwen2": "Qwen2ForCausalLM"}, "deepseek",
                               _read_qwen2, _write_nothing))
QWEN3 = register_family(Family("qwen3", {"qwen3": "Qwen3ForCausalLM"}, "deepseek",
                               _read_qwen3, _write_nothing))
