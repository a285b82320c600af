"""The weight bytes a decode step reads, by part, from a model's parameter table: what the e2e
benchmark's floor and expert-aware adaptive K's step cost both count.

    target_layers            every target-layer weight but the routed experts
    final_norm, lm_head      once per pass that reads them
    mtp_module               one MTP module's weights but its routed experts (a draft pass reads
                             one module)
    embed_table_not_counted  the embedding (a step gathers a few rows of it)
    expert                   one routed expert's three matrices
    target_moe_layers        MoE layers of the target; mtp_moe_layers: of one MTP module

A step reads only the routed experts its tokens choose: `touched_experts`.
"""

from __future__ import annotations

import math

import numpy as np


def weight_bytes_by_part(cfg, itemsize: int = 2, fp8=None) -> dict:
    """The parts above in bytes (itemsize per element; fp8: the quantize_fp8 block ((bE, bN) or
    "channel") when the projections are FP8: 1 byte each plus their float32 scales)."""
    from mtpjax.model.params import param_specs, tree_items
    from mtpjax.model.quantize import CHANNEL, PROJECTIONS

    def nbytes(path, shape):
        n = math.prod(shape)
        if not fp8 or path[-1] not in PROJECTIONS:
            return n * itemsize
        bE, bN = (shape[-2], 1) if fp8 == CHANNEL else fp8
        scales = math.prod(shape[:-2]) * -(-shape[-2] // bE) * -(-shape[-1] // bN)
        return n + 4 * scales
    out = dict(target_layers=0, final_norm=0, lm_head=0, mtp_module=0, embed_table_not_counted=0,
               expert=0, target_moe_layers=0, mtp_moe_layers=0)
    for path, spec in tree_items(param_specs(cfg)):
        n = nbytes(path, spec.shape)
        routed = spec.axes[:1] == ("experts",) and len(spec.shape) == 3   # [X, in, out]
        where = {"embed": "embed_table_not_counted", "final_norm": "final_norm",
                 "lm_head": "lm_head", "layers": "target_layers", "mtp": "mtp_module"}[path[0]]
        if routed:
            if where == "target_layers" and path[1] == cfg.moe.first_k_dense_replace:
                out["expert"] += n // spec.shape[0]        # one expert's three matrices
            if path[-1] == "w_gate":
                out["target_moe_layers" if where == "target_layers" else "mtp_moe_layers"] += 1
            continue
        out[where] += n
    out["mtp_module"] //= max(cfg.num_mtp_layers, 1)
    out["mtp_moe_layers"] //= max(cfg.num_mtp_layers, 1)
    return out


def touched_experts(num_experts: int, top_k: int, tokens):
    """Expected distinct experts per layer that `tokens` tokens routing uniformly at random
    pick: X (1 - (1 - k/X)^tokens); tokens may be an array."""
    X, k = num_experts, top_k
    return X * (1.0 - (1.0 - k / X) ** np.asarray(tokens, np.float64))
