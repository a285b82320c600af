"""Routes the model's paged attention to the Pallas kernels in `pallas_kernels/`.

Uniform batches (every request has q_len <= 8 contiguous queries ending at its KV length:
decode, verify, draft windows) go to `paged_attention`; everything else (prefill, mixed
engine batches) to `ragged_paged_attention`. Both kernels require that request s's tokens are
contiguous at cu_q_lens[s]:cu_q_lens[s+1] and that token j sits at position
kv_lens[s] - q_len_s + j; mtpjax builds every batch that way (prompts are left-padded). Rows
whose position is negative get zeros, like the reference.
"""

from __future__ import annotations

import jax.numpy as jnp

from mtpjax.cache import PagedBatch

MAX_UNIFORM_Q = 8


def paged_attention(q, k_pages, v_pages, batch: PagedBatch, *, sm_scale=None, soft_cap=None,
                    interpret: bool = False):
    """q [N, NH, hd] -> [N, NH, hd]."""
    N, NH, hd = q.shape
    if batch.q_len is not None and batch.q_len <= MAX_UNIFORM_Q:
        from pallas_kernels.paged_attention import paged_attention as kernel
        R, T = batch.block_tables.shape[0], batch.q_len
        out = kernel(q.reshape(R, T, NH, hd), k_pages, v_pages, batch.block_tables,
                     batch.kv_lens, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)
        return out.reshape(N, NH, hd)
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention as kernel
    R = batch.block_tables.shape[0]
    return kernel(q, k_pages, v_pages, batch.block_tables, batch.kv_lens, batch.cu_q_lens,
                  jnp.asarray([R], jnp.int32), sm_scale=sm_scale, soft_cap=soft_cap,
                  interpret=interpret)
