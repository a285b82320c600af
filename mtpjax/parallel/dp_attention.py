"""The DP-attention layout: DeepSeek's serving layout (SGLang / vLLM "DP attention") on a
("data", "model") mesh of (d, 1) devices, for MLA + MoE models.

    attention, dense layers, embedding, head, router, shared experts   replicated
    routed experts w_gate / w_up / w_down [X, ...]                      split over "data" (X / d each)
    MLA latent pages [P, S, R + dr]                                     split over "data" by page:
                                                                        a request's pages on one device
    per-request state (slots, generate's outputs)                       split over "data" by row

The whole step runs under one `shard_map` over "data": each device runs attention (and every
dense part) for its own requests only, over its own latent pages, and the MoE layer gathers the
tokens of all devices, runs its own experts on them and reduce-scatters the outputs back
(`dp_expert_parallel.py`). Chosen per call with `layout="dp_attention"` (`mtpjax.generate`);
the default layout (None) is the sharding table of `sharding.py`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax.model.fp8_weight import is_fp8, leaf_partition_spec
from mtpjax.model.kinds import ParamSpec
from mtpjax.model.params import param_specs
from mtpjax.parallel.sharding import partition_spec, state_shardings

__all__ = ["LAYOUTS", "DP_ATTENTION_RULES", "check_layout", "check_dp_attention",
           "param_partition_specs", "param_shardings_like", "state_partition_specs",
           "rows_spec"]

LAYOUTS = (None, "dp_attention")

# logical axis -> mesh axis in this layout; everything else (heads, vocab, MLP columns) is
# replicated: each device runs the dense parts whole, for its own tokens
DP_ATTENTION_RULES: dict[str, str] = {
    "experts": "data",
    "pages": "data",
    "batch": "data",
}


def check_layout(layout) -> str | None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_dp_attention(cfg, mesh: Mesh | None, num_requests: int | None = None) -> int:
    """The device count d of a valid DP-attention run; a ValueError naming what is wrong."""
    if mesh is None:
        raise ValueError("layout='dp_attention' needs a mesh: pass "
                         "mesh=mtpjax.make_mesh(data_parallel=d)")
    if cfg.attention_kind != "mla" or cfg.ffn_kind != "moe":
        raise ValueError(
            f"layout='dp_attention' is for MLA + MoE models (DeepSeek-V2/V3); this model has "
            f"attention_kind={cfg.attention_kind!r}, ffn_kind={cfg.ffn_kind!r} (use the default "
            "layout, or mtpjax.DataParallelLLM for independent replicas)")
    if int(mesh.shape["model"]) != 1:
        raise ValueError(
            f"layout='dp_attention' runs on a mesh of shape (data=d, model=1); got model="
            f"{int(mesh.shape['model'])} (tensor-parallel attention inside DP attention is not "
            "built): use mtpjax.make_mesh(data_parallel=d)")
    d = int(mesh.shape["data"])
    X = cfg.moe.n_routed_experts
    if X % d:
        raise ValueError(f"layout='dp_attention' splits the routed experts over the devices: "
                         f"n_routed_experts={X} is not divisible by data_parallel={d}")
    if num_requests is not None and num_requests % d:
        raise ValueError(f"layout='dp_attention' gives each device the same number of "
                         f"requests: {num_requests} requests do not divide over data_parallel="
                         f"{d} devices (pad the batch to a multiple of {d})")
    return d


def _table_specs(cfg) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(
        param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    return {jax.tree_util.keystr(path): s for path, s in flat}


def param_partition_specs(params, cfg, mesh: Mesh):
    """PartitionSpecs shaped like `params` (arrays or tracers) in this layout: the table's
    logical axes read with DP_ATTENTION_RULES; leaves the table does not name (e.g. the
    draft-vocabulary head slice) replicated. An FP8 weight gets an Fp8Weight of specs."""
    table = _table_specs(cfg)

    def leaf(path, x):
        s = table.get(jax.tree_util.keystr(path))
        spec = P() if s is None else partition_spec(s.axes, x.shape, cfg, mesh,
                                                    DP_ATTENTION_RULES)
        return leaf_partition_spec(spec, x, mesh.shape) if is_fp8(x) else spec

    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=is_fp8)


def param_shardings_like(params, cfg, mesh: Mesh):
    """NamedShardings shaped like `params` (see param_partition_specs)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        param_partition_specs(params, cfg, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def state_partition_specs(state, cfg, mesh: Mesh):
    """PartitionSpecs shaped like a device state: latent pages split by page, per-request rows
    split by row (sharding.state_shardings read with DP_ATTENTION_RULES)."""
    return jax.tree.map(lambda s: s.spec,
                        state_shardings(state, cfg, mesh, DP_ATTENTION_RULES),
                        is_leaf=lambda x: isinstance(x, NamedSharding))


def rows_spec(tree):
    """P("data") for every leaf of a tree of per-request rows ([B, ...], split by row)."""
    return jax.tree.map(lambda _: P("data"), tree)
