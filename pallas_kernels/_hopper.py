"""What the Mosaic-GPU (Hopper warpgroup) kernels share: where they run, and how they run
interpreted."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def on_hopper() -> bool:
    """Is the first device a Hopper GPU (compute capability 9.x: wgmma, TMA)?"""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")
                                            ).startswith("9")


def interpret_params():
    """JAX's GPU interpreter (CPU tests); a private module path, stable across 0.10-0.11."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


MOSAIC_ALIGNMENT = 256  # bytes: Mosaic-GPU calls take only buffers aligned to this


def aligned_copy(x: jax.Array) -> jax.Array:
    """x padded by whole leading-axis entries (>= 256 bytes of them, zeros): a buffer of its
    own. Inside a larger program XLA may hand a slice of a bigger array (an engine's block
    tables, a view of the tile groups) to a custom call as an offset pointer, and Mosaic-GPU
    calls reject one that is not 256-byte aligned (an unaligned one failed at batch 32). The
    kernels read only the first x.shape[0] entries."""
    entry_bytes = max(1, x.dtype.itemsize * (x.size // max(x.shape[0], 1)))
    extra = -(-MOSAIC_ALIGNMENT // entry_bytes)
    return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1))
