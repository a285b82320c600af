"""Families "deepseek_v2", "deepseek_v3", "kimi_k2": MLA attention + DeepSeek MoE, MTP modules
at `model.layers.{num_layers + k}` (the "deepseek" layout).

V2 routes by softmax (greedy or group-limited greedy), V3 / Kimi-K2 by sigmoid with the
learnt correction bias (`noaux_tc`); config.json names the rule by (`scoring_func`,
`topk_method`), which this module translates to and from a routing kind (`MoEConfig.routing`,
model/moe_routing.py). V2 rotates interleaved pairs; V3 / K2 say so in `rope_interleave`.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from mtpjax.config import COUNT, FLAG, NUMBER, POSITIVE, TEXT, _hf_value
from mtpjax.models.registry import Family, register_family

# config.json keys written under the sub-configs' own names (MLAConfig, MoEConfig)
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
            "first_k_dense_replace", "n_group", "topk_group", "routed_scaling_factor",
            "norm_topk_prob")
# config.json's (scoring_func, topk_method) -> the routing kind it names (model/moe_routing.py)
DEEPSEEK_ROUTING = {
    ("sigmoid", "noaux_tc"): "sigmoid_group_limited_bias",         # V3, Kimi-K2
    ("softmax", "greedy"): "softmax_greedy",                       # V2
    ("softmax", "group_limited_greedy"): "softmax_group_limited",  # V2
}


def routing_from_deepseek(scoring_func: Any, topk_method: Any) -> str:
    """The routing kind DeepSeek's (scoring_func, topk_method) names; ValueError naming both
    and the supported pairs otherwise."""
    pair = (scoring_func, topk_method)
    if not all(isinstance(v, str) for v in pair) or pair not in DEEPSEEK_ROUTING:
        raise ValueError(f"scoring_func {scoring_func!r} with topk_method {topk_method!r} names "
                         f"no MoE routing; supported (scoring_func, topk_method): "
                         f"{list(DEEPSEEK_ROUTING)}")
    return DEEPSEEK_ROUTING[pair]


def deepseek_routing_keys(routing: str) -> dict[str, str]:
    """{scoring_func, topk_method} spelling routing kind `routing` in a config.json."""
    for (scoring_func, topk_method), name in DEEPSEEK_ROUTING.items():
        if name == routing:
            return {"scoring_func": scoring_func, "topk_method": topk_method}
    raise ValueError(f"MoE routing {routing!r} has no DeepSeek config.json spelling (scoring_func, "
                     f"topk_method); routings that have one: {sorted(DEEPSEEK_ROUTING.values())}")


def read_moe_keys(config: Mapping[str, Any], *, n_shared_experts: int = 0,
                  first_k_dense_replace: int = 0,
                  norm_topk_prob: bool = False) -> dict[str, Any] | None:
    """The MoEConfig fields of a config.json in DeepSeek's names (also GLM-4.5's), all but
    `routing` (the family's to add); None when it has no routed experts (every layer dense).
    Keyword arguments: the family's defaults."""
    get = functools.partial(_hf_value, config)
    experts = get("n_routed_experts", COUNT, None)
    if experts is None:
        experts = get("num_experts", COUNT, 0)
    if not experts:
        return None
    return dict(
        n_routed_experts=experts,
        num_experts_per_tok=get("num_experts_per_tok", POSITIVE),
        n_shared_experts=get("n_shared_experts", COUNT, n_shared_experts),
        moe_intermediate_size=get("moe_intermediate_size", POSITIVE),
        first_k_dense_replace=get("first_k_dense_replace", COUNT, first_k_dense_replace),
        n_group=get("n_group", POSITIVE, 1), topk_group=get("topk_group", POSITIVE, 1),
        routed_scaling_factor=float(get("routed_scaling_factor", NUMBER, 1.0)),
        norm_topk_prob=get("norm_topk_prob", FLAG, norm_topk_prob),
    )


def write_moe_keys(cfg, d: dict[str, Any]) -> None:
    """MOE_KEYS of `cfg.moe` into config.json dict `d`; a dense model says n_routed_experts 0."""
    if cfg.ffn_kind == "moe":
        d.update({k: getattr(cfg.moe, k) for k in MOE_KEYS})
    else:
        d.update(n_routed_experts=0, first_k_dense_replace=cfg.num_layers)   # every layer dense


def _read(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """MLA + MoE fields of a DeepSeek-V2/V3 / Kimi-K2 config.json (their own names)."""
    v2 = model_type == "deepseek_v2"
    get = functools.partial(_hf_value, config)
    if get("attention_bias", FLAG, False):
        raise ValueError("attention_bias=True is not supported for MLA models "
                         "(DeepSeek ships none)")
    if get("mlp_bias", FLAG, False):
        raise ValueError("mlp_bias=True is not supported (DeepSeek ships none)")
    if config.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq {config['moe_layer_freq']!r} is not supported; "
                         "supported: 1 (every layer after first_k_dense_replace is MoE)")
    heads = get("num_attention_heads", POSITIVE)
    kv = get("num_key_value_heads", COUNT, 0) or heads
    if kv != heads:
        raise ValueError(f"num_key_value_heads {kv} != num_attention_heads {heads}: MLA has no "
                         "KV heads to group")
    rope_dim = get("qk_rope_head_dim", POSITIVE)
    mla = dict(
        q_lora_rank=get("q_lora_rank", POSITIVE, None), kv_lora_rank=get("kv_lora_rank", POSITIVE),
        qk_nope_head_dim=get("qk_nope_head_dim", POSITIVE), qk_rope_head_dim=rope_dim,
        v_head_dim=get("v_head_dim", POSITIVE),
        # V2 rotates interleaved pairs (complex multiply); V3/K2 say so in `rope_interleave`
        rope_interleave=True if v2 else get("rope_interleave", FLAG, True),
    )
    fields = dict(attention_kind="mla", head_dim=rope_dim, num_kv_heads=heads,
                  qkv_bias=False, qk_norm=False, mla=mla)
    moe = read_moe_keys(config)
    if moe is not None:
        moe["routing"] = routing_from_deepseek(
            get("scoring_func", TEXT, "softmax" if v2 else "sigmoid"),
            get("topk_method", TEXT, "greedy" if v2 else "noaux_tc"))
        fields.update(ffn_kind="moe", moe=moe)
    return fields


def _write(cfg, d: dict[str, Any]) -> None:
    if cfg.attention_kind == "mla":
        d.update({k: getattr(cfg.mla, k) for k in MLA_KEYS})
        if cfg.model_type != "deepseek_v2":
            d["rope_interleave"] = cfg.mla.rope_interleave
        write_moe_keys(cfg, d)
    elif cfg.ffn_kind == "moe":
        d.update({k: getattr(cfg.moe, k) for k in MOE_KEYS})
    if cfg.ffn_kind == "moe":
        d.update(deepseek_routing_keys(cfg.moe.routing))


DEEPSEEK = register_family(Family(
    "deepseek",
    {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
     "kimi_k2": "DeepseekV3ForCausalLM"},
    "deepseek", _read, _write))
