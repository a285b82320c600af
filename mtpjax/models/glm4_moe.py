"""Family "glm4_moe" (GLM-4.5 / GLM-4.5-Air, transformers' `Glm4MoeForCausalLM`).

GQA attention with q/k/v biases (`attention_bias`), optional per-head q/k RMSNorm
(`use_qk_norm`, the same norm as Qwen3's) and partial rotary: RoPE turns only the first
head_dim * `partial_rotary_factor` dims of each head (rotate_half within them). The FFN is
DeepSeek-V3's MoE: sigmoid scores + `e_score_correction_bias` steering a group-limited choice
(`n_group` / `topk_group`), a shared expert, dense first `first_k_dense_replace` layers; the
config.json keys are DeepSeek's, without `scoring_func` / `topk_method` (GLM has one routing
kind, ROUTING).
MTP modules (`num_nextn_predict_layers`) sit at `model.layers.{num_layers + k}` in DeepSeek's
layout (enorm, hnorm, eh_proj, shared_head.norm, copies of embed_tokens and shared_head.head),
as vLLM's `glm4_moe_mtp.py` reads them; transformers' model loads none of them.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from mtpjax.config import FLAG, NUMBER, _hf_value
from mtpjax.models.deepseek import read_moe_keys, write_moe_keys
from mtpjax.models.registry import Family, register_family

ROUTING = "sigmoid_group_limited_bias"
# transformers' Glm4MoeConfig defaults, for keys a config.json leaves out
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def _read(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    get = functools.partial(_hf_value, config)
    if get("mlp_bias", FLAG, False):
        raise ValueError("mlp_bias=True is not supported (GLM-4.5 ships none)")
    # transformers >= 5 nests it into rope_parameters; older config.json files keep it on top
    factor = get("partial_rotary_factor", NUMBER, DEFAULT_PARTIAL_ROTARY_FACTOR)
    rope_params = config.get("rope_parameters")
    if isinstance(rope_params, Mapping):
        factor = _hf_value(rope_params, "partial_rotary_factor", NUMBER, factor,
                           "rope_parameters.partial_rotary_factor")
    fields = dict(partial_rotary_factor=float(factor), qk_norm=get("use_qk_norm", FLAG, False))
    moe = read_moe_keys(config, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True)
    if moe is not None:
        fields.update(ffn_kind="moe", moe={**moe, "routing": ROUTING})
    return fields


def _write(cfg, d: dict[str, Any]) -> None:
    d.update(use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor)
    write_moe_keys(cfg, d)


def _check(cfg) -> None:
    if cfg.attention_kind != "gqa":
        raise ValueError(f"a glm4_moe model has attention_kind 'gqa', got {cfg.attention_kind!r}")
    if cfg.ffn_kind == "moe" and cfg.moe.routing != ROUTING:
        raise ValueError(f"a glm4_moe model routes by {ROUTING!r}, got moe.routing "
                         f"{cfg.moe.routing!r}")


GLM4_MOE = register_family(Family("glm4_moe", {"glm4_moe": "Glm4MoeForCausalLM"}, "deepseek",
                                  _read, _write, _check))
