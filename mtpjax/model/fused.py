"""Fused projections for serving: q/k/v and gate/up weights concatenated once, at load.

A decode step reads every weight once; what it pays beyond the bytes is per-kernel: a launch and
a tail for every small GEMM. At the 8B shape on an H100 the k and v projections (8 MB each) ran
well below the large ones' bandwidth (docs/benchmarks.md). Concatenating `wq | wk | wv` into one
`wqkv [E, (NH + 2 KV) hd]` and `w_gate | w_up` into one `w_gate_up [E, 2I]` makes each group one
GEMM that reads the same bytes. XLA's DotMerger would do the same merge *per call* (a copy of
the weights every step: why `step_jit` turns it off); here it happens once.

Modes (`fusion_groups`): `True` / "all" fuses both groups, "qkv" only q/k/v (the small k/v
GEMMs were the slow ones; gate/up already ran at copy bandwidth, and their concatenation is
most of the extra memory: 7.5 of 9.1 GB at the 8B shape), `False` none.

`fuse_projections(params, cfg)` returns a new tree: every GQA layer (target and MTP blocks) gets
`wqkv` (and `bqkv` with biases) in place of wq/wk/wv (bq/bk/bv), every dense SwiGLU `w_gate_up`
in place of w_gate/w_up; everything else is shared with the input. On DeepSeek-style layers
the "qkv" group is MLA's query projection (wq, or wq_a under a q LoRA) with wkv_a, both reading
the same x (`wq_kv_a [E, Q + R + dr]`), and MLA's `wkv_b` is split once into the absorbed
attention's halves `w_uk [R, H, dn]` and `w_uv [R, H, dv]` (sliced from `wkv_b` in the step, the
halves were a copy of the weight every step: a `loop_slice_fusion` writing 4.2 MB per V2-Lite
layer, 32 MB per DeepSeek-V3 layer, in the H200's step HLO); "gate_up" also fuses the MoE
shared experts' gate and up (`shared_gate_up`): at batch 1 a V2-Lite-shaped step ran ~29
kernels per layer, most of them small GEMMs whose launch and tail cost more than their bytes.
The model's projections read either layout (`gqa.qkv_projection`, `dense_ffn.DenseFFN`,
`mla._w_uk_uv`). One device only: on a mesh the
table splits wq by head and wk/wv by KV head, which a concatenated matrix cannot follow; the
engine and `generate` fuse after placing the params (the sharding table describes the unfused
tree), so a one-device mesh works.
Memory: the fused matrices are new arrays; the caller's q/k/v and gate/up stay alive as long as
the caller holds them (`LLM.from_pretrained` holds nothing else).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mtpjax.model.fp8_weight import concatenate_out, is_fp8
from mtpjax.model.mla import kv_b_halves

QKV = ("wq", "wk", "wv")
BQKV = ("bq", "bk", "bv")
GATE_UP = ("w_gate", "w_up")
# MLA: the query projection (q_proj, or q_a_proj under a q LoRA) and kv_a_proj_with_mqa read
# the same x; MoE: the shared experts' gate and up
MLA_QKV = (("wq", "wkv_a"), ("wq_a", "wkv_a"))
SHARED_GATE_UP = ("shared_gate", "shared_up")
GROUPS = ("qkv", "gate_up")
MODES = {"all": GROUPS, "qkv": ("qkv",)}     # the string values of fuse_projections=


def fusion_groups(value) -> tuple[str, ...]:
    """The projection groups a `fuse_projections=` value fuses; ValueError naming a bad one."""
    if isinstance(value, (bool, np.bool_)):
        return GROUPS if value else ()
    if isinstance(value, str) and value in MODES:
        return MODES[value]
    raise ValueError(f"fuse_projections must be True, False, 'all' or 'qkv', got {value!r}")


def _concatenate(ws: list):
    """Weights joined along the output axis; None for FP8 weights whose scale blocks would
    straddle the seams (`fp8_weight.concatenate_out`): those stay unfused."""
    if any(is_fp8(w) for w in ws):
        return concatenate_out(ws)
    return jnp.concatenate(ws, axis=-1)


def _fuse(out: dict, names: tuple[str, ...], into: str) -> bool:
    """out[into] = the weights `names` joined along the output axis, in place of them, when
    all are there and can be joined; whether it fused."""
    if not all(k in out for k in names):
        return False
    fused = _concatenate([out[k] for k in names])
    if fused is None:
        return False
    for k in names:
        del out[k]
    out[into] = fused
    return True


def _split_kv_b(out: dict, cfg) -> None:
    """MLA: out["wkv_b"] [R, H * (dn + dv)] -> out["w_uk"] [R, H, dn], out["w_uv"] [R, H, dv]
    (the absorbed attention's two halves, `mla._w_uk_uv`), in place of it. FP8 kv_b stays
    whole (it is dequantized in the step, where the halves are slices of the widened copy)."""
    w = out.get("wkv_b")
    if w is None or is_fp8(w):
        return
    out["w_uk"], out["w_uv"] = kv_b_halves(out.pop("wkv_b"), cfg)


def _fuse_block(block: dict, kinds: tuple[str, str], cfg, groups=GROUPS) -> dict:
    out = dict(block)
    if "qkv" in groups and kinds[0] == "gqa" and _fuse(out, QKV, "wqkv"):
        if all(k in out for k in BQKV):
            out["bqkv"] = jnp.concatenate([out.pop(k) for k in BQKV], axis=-1)
    if "qkv" in groups and kinds[0] == "mla":
        for names in MLA_QKV:                   # wq_kv_a [E, Q + R + dr]: mla_projections splits
            _fuse(out, names, "wq_kv_a")
        _split_kv_b(out, cfg)
    if "gate_up" in groups and kinds[1] == "dense":
        _fuse(out, GATE_UP, "w_gate_up")
    if "gate_up" in groups and kinds[1] == "moe":
        _fuse(out, SHARED_GATE_UP, "shared_gate_up")
    return out


def fuse_projections(params: dict, cfg, groups=GROUPS) -> dict:
    """The params with the `groups` ("qkv", "gate_up") fused (see above); idempotent."""
    out = dict(params)
    out["layers"] = tuple(_fuse_block(p, k, cfg, groups) for p, k in zip(params["layers"],
                                                                         cfg.layer_kinds()))
    if "mtp" in params:
        out["mtp"] = tuple(dict(m, block=_fuse_block(m["block"], cfg.mtp_layer_kind(), cfg,
                                                     groups))
                           for m in params["mtp"])
    return out


def is_fused(params: dict) -> bool:
    return any(k in p for p in params["layers"]
               for k in ("wqkv", "w_gate_up", "wq_kv_a", "w_uk", "shared_gate_up"))


def check_fusable(mesh) -> None:
    if mesh is not None and mesh.size > 1:
        raise ValueError(f"fuse_projections needs one device; got a mesh of {mesh.size} "
                         f"devices {dict(mesh.shape)} (the sharding table splits q/k/v by head)")
