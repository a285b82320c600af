"""The draft-input roll: per-request shift of the MTP modules' cached inputs.

After a verify step commits `num_new[b]` tokens, request b's window of cached draft inputs
(token ids and target hidden states of its last W positions, seed 001's "cached prev tokens /
hidden states") drops its `num_new[b]` oldest entries and takes the new ones at its tail.
A kernel backend (`pallas`, `pallas_interpret`) runs the fused kernel in `pallas_kernels.draft_roll` on the flattened batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def roll_window(window: jax.Array, new: jax.Array, num_new: jax.Array) -> jax.Array:
    """window [B, W, ...], new [B, N, ...], num_new int32[B] in [0, N] -> [B, W, ...].

    Row b becomes the last W entries of concat(window[b], new[b, :num_new[b]]).
    """
    B, W = window.shape[:2]
    cat = jnp.concatenate([window, new.astype(window.dtype)], axis=1)        # [B, W+N, ...]
    idx = num_new[:, None] + jnp.arange(W)[None, :]                           # [B, W]
    idx = idx.reshape(idx.shape + (1,) * (window.ndim - 2))
    return jnp.take_along_axis(cat, idx, axis=1)


def roll_draft_inputs(tokens, hidden, new_tokens, new_hidden, num_new, *, backend):
    """Rolls the token window int32[B, W] and hidden window [B, W, E] together."""
    if backend.uses_kernels:
        from pallas_kernels.draft_roll import draft_roll
        B, W = tokens.shape
        N = new_tokens.shape[1]
        cu = jnp.arange(B + 1, dtype=jnp.int32) * W
        pos = jnp.zeros((B * W,), jnp.int32)
        t, _, h = draft_roll(tokens.reshape(-1), pos, hidden.reshape(B * W, -1), cu, new_tokens,
                             jnp.zeros((B, N), jnp.int32), new_hidden, num_new,
                             interpret=backend.interpret)
        return t.reshape(B, W), h.reshape(hidden.shape)
    return roll_window(tokens, new_tokens, num_new), roll_window(hidden, new_hidden, num_new)
