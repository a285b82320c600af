"""The operands every FP8 matmul kernel here takes: x [M, K] and e4m3 values [K, N]."""
from __future__ import annotations

import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn


def check_operands(x, values) -> None:
    """ValueError naming the shapes or dtype unless x is [M, K] and values e4m3 [K, N]."""
    if x.ndim != 2 or values.ndim != 2 or x.shape[1] != values.shape[0]:
        raise ValueError(f"x must be [M, K] and values [K, N], got {tuple(x.shape)} and "
                         f"{tuple(values.shape)}")
    if values.dtype != FP8_DTYPE:
        raise ValueError(f"values must be float8_e4m3fn, got {values.dtype}")
