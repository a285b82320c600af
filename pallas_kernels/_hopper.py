"""What the Mosaic-GPU (Hopper warpgroup) kernels share: where they run, and how they run
interpreted."""
from __future__ import annotations

import jax


def on_hopper() -> bool:
    """Is the first device a Hopper GPU (compute capability 9.x: wgmma, TMA)?"""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")
                                            ).startswith("9")


def interpret_params():
    """JAX's GPU interpreter (CPU tests); a private module path, stable across 0.10-0.11."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
