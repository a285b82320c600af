"""The MoE layer with its routed experts split over the mesh's "model" axis (expert parallel).

model/moe.py runs it through `register_expert_parallel` when the experts divide over the mesh
(`uses_expert_parallel`); registering from here keeps the dependency one way: parallel/ imports
model/, never the reverse.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mtpjax.model.dense_ffn import swiglu
from mtpjax.model.fp8_weight import is_fp8, leaf_partition_spec
from mtpjax.model.moe import MOE, register_expert_parallel, routed_experts
from mtpjax.model.moe_routing import route
from mtpjax.parallel.kernels import shard_map_compat
from mtpjax.parallel.sharding import partition_spec


@register_expert_parallel
def expert_parallel(p: dict, x: jax.Array, cfg, valid: jax.Array, mesh, activation):
    """The MoE layer with its routed experts split over the mesh's "model" axis, by hand: every
    device routes every token (the router is replicated), runs the (token, expert) pairs of
    *its own* experts through its own weights, adds its slice of the shared experts (their
    columns split like a dense MLP's), and one all-reduce of f32[N, E] sums the partial
    outputs. XLA's partition of the same layer (a sharded router and `ragged_dot`) performed
    three all-gathers for routing, four for group sizes and two all-reduces of f32[N*k, I]
    (docs/parallel.md). The "data" axis replicates the call. x [N, E], valid bool[N] -> [N, E].
    """
    specs = MOE.param_specs(cfg)
    names = [k for k in ("router", "router_bias", "w_gate", "w_up", "w_down", "shared_gate",
                         "shared_up", "shared_down") if k in p]
    leaf_specs = [leaf_partition_spec(partition_spec(specs[k].axes, p[k].shape, cfg, mesh), p[k],
                                      mesh.shape) for k in names]
    # the shared experts run split inside only when all three are split (an FP8 one whose
    # blocks do not divide stays whole: then all three stay whole)
    shared = [i for i, k in enumerate(names) if k.startswith("shared_")]
    shared_split = bool(shared) and all(
        (s.values if is_fp8(s) else s) != P() for s in (leaf_specs[i] for i in shared))
    if shared and not shared_split:
        for i in shared:
            leaf_specs[i] = leaf_partition_spec(P(), p[names[i]], mesh.shape)
    X_local = p["w_gate"].shape[0] // int(mesh.shape["model"])

    def local(x, valid, *leaves):
        q = dict(zip(names, leaves))
        ids, weights = route(q, x, cfg.moe)
        first = jax.lax.axis_index("model") * X_local
        mine = (ids >= first) & (ids < first + X_local)
        out = routed_experts(q, x, jnp.where(mine, ids - first, X_local), weights, valid,
                             activation, out_dtype=jnp.float32, per_device=True)
        if shared_split:                       # this device's columns of the shared experts
            out = out + swiglu(x, q["shared_gate"], q["shared_up"], q["shared_down"],
                               activation).astype(jnp.float32)
        return jax.lax.psum(out, "model")

    out = shard_map_compat(local, mesh=mesh, in_specs=(P(), P(), *leaf_specs),
                           out_specs=P())(x, valid, *[p[k] for k in names])
    if "shared_gate" in p and not shared_split:   # replicated shared experts: once, outside
        out = out + swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"], activation)
    return out.astype(x.dtype)
