"""Activations to e4m3 per (row, group of GROUP K-columns), DeepSeek-V3's recipe:

    x       [M, K]          any float dtype, K a multiple of GROUP
    values  [M, K]          float8_e4m3fn, x / scale rounded to nearest (|values| <= 448)
    scale   [M, K / GROUP]  float32, the group's amax / 448 (1 for an all-zero group)

x ~= float32(values) * scale repeated over each group. Each element's error is at most 2^-4 of
its magnitude (3 mantissa bits, round to nearest) while values is a normal e4m3 number, and at
most 2^-10 x scale below that (subnormal spacing 2^-9).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP = 128                      # K-columns per activation scale (DeepSeek-V3)
E4M3_MAX = 448.0


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (values [M, K] float8_e4m3fn, scale [M, K / GROUP] float32)."""
    if x.ndim != 2 or x.shape[1] % GROUP:
        raise ValueError(f"x must be [M, K] with K a multiple of {GROUP}, got {tuple(x.shape)}")
    M, K = x.shape
    groups = x.astype(jnp.float32).reshape(M, K // GROUP, GROUP)
    amax = jnp.max(jnp.abs(groups), axis=-1)
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    # amax / (amax / 448) may round a hair above 448, which e4m3fn (no inf) would make NaN
    values = jnp.clip(groups / scale[..., None], -E4M3_MAX, E4M3_MAX)
    return values.astype(jnp.float8_e4m3fn).reshape(M, K), scale


def dequantize_activations(values: jax.Array, scale: jax.Array) -> jax.Array:
    """The float32 [M, K] that (values, scale) stand for."""
    return values.astype(jnp.float32) * jnp.repeat(scale, GROUP, axis=1)
