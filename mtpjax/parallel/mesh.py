"""The device mesh of a run: two named axes, ("data", "model").

    model   tensor / expert parallel: attention heads, MLP columns, experts, the vocabulary
    data    replicas of the weights and the cache; per-request device state (slots) is split
            over it when the request count divides (docs/parallel.md)

`make_mesh(tensor_parallel=N, data_parallel=M)` builds one over the first N*M devices of
`jax.devices()` (all processes' devices after `jax.distributed.initialize`). Any
`jax.sharding.Mesh` whose axis names are exactly ("data", "model") is accepted by `check_mesh`
(either axis may have size 1); it is normalized to automatic (GSPMD) axis types, because the
steps are partitioned by XLA from the shardings of their arguments, not by sharding-in-types.
"""

from __future__ import annotations

import numpy as np

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "model")

__all__ = ["AXES", "make_mesh", "check_mesh", "replicated", "mesh_size"]


def _auto_mesh(devices: np.ndarray) -> Mesh:
    """A Mesh over `devices` [data, model] with Auto axis types on every JAX version (newer
    `jax.make_mesh` defaults to Explicit axes)."""
    AxisType = getattr(jax.sharding, "AxisType", None)
    if AxisType is None:                                   # pragma: no cover (old JAX)
        return Mesh(devices, AXES)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def make_mesh(tensor_parallel: int = 1, data_parallel: int = 1, *, devices=None) -> Mesh:
    """A ("data", "model") mesh of data_parallel x tensor_parallel devices.

    devices: the devices to use (default `jax.devices()`, every process's); the first
    data_parallel * tensor_parallel are taken, model-axis neighbours adjacent."""
    for name, n in (("tensor_parallel", tensor_parallel), ("data_parallel", data_parallel)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {name}={n!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = int(tensor_parallel) * int(data_parallel)
    if need > len(devices):
        raise ValueError(f"tensor_parallel={tensor_parallel} x data_parallel={data_parallel} "
                         f"needs {need} devices, but only {len(devices)} are available")
    grid = np.asarray(devices[:need], dtype=object).reshape(int(data_parallel), int(tensor_parallel))
    return _auto_mesh(grid)


def check_mesh(mesh) -> Mesh | None:
    """None, or `mesh` as a Mesh with Auto ("data", "model") axes; a ValueError naming the axes
    of anything else."""
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes {AXES} (see "
                         f"mtpjax.make_mesh), got {type(mesh).__name__}")
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(f"mesh axes are {tuple(mesh.axis_names)}; mtpjax needs a mesh whose axes "
                         f"are named exactly {AXES} (either may have size 1), e.g. "
                         "mtpjax.make_mesh(tensor_parallel=N, data_parallel=M)")
    types = getattr(mesh, "axis_types", None)
    AxisType = getattr(jax.sharding, "AxisType", None)
    if types is not None and AxisType is not None and any(t != AxisType.Auto for t in types):
        return _auto_mesh(mesh.devices)
    return mesh


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    return 1 if mesh is None else int(mesh.shape[axis])
