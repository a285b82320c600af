"""Putting a step's inputs on the mesh: params by the table, a fresh device state created
straight into its shardings (never whole on one device), small host inputs replicated."""

from __future__ import annotations

import numpy as np

import jax

from mtpjax.model.fp8_weight import is_fp8, shard_like
from mtpjax.parallel.mesh import replicated
from mtpjax.parallel.sharding import param_shardings, state_shardings

__all__ = ["place", "shard_params", "create_sharded", "replicate", "sharded_inputs"]


def place(x, sharding):
    """One leaf into `sharding`: no copy if already there; leaves headed for devices of other
    processes go through host memory (every process holds the same value)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if not sharding.is_fully_addressable and isinstance(x, jax.Array):
        x = np.asarray(x)
    return jax.device_put(x, sharding)


def shard_params(params, cfg, mesh):
    """The params in their table shardings (`sharding.param_shardings`); an FP8 weight's values
    and scale by `fp8_weight.shard_like` (the same split where its blocks allow)."""
    def leaf(x, sharding):
        if is_fp8(x):
            return jax.tree.map(place, x, shard_like(x, sharding))
        return place(x, sharding)

    return jax.tree.map(leaf, params, param_shardings(cfg, mesh), is_leaf=is_fp8)


def create_sharded(make, cfg, mesh, rules: dict | None = None):
    """make() -> a device state (cache, SlotState, ...), created by one jitted call whose outputs
    have the table shardings (each device allocates only its shard; rules: another table)."""
    abstract = jax.eval_shape(make)
    return jax.jit(make, out_shardings=state_shardings(abstract, cfg, mesh, rules))()


def replicate(tree, mesh):
    """Small inputs (batches, sampling arrays, limits) on every device of the mesh."""
    rep = replicated(mesh)
    return jax.tree.map(lambda x: place(x, rep), tree)


def sharded_inputs(mesh, cfg, params, make_state, others):
    """(params sharded, make_state() created sharded, others replicated)."""
    return shard_params(params, cfg, mesh), create_sharded(make_state, cfg, mesh), replicate(
        others, mesh)
