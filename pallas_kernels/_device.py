"""Facts about the GPU the kernels are traced for, read from the device, not hard-coded.

The tuning defaults size their grids in waves of CTAs over the SMs, so they ask the device how
many SMs it has, at trace time. Off a GPU (CPU tests, interpret mode) there is no SM to count:
they then tune as for an H100 / H200 (132 SMs), the GPUs they were measured on, so an
interpreted run exercises the same tiles and splits as the GPU run it stands in for.
"""
from __future__ import annotations

import jax

FALLBACK_NUM_SMS = 132   # H100 / H200 SXM, where the defaults were measured
HOPPER_SMEM_BYTES = 227 * 1024   # shared memory one CTA may opt into on sm_90 (H100 and H200)


def num_sms(device: jax.Device | None = None) -> int:
    """Streaming multiprocessors of `device` (default: the first device); FALLBACK_NUM_SMS
    when it is not a GPU or its runtime does not report `core_count`."""
    device = device if device is not None else jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    if not isinstance(count, int) or count <= 0:
        return FALLBACK_NUM_SMS
    return count
