"""Reading `ModelConfig` dicts saved in the flat format, before MLA and MoE had sub-configs.

Such a dict (the `model_config` of an older mtpjax checkpoint) holds every MLA and MoE field at
top level, whatever the layer kinds, and names the routing rule by DeepSeek's
(`scoring_func`, `topk_method`) pair. `nest_flat_fields` moves the fields of the kinds in use
into `mla` / `moe` (the pair mapped to a routing kind) and drops the others, which only held
their defaults.
"""

from __future__ import annotations

from typing import Any, Mapping

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "rope_interleave")
MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts",
              "moe_intermediate_size", "first_k_dense_replace", "n_group", "topk_group",
              "routed_scaling_factor", "norm_topk_prob")
ROUTING_FIELDS = ("scoring_func", "topk_method")
# what a flat dict meant when it left the pair out (the flat ModelConfig's defaults)
FLAT_ROUTING_DEFAULTS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def is_flat(d: Mapping[str, Any]) -> bool:
    """Does `d` hold any MLA / MoE field at top level?"""
    return any(k in d for k in MLA_FIELDS + MOE_FIELDS + ROUTING_FIELDS)


def nest_flat_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """A flat `ModelConfig` dict -> the nested one `ModelConfig.from_dict` reads."""
    from mtpjax.models.deepseek import routing_from_deepseek   # (lazy: the families import config)
    flat = MLA_FIELDS + MOE_FIELDS + ROUTING_FIELDS
    for name in ("mla", "moe"):
        if d.get(name) is not None:
            raise ValueError(f"a ModelConfig dict has both a {name!r} sub-config and flat "
                             f"MLA / MoE keys ({sorted(k for k in d if k in flat)}); expected "
                             "one format")
    out = {k: v for k, v in d.items() if k not in flat}
    if d.get("attention_kind") == "mla":
        out["mla"] = {k: d[k] for k in MLA_FIELDS if k in d}
    if d.get("ffn_kind") == "moe":
        moe = {k: d[k] for k in MOE_FIELDS if k in d}
        pair = {**FLAT_ROUTING_DEFAULTS, **{k: d[k] for k in ROUTING_FIELDS if k in d}}
        moe["routing"] = routing_from_deepseek(pair["scoring_func"], pair["topk_method"])
        out["moe"] = moe
    return out
