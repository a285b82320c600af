"""Putting a step's inputs on the mesh: params by the table, a fresh device state created
straight into its shardings (never whole on one device), small host inputs replicated."""

from __future__ import annotations

import numpy as np

import jax

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
    """The params in their table shardings (`sharding.param_shardings`)."""
    return jax.tree.map(place, params, param_shardings(cfg, mesh))


def create_sharded(make, cfg, mesh):
    """make() -> a device state (cache, SlotState, ...), created by one jitted call whose outputs
    have the table shardings (each device allocates only its shard)."""
    abstract = jax.eval_shape(make)
    return jax.jit(make, out_shardings=state_shardings(abstract, cfg, mesh))()


def replicate(tree, mesh):
    """Small inputs (batches, sampling arrays, limits) on every device of the mesh."""
    rep = replicated(mesh)
    return jax.tree.map(lambda x: place(x, rep), tree)


def sharded_inputs(mesh, cfg, params, make_state, others):
    """(params sharded, make_state() created sharded, others replicated)."""
    return shard_params(params, cfg, mesh), create_sharded(make_state, cfg, mesh), replicate(
        others, mesh)
