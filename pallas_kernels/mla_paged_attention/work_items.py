"""Work items of both MLA kernels: a ragged batch cut into runs of <= block_q query tokens of
one sequence (each read the sequence's KV once for all of its tokens)."""
from __future__ import annotations

import jax.numpy as jnp


def item_ends(cu_q_lens, num_seqs, block_q):
    """(q_lens int32[S]: each live sequence's query tokens, 0 past num_seqs; item_ends
    int32[S]: cumulative item counts, ceil(q_len / block_q) items per sequence)."""
    s = cu_q_lens.shape[0] - 1
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    return q_lens, jnp.cumsum((q_lens + block_q - 1) // block_q).astype(jnp.int32)


def max_items(num_tokens: int, num_seqs_max: int, block_q: int) -> int:
    """Static bound on the items: each has >= 1 token, and sum(ceil(len / block_q)) <=
    (T + S * (block_q - 1)) / block_q."""
    return max(1, min(num_tokens, (num_tokens + num_seqs_max * (block_q - 1)) // block_q))
