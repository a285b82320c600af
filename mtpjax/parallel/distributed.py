"""Several hosts: one program per process under `jax.distributed.initialize`.

Every process runs the same Python program (same prompts, same calls, same order); the mesh
spans every process's devices (`jax.devices()` after initialize), and each jitted step is one
SPMD program over all of them. Host readbacks go through `to_host`, which gathers arrays whose
shards live on other processes. How to start it: docs/parallel.md ("Several hosts").
"""

from __future__ import annotations

import numpy as np

import jax

__all__ = ["initialize", "to_host"]


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               cpu_collectives: str | None = "gloo", **kwargs) -> None:
    """`jax.distributed.initialize(...)`, first selecting CPU collectives (gloo) so that a CPU
    mesh spanning processes can run its all-reduces (GPU meshes use NCCL regardless).
    Call it before any other JAX call."""
    if cpu_collectives:
        try:
            jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
        except (AttributeError, ValueError) as e:       # a JAX without the option
            raise ValueError(f"this JAX ({jax.__version__}) cannot select CPU collectives "
                             f"{cpu_collectives!r}: {e}; pass cpu_collectives=None on GPUs") from e
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id, **kwargs)


def to_host(x) -> np.ndarray:
    """A device array as numpy on this host, gathering shards held by other processes."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
