"""Input checks shared by the public wrappers (shapes and dtypes only: values
are traced under jit and cannot be checked without a host sync)."""
from __future__ import annotations

import jax.numpy as jnp

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (8, 16, 32, 64)


def check_ndim(name, x, ndim, layout):
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(x.shape)}")


def check_int32(name, x):
    if jnp.dtype(x.dtype) != jnp.dtype(jnp.int32):
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_kv(q, k_pages, v_pages, num_heads, head_dim):
    check_ndim("k_pages", k_pages, 4, "[num_kv_heads, num_pages, page_size, head_dim]")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {tuple(v_pages.shape)} must equal k_pages shape "
                         f"{tuple(k_pages.shape)}")
    if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be bfloat16 or float32, got {q.dtype}")
    if k_pages.dtype != q.dtype or v_pages.dtype != q.dtype:
        raise ValueError(f"k_pages/v_pages dtype ({k_pages.dtype}/{v_pages.dtype}) must "
                         f"equal q dtype {q.dtype}")
    kvh, _, page_size, d_k = k_pages.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if d_k != head_dim:
        raise ValueError(f"k_pages head_dim {d_k} must equal q head_dim {head_dim}")
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"page_size must be one of {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if kvh < 1 or num_heads % kvh:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {kvh}")


def check_scalars(sm_scale, soft_cap):
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0 or None, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be > 0 or None, got {soft_cap}")


def check_ragged_rows(block_tables, kv_lens, cu_q_lens, num_seqs):
    """The per-sequence arrays of a ragged kernel batch: block_tables int32[S, M], kv_lens
    int32[S], cu_q_lens int32[S + 1], num_seqs an int32 scalar or [1]."""
    check_ndim("block_tables", block_tables, 2, "[max_num_seqs, max_pages]")
    check_int32("block_tables", block_tables)
    s = block_tables.shape[0]
    check_int32("kv_lens", kv_lens)
    if kv_lens.shape != (s,):
        raise ValueError(f"kv_lens shape {tuple(kv_lens.shape)} must be ({s},) "
                         f"(one per block_tables row)")
    check_int32("cu_q_lens", cu_q_lens)
    if cu_q_lens.shape != (s + 1,):
        raise ValueError(f"cu_q_lens shape {tuple(cu_q_lens.shape)} must be ({s + 1},)")
    check_int32("num_seqs", num_seqs)
    if num_seqs.shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar or shape (1,), got {tuple(num_seqs.shape)}")
