"""The sharding table: logical axes (declared by every param, page and state leaf) -> mesh axes.

    logical axis   mesh axis   leaves
    vocab          model       embed [V, E] (vocab-parallel), lm_head [E, V], draft_probs [S, K, V]
    q_heads        model       wq / wo / bq (GQA), wq / wq_b / wkv_b / wo (MLA): whole heads
    kv_heads       model       wk / wv / bk / bv, GQA pages [KVH, P, S, hd]  (if KVH divides)
    mlp            model       dense FFN and shared-expert columns (and expert columns when the
                               experts do not divide the model axis)
    experts        model       w_gate / w_up / w_down [X, ...] (the router is replicated)
    batch          data        per-request device state (slots, generate's outputs)
    everything else replicated: embed (hidden), embed2, head_dim, q_lora, kv_lora, latent,
                               pages, page (MLA latent pages are replicated over "model")

A dimension is split only when the mesh axis divides both its size and the count of the whole
units it holds (heads for q_heads / kv_heads, experts for experts), and a mesh axis is used at
most once per leaf (first logical axis wins: expert weights [X, E, I] split X, not I).
Anything the table does not name is replicated. An FP8 weight (`Fp8Weight`) takes its logical
weight's spec for its values, and its scale grid splits alike where the blocks allow
(`model/fp8_weight.py: partition_specs`). `docs/parallel.md` has the table with the
collectives each step performs.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mtpjax.model.params import param_specs
from mtpjax.model.kinds import ParamSpec

__all__ = ["RULES", "STATE_AXES", "partition_spec", "param_shardings",
           "state_shardings", "pin", "kv_heads_sharded"]

RULES: dict[str, str] = {
    "vocab": "model",
    "q_heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "experts": "model",
    "batch": "data",
}

# Logical axes of the per-request state leaves, by dataclass field name (SlotState of the
# engine's step, GenerateState of generate's loop). Fields not named here are replicated.
STATE_AXES: dict[str, tuple] = {
    "hist_tokens": ("batch", None),
    "hist_hidden": ("batch", None, "embed"),
    "drafts": ("batch", None),
    "draft_probs": ("batch", None, "vocab"),
    "in_thinking": ("batch",),
    "seq_len": ("batch",),
    "pending": ("batch",),
    "block_tables": ("batch", None),
    "out_tokens": ("batch", None),
    "num_out": ("batch",),
    "done": ("batch",),
}


def _units(cfg, logical: str, dim: int) -> int:
    """How many indivisible units a dimension of this logical axis holds."""
    return {"q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "experts": cfg.moe.n_routed_experts if cfg.moe is not None else dim}.get(logical, dim)


def partition_spec(axes, shape, cfg, mesh: Mesh, rules: dict | None = None) -> P:
    """PartitionSpec of one leaf with logical `axes` and `shape` on `mesh` (see the table)."""
    rules = RULES if rules is None else rules
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match the shape {tuple(shape)}")
    if any(d == 0 for d in shape):                   # nothing to split (e.g. K = 0 drafts)
        return P()
    used, out = set(), []
    for logical, dim in zip(axes, shape):
        axis = rules.get(logical) if logical is not None else None
        n = int(mesh.shape[axis]) if axis is not None else 1
        if axis is None or n == 1 or axis in used or dim % n or _units(cfg, logical, dim) % n:
            out.append(None)
        else:
            used.add(axis)
            out.append(axis)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def param_shardings(cfg, mesh: Mesh):
    """Tree of NamedSharding shaped like the params (`model/params.py: param_specs`)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, partition_spec(s.axes, s.shape, cfg, mesh)),
                        param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))


def kv_heads_sharded(cfg, mesh: Mesh | None) -> bool:
    """Are GQA pages split by KV head on this mesh (else replicated over "model")?"""
    if mesh is None:
        return False
    n = int(mesh.shape["model"])
    return n > 1 and cfg.num_kv_heads % n == 0


def _is_struct(x) -> bool:
    return dataclasses.is_dataclass(x) and not isinstance(x, type)


def state_shardings(state, cfg, mesh: Mesh, rules: dict | None = None):
    """Tree of NamedSharding shaped like a device state (arrays or ShapeDtypeStructs): a
    KVCache's pages by their type's AXES, the fields of STATE_AXES by name, the rest replicated.
    rules: another table than RULES (the DP-attention layout's)."""
    rep = NamedSharding(mesh, P())

    def leaf(axes, a):
        return NamedSharding(mesh, partition_spec(axes, a.shape, cfg, mesh, rules))

    def walk(x):
        axes = getattr(type(x), "AXES", None)
        if axes is not None:                              # a pages type: every array has AXES
            return jax.tree.map(lambda a: leaf(axes, a), x)
        if _is_struct(x):
            new = {}
            for f in dataclasses.fields(x):
                if not f.metadata.get("pytree_node", True):
                    continue
                v = getattr(x, f.name)
                if f.name in STATE_AXES and hasattr(v, "shape") and len(v.shape) == len(
                        STATE_AXES[f.name]):
                    new[f.name] = leaf(STATE_AXES[f.name], v)
                else:
                    new[f.name] = walk(v)
            return x.replace(**new)
        if isinstance(x, (tuple, list)):
            return type(x)(walk(v) for v in x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return jax.tree.map(lambda _: rep, x)

    return walk(state)


def pin(state, cfg, mesh: Mesh | None):
    """Inside a jitted step: constrain a device state to its table shardings (no-op without a
    mesh). The steps pin the state they return, so it leaves with the sharding it came in with
    and its buffers are donated in place."""
    if mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, cfg, mesh))


def pin_replicated(x, mesh: Mesh | None):
    """Inside a jitted step: a result every process reads whole (the engine's readback)."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def mesh_sharding(cfg, sharding, mesh):
    """The loaders' `sharding=` / `mesh=` pair -> what they place leaves with: `sharding` as
    given, or the table's tree for `mesh` (a ValueError when both are given)."""
    if mesh is None:
        return sharding
    from mtpjax.parallel.mesh import check_mesh
    if sharding is not None:
        raise ValueError("give sharding= or mesh=, not both (mesh= uses the sharding table)")
    return param_shardings(cfg, check_mesh(mesh))
