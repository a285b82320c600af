"""`MoEConfig`: the experts and routing of FFN kind "moe" (model/moe.py).

`ModelConfig.moe` holds one exactly when `ffn_kind == "moe"`. `routing` names a routing kind of
`model/moe_routing.py` (a family translates its config.json's spelling of the rule, e.g.
DeepSeek's (scoring_func, topk_method), into that name). What relates these fields to the
model's other fields (first_k_dense_replace <= num_layers) is checked by `ModelConfig`.
"""

from __future__ import annotations

import dataclasses

from mtpjax.config import _finite, _flag, _positive_int

DEFAULT_ROUTING = "sigmoid_group_limited_bias"     # DeepSeek-V3's


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int                 # X
    num_experts_per_tok: int              # k: routed experts per token
    moe_intermediate_size: int            # I: each expert's SwiGLU width
    routing: str = DEFAULT_ROUTING        # a routing kind (model/moe_routing.py)
    n_shared_experts: int = 0             # always-on experts, one SwiGLU of width I * this
    first_k_dense_replace: int = 0        # the first target layers keep a dense FFN
    n_group: int = 1                      # G: experts form G groups ...
    topk_group: int = 1                   # ... of which the best topk_group are kept
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False          # the k weights are renormalized to sum 1

    def __post_init__(self):
        from mtpjax.model.moe_routing import routing_rule   # (lazy: it imports jax)
        for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "n_group", "topk_group"):
            _positive_int(name, getattr(self, name))
        X, k, G = self.n_routed_experts, self.num_experts_per_tok, self.n_group
        if k > X:
            raise ValueError(f"num_experts_per_tok {k} > n_routed_experts {X}")
        if X % G:
            raise ValueError(f"n_group {G} does not divide n_routed_experts {X}")
        if self.topk_group > G:
            raise ValueError(f"topk_group {self.topk_group} > n_group {G}")
        for name in ("n_shared_experts", "first_k_dense_replace"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        _finite("routed_scaling_factor", self.routed_scaling_factor, positive=True)
        _flag("norm_topk_prob", self.norm_topk_prob)
        object.__setattr__(self, "norm_topk_prob", bool(self.norm_topk_prob))
        if not isinstance(self.routing, str):
            raise ValueError(f"routing must be the name of a MoE routing kind, got "
                             f"{self.routing!r}")
        rule = routing_rule(self.routing)
        if rule.group_score is not None and self.topk_group * (X // G) < k:
            raise ValueError(f"topk_group {self.topk_group} groups of {X // G} experts cannot "
                             f"hold num_experts_per_tok {k} experts")
        rule.check(self)
