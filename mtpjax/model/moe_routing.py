"""MoE routing rules: how the router's logits pick each token's experts and their weights.

A rule is a kind of its own, named by `ModelConfig.moe_routing` and looked up here by the MoE
layer (`model/moe.py`); a family chooses it when it reads its config.json. Each rule is
(transformers' `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` / `Glm4MoeTopkRouter`):

- scores = sigmoid(logits) or softmax(logits) (float32);
- choice = scores, plus the learnt `e_score_correction_bias` when `biased` (the bias steers
  *selection*, never the weights);
- group limit (n_group > 1, when the rule has a `group_score`): rank the groups of experts by
  `group_score` of their choice scores, keep the best `topk_group` groups;
- the top `num_experts_per_tok` experts by choice among the kept groups;
- weights = their unbiased scores, normalized to sum 1 when `norm_topk_prob`, times
  `routed_scaling_factor`.

DeepSeek's config.json names a rule by the pair (`scoring_func`, `topk_method`); `deepseek`
below is that pair for each rule (ModelConfig stores the pair and derives the rule from it).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp


def _top2_sum(grouped: jax.Array) -> jax.Array:
    """[..., G, X/G] -> [..., G]: the sum of each group's two best scores (V3, GLM)."""
    return jax.lax.top_k(grouped, min(2, grouped.shape[-1]))[0].sum(-1)


def _group_max(grouped: jax.Array) -> jax.Array:
    """[..., G, X/G] -> [..., G]: each group's best score (V2's group_limited_greedy)."""
    return grouped.max(-1)


def _softmax(logits: jax.Array) -> jax.Array:
    return jax.nn.softmax(logits, axis=-1)


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    name: str
    score: Callable[[jax.Array], jax.Array]          # f32 logits [N, X] -> scores [N, X]
    biased: bool                                     # choice = scores + e_score_correction_bias
    group_score: Callable[[jax.Array], jax.Array] | None   # None: no group limit
    deepseek: tuple[str, str]               # (scoring_func, topk_method) in DeepSeek's names


ROUTING_RULES: dict[str, RoutingRule] = {}


def register_routing(rule: RoutingRule) -> RoutingRule:
    ROUTING_RULES[rule.name] = rule
    return rule


def routing_rule(name: str) -> RoutingRule:
    if name not in ROUTING_RULES:
        raise ValueError(f"MoE routing {name!r} is not registered; known: {sorted(ROUTING_RULES)}")
    return ROUTING_RULES[name]


def routing_for_deepseek(scoring_func: str, topk_method: str) -> RoutingRule | None:
    """The rule DeepSeek's (scoring_func, topk_method) names, or None if no rule has them."""
    for rule in ROUTING_RULES.values():
        if rule.deepseek == (scoring_func, topk_method):
            return rule
    return None


register_routing(RoutingRule("softmax_greedy", _softmax, False, None, ("softmax", "greedy")))
register_routing(RoutingRule("softmax_group_limited", _softmax, False, _group_max,
                             ("softmax", "group_limited_greedy")))
register_routing(RoutingRule("sigmoid_group_limited_bias", jax.nn.sigmoid, True, _top2_sum,
                             ("sigmoid", "noaux_tc")))


def route(p: dict, x: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """x [N, E] -> (expert ids int32[N, k], weights f32[N, k]) under `cfg.moe_routing`."""
    rule = routing_rule(cfg.moe_routing)
    X, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)         # [N, X]
    scores = rule.score(logits)
    choice = scores
    if rule.biased:
        choice = scores + p["router_bias"].astype(jnp.float32)
    if rule.group_score is not None and G > 1:
        grouped = choice.reshape(*choice.shape[:-1], G, X // G)
        group_score = rule.group_score(grouped)                               # [N, G]
        _, keep = jax.lax.top_k(group_score, cfg.topk_group)                  # [N, topk_group]
        kept = jnp.zeros(group_score.shape, bool).at[
            jnp.arange(group_score.shape[0])[:, None], keep].set(True)
        mask = jnp.repeat(kept, X // G, axis=-1)                              # [N, X]
        choice = jnp.where(mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor
