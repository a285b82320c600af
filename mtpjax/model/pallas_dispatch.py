"""Routes the model's paged attention to the Pallas kernels in `pallas_kernels/`.

Uniform batches (every request has q_len <= 8 contiguous queries ending at its KV length:
decode, verify, draft windows) go to `paged_attention`; everything else (prefill, mixed
engine batches) to `ragged_paged_attention`. MLA latent pages (`LatentPages.kv_views()`: one
shared KV head whose values are the first kv_lora_rank key entries) go to
`mla_paged_attention` for every batch kind: a uniform batch's q_len sets its tile's tokens
(`block_q`), a ragged batch uses `MLA_RAGGED_BLOCK_Q`. Both kernels require that request s's tokens are
contiguous at cu_q_lens[s]:cu_q_lens[s+1] and that token j sits at position
kv_lens[s] - q_len_s + j; mtpjax builds every batch that way (prompts are left-padded). Rows
whose position is negative get zeros, like the reference.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp

from mtpjax.cache import PagedBatch

MAX_UNIFORM_Q = 8
MLA_RAGGED_BLOCK_Q = 4     # query tokens per MLA tile in ragged batches (a K=3 verify row)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (8, 16, 32, 64)
_warned: set = set()


def is_latent(k_pages, v_pages) -> bool:
    """MLA latent pages: values narrower than keys (they are the keys' first entries)."""
    return v_pages is not None and v_pages.shape[-1] != k_pages.shape[-1]


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _mla_unsupported_reason(q, k_pages, v_pages, soft_cap, interpret) -> str | None:
    kvh, _, page, width = k_pages.shape
    rank = v_pages.shape[-1]
    rope = width - rank
    min_rope = 8 if interpret else 16
    if kvh != 1:
        return f"MLA latent pages with {kvh} KV heads (the MLA kernel reads one shared head)"
    if soft_cap is not None:
        return "MLA latent pages with a logit soft cap (the MLA kernel has none)"
    if not (_pow2(rank) and rank >= 16):
        return f"MLA kv_lora_rank {rank} (the MLA kernel needs a power of 2 >= 16)"
    if not (_pow2(rope) and rope >= min_rope):
        return f"MLA rope dim {rope} (the MLA kernel needs a power of 2 >= {min_rope})"
    if not (_pow2(page) and 4 <= page <= 256):
        return f"page size {page} (the MLA kernel needs a power of 2 in 4..256)"
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float32):
        return f"dtypes q {q.dtype} / cache {k_pages.dtype} (kernels need one of bf16, f32)"
    return None


def unsupported_reason(q, k_pages, v_pages=None, *, soft_cap=None,
                       interpret: bool = False) -> str | None:
    hd, page = q.shape[-1], k_pages.shape[2]
    if is_latent(k_pages, v_pages):
        return _mla_unsupported_reason(q, k_pages, v_pages, soft_cap, interpret)
    if hd not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {hd} (kernels support {SUPPORTED_HEAD_DIMS})"
    if page not in SUPPORTED_PAGE_SIZES:
        return f"page size {page} (kernels support {SUPPORTED_PAGE_SIZES})"
    if q.dtype != k_pages.dtype or q.dtype not in (jnp.bfloat16, jnp.float32):
        return f"dtypes q {q.dtype} / cache {k_pages.dtype} (kernels need one of bf16, f32)"
    return None


def paged_attention(q, k_pages, v_pages, batch: PagedBatch, *, sm_scale=None, soft_cap=None,
                    interpret: bool = False, fallback: bool = False):
    """q [N, NH, hd] -> [N, NH, hd_v] (hd_v = hd for GQA pages, kv_lora_rank for MLA latent
    pages: k_pages [1, P, S, hd], v_pages = its first hd_v entries). A shape the kernels do not support is a ValueError naming
    it, unless `fallback` (the "auto" backend): then the reference runs (warned once per reason)."""
    N, NH, hd = q.shape
    reason = unsupported_reason(q, k_pages, v_pages, soft_cap=soft_cap, interpret=interpret)
    if reason is not None:
        if not fallback:
            raise ValueError(f"the Pallas attention kernels do not support {reason}; use "
                             "attention_impl='auto' (falls back to the reference) or 'reference'")
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"Pallas attention does not support {reason}; using the reference")
        from mtpjax.model.attention import paged_attention_reference
        return paged_attention_reference(q, k_pages, v_pages, batch, sm_scale=sm_scale,
                                         soft_cap=soft_cap)
    if is_latent(k_pages, v_pages):
        return _mla(q, k_pages, v_pages, batch, sm_scale=sm_scale, interpret=interpret)
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


def _mla(q, k_pages, v_pages, batch: PagedBatch, *, sm_scale, interpret):
    """q [N, NH, R + dr] absorbed queries over latent pages k_pages [1, P, S, R + dr] (values
    v_pages = k_pages[..., :R]) -> [N, NH, R]."""
    from pallas_kernels.mla_paged_attention import mla_paged_attention as kernel
    uniform = batch.q_len is not None and batch.q_len <= MAX_UNIFORM_Q
    R = batch.block_tables.shape[0]
    return kernel(q, k_pages[0], batch.block_tables, batch.kv_lens, batch.cu_q_lens,
                  jnp.asarray([R], jnp.int32), kv_lora_rank=v_pages.shape[-1],
                  sm_scale=sm_scale, interpret=interpret,
                  block_q=batch.q_len if uniform else MLA_RAGGED_BLOCK_Q,
                  uniform_q_len=batch.q_len if uniform else None)
