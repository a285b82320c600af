"""`quantize_fp8(params)`: FP8 projection weights (`Fp8Weight`) from bf16 / f32 ones, any family.

Which leaves: the matrices every token multiplies by (attention q / k / v / o and MLA's
low-rank projections, the dense MLP, routed and shared experts, MTP's eh_proj); `lm_head` only
when asked. Never the embedding (a lookup, not a matmul), norms, the MoE router (routing decisions
flip on small errors; DeepSeek keeps it unquantized too) or biases.

`dequantize_params(params)` is the reference: every Fp8Weight replaced by the array it stands for,
so an FP8 model and its reference run the same products.
"""

from __future__ import annotations

from typing import Iterable

import jax

from mtpjax.model.fp8_weight import Fp8Weight, check_block, dequantize_leaf, quantize
from mtpjax.model.params import tree_from_items, tree_items

# leaf names that quantize_fp8 quantizes by default (fused `wqkv` / `w_gate_up` included)
PROJECTIONS = frozenset({
    "wq", "wk", "wv", "wo", "wqkv",                       # GQA
    "wq_a", "wq_b", "wkv_a", "wkv_b",                     # MLA
    "w_gate", "w_up", "w_down", "w_gate_up",              # dense MLP and routed experts
    "shared_gate", "shared_up", "shared_down",            # MoE shared experts
    "eh_proj",                                            # MTP input projection
})
OPTIONAL = frozenset({"lm_head"})
NEVER = frozenset({"embed", "router", "router_bias", "final_norm", "attn_norm", "mlp_norm",
                   "q_a_norm", "kv_a_norm", "q_norm", "k_norm", "enorm", "hnorm", "out_norm",
                   "bq", "bk", "bv", "bqkv"})
CHANNEL = "channel"


def quantize_fp8(params, block=(128, 128), *, include: Iterable[str] | None = None,
                 lm_head: bool = False):
    """The params with the projection weights as `Fp8Weight` (e4m3 values, float32 scales).

    block: (rows, cols) of one scale block in the [in, out] layout ((128, 128): DeepSeek-V3's
    blocks; tiny test models need smaller, e.g. (16, 16)), or "channel" for one scale per output
    column (block (in, 1)). include: the leaf names to quantize (default `PROJECTIONS`, plus
    lm_head when lm_head=True); a name outside the projections is refused. Leaves already in
    FP8 are kept as they are; the scale dtype is float32, the stand-in dtype each weight's own.
    """
    names = set(PROJECTIONS | (OPTIONAL if lm_head else set())) if include is None else set(include)
    bad = sorted(n for n in names if n not in PROJECTIONS | OPTIONAL)
    if bad:
        raise ValueError(f"quantize_fp8 include={sorted(names)}: {bad} cannot be quantized "
                         f"(embeddings, norms, the router and biases stay unquantized); "
                         f"quantizable: {sorted(PROJECTIONS | OPTIONAL)}")
    if block != CHANNEL:
        block = check_block(block)

    def leaf(path, x):
        if isinstance(x, Fp8Weight) or path[-1] not in names:
            return x
        b = (x.shape[-2], 1) if block == CHANNEL else block
        return quantize(x, b)

    return tree_from_items((p, leaf(p, x)) for p, x in tree_items(params))


def dequantize_params(params, dtype=None):
    """Every Fp8Weight replaced by its dequantized array (in `dtype`, default each weight's
    own): the bf16 reference an FP8 model is compared with."""
    return jax.tree.map(lambda x: dequantize_leaf(x, dtype), params,
                        is_leaf=lambda x: isinstance(x, Fp8Weight))


def has_fp8(params) -> bool:
    return any(isinstance(x, Fp8Weight) for _, x in tree_items(params))
