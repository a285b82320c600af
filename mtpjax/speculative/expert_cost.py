"""The bytes a speculative step reads on an MoE model, as a function of the tokens it routes:
the cost model of expert-aware adaptive K.

On a dense model a decode step reads every weight once whatever its tokens, so a draft is
nearly free while the batch is memory bound. On an MoE model each routed token reads the
experts it picks: with X experts and top-k routing, n tokens routing uniformly touch
X (1 - (1 - k/X)^n) experts per layer. At batch 1 a K=3 verify (4 tokens) touches ~21 of
DeepSeek-V2-Lite's 64 experts per layer where one token touches 6, and the step's floor is
~2.7x plain's; a draft is worth verifying only if its chance of being kept pays for the
experts it adds. Drafts masked off by k route to no expert (speculative/mixed_step.py), so a
lower k does read fewer bytes.

    step_bytes(B, n, p) = fixed(p) + draft_experts(B, p) + expert_bytes * touched(n)
        fixed(p)      every non-expert weight the verify pass and p draft passes read
                      (attention, dense layers, shared experts, norms, lm_head per pass; the
                      MTP module's first pass runs even at p = 0, without its lm_head)
        draft_experts the MTP modules' routed experts: each of the p draft passes routes B
                      tokens
        p             the step's draft passes (default K): the engine runs as many as the
                      largest k it asks of the next step
        expert_bytes  one routed expert's matrices x the target's MoE layers
        n             verify tokens routed: sum over decode rows of 1 + k
"""
from __future__ import annotations

import dataclasses

import numpy as np

from mtpjax.model.weight_bytes import touched_experts, weight_bytes_by_part


@dataclasses.dataclass(frozen=True)
class ExpertStepCost:
    fixed_bytes: float                  # non-expert weights of the verify pass + K draft passes
    target_expert_bytes: float          # one expert's matrices x target MoE layers
    draft_expert_bytes: float           # one expert's matrices x MTP MoE layers x K passes
    num_experts: int                    # X routed experts per layer
    top_k: int                          # experts per token
    K: int                              # draft passes the two byte counts above include
    pass_bytes: float                   # one draft pass's non-expert weights (module + lm_head)
    lm_head_bytes: float

    def touched(self, tokens) -> np.ndarray:
        """Expected distinct experts per layer that `tokens` uniformly routed tokens pick."""
        return touched_experts(self.num_experts, self.top_k, tokens)

    def step_bytes(self, batch: int, tokens, passes=None) -> np.ndarray:
        """Bytes of a step with `batch` decode rows routing `tokens` verify tokens in all and
        running `passes` draft passes (default K; may be an array)."""
        p = np.asarray(self.K if passes is None else passes, np.float64)
        runs = np.maximum(p, 1.0)                    # the first pass runs at p = 0 too
        fixed = self.fixed_bytes - self.K * self.pass_bytes + runs * self.pass_bytes \
            - (runs - p) * self.lm_head_bytes
        per_pass = self.draft_expert_bytes / max(self.K, 1)
        return (fixed + per_pass * runs * self.touched(batch)
                + self.target_expert_bytes * self.touched(tokens))

    @classmethod
    def from_config(cls, cfg, K: int, itemsize: int = 2) -> "ExpertStepCost | None":
        """The model's cost from its parameter table (`model/weight_bytes.py`, the same parts
        the e2e bench's floor counts; bf16 bytes by default); None for a model without routed
        experts (the dense rule applies)."""
        if cfg.ffn_kind != "moe" or cfg.moe is None:
            return None
        w = weight_bytes_by_part(cfg, itemsize)
        # the verify pass reads the target and the lm_head; each draft pass one MTP module
        # and the lm_head again
        fixed = w["target_layers"] + w["final_norm"] + (1 + K) * w["lm_head"] \
            + K * w["mtp_module"]
        return cls(fixed_bytes=float(fixed),
                   target_expert_bytes=float(w["expert"] * w["target_moe_layers"]),
                   draft_expert_bytes=float(w["expert"] * w["mtp_moe_layers"] * K),
                   num_experts=cfg.moe.n_routed_experts, top_k=cfg.moe.num_experts_per_tok,
                   K=K, pass_bytes=float(w["lm_head"] + w["mtp_module"]),
                   lm_head_bytes=float(w["lm_head"]))
