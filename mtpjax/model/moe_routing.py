"""MoE routing rules: how the router's logits pick each token's experts and their weights.

A rule is a kind of its own, named by `MoEConfig.routing` (`model/moe_config.py`) and looked
up here by the MoE layer (`model/moe.py`); a family chooses it when it reads its config.json.
Each rule is (transformers' `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter` / `Glm4MoeTopkRouter`):

- scores = sigmoid(logits) or softmax(logits) (float32);
- choice = scores, plus the learnt `e_score_correction_bias` when `biased` (the bias steers
  *selection*, never the weights);
- group limit (n_group > 1, when the rule has a `group_score`): rank the groups of experts by
  `group_score` of their choice scores, keep the best `topk_group` groups;
- the top `num_experts_per_tok` experts by choice among the kept groups;
- weights = their unbiased scores, normalized to sum 1 when `norm_topk_prob`, times
  `routed_scaling_factor`.

DeepSeek's config.json names a rule by the pair (`scoring_func`, `topk_method`); that spelling
belongs to the family (`models/deepseek.py` translates it both ways), not to the rule.
A new rule is one `register_routing` call (from any module); its `check` refuses the MoE
configs it cannot route.
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


def _any_moe(moe) -> None:
    return None


def _unnormalized(moe) -> None:
    if moe.norm_topk_prob:
        raise ValueError(f"norm_topk_prob=True with routing {moe.routing!r} (softmax scores) is "
                         "not supported (DeepSeek-V2's code and transformers disagree on it; "
                         "released V2 checkpoints set it False)")


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    name: str
    score: Callable[[jax.Array], jax.Array]          # f32 logits [N, X] -> scores [N, X]
    biased: bool                                     # choice = scores + e_score_correction_bias
    group_score: Callable[[jax.Array], jax.Array] | None   # None: no group limit
    # MoEConfig -> None, raises ValueError naming what this rule cannot route
    check: Callable[[object], None] = _any_moe


ROUTING_RULES: dict[str, RoutingRule] = {}


def register_routing(rule: RoutingRule) -> RoutingRule:
    ROUTING_RULES[rule.name] = rule
    return rule


def routing_rule(name: str) -> RoutingRule:
    if name not in ROUTING_RULES:
        raise ValueError(f"MoE routing {name!r} is not registered; known: {sorted(ROUTING_RULES)}")
    return ROUTING_RULES[name]


register_routing(RoutingRule("softmax_greedy", _softmax, False, None, _unnormalized))
register_routing(RoutingRule("softmax_group_limited", _softmax, False, _group_max, _unnormalized))
register_routing(RoutingRule("sigmoid_group_limited_bias", jax.nn.sigmoid, True, _top2_sum))


def route(p: dict, x: jax.Array, moe) -> tuple[jax.Array, jax.Array]:
    """x [N, E] -> (expert ids int32[N, k], weights f32[N, k]) under `moe.routing` (a MoEConfig)."""
    rule = routing_rule(moe.routing)
    X, G, k = moe.n_routed_experts, moe.n_group, moe.num_experts_per_tok
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)         # [N, X]
    scores = rule.score(logits)
    choice = scores
    if rule.biased:
        choice = scores + p["router_bias"].astype(jnp.float32)
    if rule.group_score is not None and G > 1:
        grouped = choice.reshape(*choice.shape[:-1], G, X // G)
        group_score = rule.group_score(grouped)                               # [N, G]
        _, keep = jax.lax.top_k(group_score, moe.topk_group)                  # [N, topk_group]
        kept = jnp.zeros(group_score.shape, bool).at[
            jnp.arange(group_score.shape[0])[:, None], keep].set(True)
        mask = jnp.repeat(kept, X // G, axis=-1)                              # [N, X]
        choice = jnp.where(mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * moe.routed_scaling_factor
