"""Packed token bitmasks: bit (v % 32) of word v // 32 allows token v (xgrammar's layout)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def bitmask_width(vocab_size: int) -> int:
    """int32 words per mask: ceil(V / 32)."""
    return (vocab_size + 31) // 32


def token_allowed(row: np.ndarray, token: int) -> bool:
    """Host side: is `token` allowed by the int32[W] mask row?"""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def allow_token(row: np.ndarray, token: int) -> None:
    """Host side: sets `token`'s bit in the int32[W] mask row, in place."""
    row[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))


def apply_token_bitmask(logits, bitmask):
    """logits [B, J, V] -> the same with -inf where bitmask int32[B, J, ceil(V/32)] has a 0 bit
    (f32 where it masks; an all-ones row keeps its logits exactly)."""
    V = logits.shape[-1]
    v = jnp.arange(V, dtype=jnp.int32)
    words = jnp.take(bitmask, v // 32, axis=-1)                               # [B, J, V]
    allowed = (jnp.right_shift(words, v % 32) & 1).astype(bool)
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
