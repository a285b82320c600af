"""FFN kind "moe": DeepSeek's mixture of experts (routed SwiGLU experts + always-on shared ones).

Routing (float32, per token; transformers' `DeepseekV3TopkRouter` / `DeepseekV2TopkRouter`):
- scores = sigmoid(x W_r) (V3, "noaux_tc") or softmax(x W_r) (V2, "greedy" /
  "group_limited_greedy");
- choice = scores + e_score_correction_bias (noaux_tc only: the bias steers *selection*, never
  the weights);
- group limit (n_group > 1): rank groups of experts by the sum of their top-2 choice scores
  (noaux_tc) or their max (group_limited_greedy), keep the best `topk_group` groups;
- the top `num_experts_per_tok` experts by choice among the kept groups;
- weights = their unbiased scores, normalized to sum 1 when `norm_topk_prob`, times
  `routed_scaling_factor`.

Experts run as grouped matmuls (`grouped_matmul`: `jax.lax.ragged_dot` at decode sizes, exact
tiles at prefill sizes on GPU) over the N*k (token, expert) pairs sorted by expert, so each expert's weights multiply only its own tokens: never all experts on all tokens,
never an [N, n_experts, hidden] activation. Padding tokens (valid False) are routed nowhere:
they sort behind every expert's group, take no part in any matmul group and add nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.model.dense_ffn import swiglu
from mtpjax.model.grouped_matmul import grouped_matmul
from mtpjax.model.kinds import ParamSpec, register_ffn_kind


def route(p: dict, x: jax.Array, cfg) -> tuple[jax.Array, jax.Array]:
    """x [N, E] -> (expert ids int32[N, k], weights f32[N, k])."""
    X, G, k = cfg.n_routed_experts, cfg.n_group, cfg.num_experts_per_tok
    logits = x.astype(jnp.float32) @ p["router"].astype(jnp.float32)         # [N, X]
    if cfg.scoring_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    choice = scores
    if cfg.topk_method == "noaux_tc":
        choice = scores + p["router_bias"].astype(jnp.float32)
    if cfg.topk_method != "greedy" and G > 1:
        grouped = choice.reshape(*choice.shape[:-1], G, X // G)
        if cfg.topk_method == "noaux_tc":
            group_score = jax.lax.top_k(grouped, min(2, X // G))[0].sum(-1)  # [N, G]
        else:
            group_score = grouped.max(-1)
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


def routed_experts(p: dict, x: jax.Array, ids: jax.Array, weights: jax.Array,
                   valid: jax.Array, activation, matmul=grouped_matmul) -> jax.Array:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for valid tokens, grouped by expert.

    x [N, E], ids int32[N, k], weights f32[N, k], valid bool[N] -> [N, E]. matmul(rows, w,
    sizes): the grouped matmul (`grouped_matmul` picks by shape; the MoE bench passes one)."""
    N, k = ids.shape
    X = p["w_gate"].shape[0]
    expert = jnp.where(valid[:, None], ids, X).reshape(-1)        # padding -> past every group
    order = jnp.argsort(expert, stable=True)                      # [N*k] pairs sorted by expert
    token = order // k
    sizes = jnp.zeros(X + 1, jnp.int32).at[expert].add(1)[:X]    # tokens per expert
    xs = x[token]                                                 # [N*k, E]
    h = activation(matmul(xs, p["w_gate"], sizes)) * matmul(xs, p["w_up"], sizes)  # [N*k, I]
    y = matmul(h, p["w_down"], sizes)                             # [N*k, E]
    real = expert[order] < X
    y = jnp.where(real[:, None], y.astype(jnp.float32) * weights.reshape(-1)[order][:, None], 0.0)
    return jnp.zeros((N, x.shape[-1]), jnp.float32).at[token].add(y).astype(x.dtype)


class MoEFFN:
    name = "moe"
    hf_rows = {
        "router": ("mlp.gate.weight", True),
        "router_bias": ("mlp.gate.e_score_correction_bias", False),
        "shared_gate": ("mlp.shared_experts.gate_proj.weight", True),
        "shared_up": ("mlp.shared_experts.up_proj.weight", True),
        "shared_down": ("mlp.shared_experts.down_proj.weight", True),
    }
    # leaf -> (HF suffix with {e} = expert index, transposed): one row per expert, stacked on
    # the leaf's first axis
    hf_expert_rows = {
        "w_gate": ("mlp.experts.{e}.gate_proj.weight", True),
        "w_up": ("mlp.experts.{e}.up_proj.weight", True),
        "w_down": ("mlp.experts.{e}.down_proj.weight", True),
    }
    activation = staticmethod(jax.nn.silu)

    def param_specs(self, cfg) -> dict[str, ParamSpec]:
        E, X, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        specs = {"router": ParamSpec((E, X), ("embed", "experts"), "normal")}
        if cfg.topk_method == "noaux_tc":
            specs["router_bias"] = ParamSpec((X,), ("experts",), "zeros")
        specs["w_gate"] = ParamSpec((X, E, I), ("experts", "embed", "mlp"), "normal")
        specs["w_up"] = ParamSpec((X, E, I), ("experts", "embed", "mlp"), "normal")
        specs["w_down"] = ParamSpec((X, I, E), ("experts", "mlp", "embed"), "normal")
        if cfg.n_shared_experts:
            S = I * cfg.n_shared_experts
            specs["shared_gate"] = ParamSpec((E, S), ("embed", "mlp"), "normal")
            specs["shared_up"] = ParamSpec((E, S), ("embed", "mlp"), "normal")
            specs["shared_down"] = ParamSpec((S, E), ("mlp", "embed"), "normal")
        return specs

    def __call__(self, p: dict, x, cfg, valid):
        """x [..., E] -> [..., E]; valid bool[...] marks real tokens (padding is not routed)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        valid = jnp.broadcast_to(valid, shape[:-1]).reshape(-1)
        with jax.named_scope("router"):
            ids, weights = route(p, x, cfg)
        with jax.named_scope("experts"):
            out = routed_experts(p, x, ids, weights, valid, self.activation)
        if "shared_gate" in p:
            out = out + swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"],
                               self.activation)
        return out.reshape(shape)


MOE = register_ffn_kind(MoEFFN())
