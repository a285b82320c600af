"""Attention routes: per cache (page) kind, how its paged attention runs.

A route names the kind's plain-jnp reference, its Pallas kernels, and the ONE rule that says
whether the kernels serve a shape (`unsupported_reason`: None, or the shape they do not serve,
worded to follow "the Pallas attention kernels do not support ..."). The choice between them is
`AttentionBackend.paged_attention` (model/backend.py), the one dispatch.

    pages        reference                            Pallas kernels
    GQAPages     paged_attention_reference (k, v)     paged_attention: uniform batches
                                                      (q_len <= MAX_UNIFORM_Q); else
                                                      ragged_paged_attention
    LatentPages  paged_attention_reference over the   mla_paged_attention on the latent
                 latent as one shared KV head, values directly, every batch kind (block_q =
                 its first `rank` entries             a uniform batch's q_len, else
                                                      MLA_RAGGED_BLOCK_Q)

Both kernels require that request s's tokens are contiguous at cu_q_lens[s]:cu_q_lens[s+1] and
that token j sits at position kv_lens[s] - q_len_s + j; mtpjax builds every batch that way
(prompts are left-padded). Rows whose position is negative get zeros, like the reference.
A new attention kind registers its route with `register_route`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from mtpjax.cache import PagedBatch
from mtpjax.model.attention import paged_attention_reference
from mtpjax.model.gqa import GQAPages
from mtpjax.model.mla import LatentPages

MAX_UNIFORM_Q = 8
MLA_RAGGED_BLOCK_Q = 4     # query tokens per MLA tile in ragged batches (a K=3 verify row)
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_PAGE_SIZES = (8, 16, 32, 64)
KERNEL_DTYPES = (jnp.bfloat16, jnp.float32)


@dataclasses.dataclass(frozen=True)
class AttentionRoute:
    """How one page kind's paged attention runs: q [N, NH, hd] -> [N, NH, hd_v]."""

    pages_type: type
    reference: Callable            # (q, pages, batch, *, sm_scale) -> [N, NH, hd_v]
    kernel: Callable               # (q, pages, batch, *, sm_scale, interpret) -> [N, NH, hd_v]
    unsupported_reason: Callable   # (q, pages, batch, *, interpret) -> str | None
    num_kv_heads: Callable         # pages -> int: KV heads a mesh may split (1: one shared)


ROUTES: dict[type, AttentionRoute] = {}


def register_route(route: AttentionRoute) -> AttentionRoute:
    ROUTES[route.pages_type] = route
    return route


def attention_route(pages) -> AttentionRoute:
    """The route of this pages object's type; ValueError naming the type otherwise."""
    route = ROUTES.get(type(pages))
    if route is None:
        raise ValueError(f"no attention route for pages of type {type(pages).__name__}; "
                         f"routes exist for {sorted(t.__name__ for t in ROUTES)}")
    return route


def _uniform(batch: PagedBatch) -> bool:
    return batch.q_len is not None and batch.q_len <= MAX_UNIFORM_Q


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _dtype_reason(q, cache_dtype) -> str | None:
    if q.dtype != cache_dtype or q.dtype not in KERNEL_DTYPES:
        return f"dtypes q {q.dtype} / cache {cache_dtype} (kernels need one of bf16, f32)"
    return None


# ---------------------------------------------------------------- GQA pages: k, v [KVH, P, S, hd]

def gqa_reference(q, pages: GQAPages, batch: PagedBatch, *, sm_scale=None):
    return paged_attention_reference(q, pages.k, pages.v, batch, sm_scale=sm_scale)


def gqa_unsupported_reason(q, pages: GQAPages, batch: PagedBatch, *,
                           interpret: bool = False) -> str | None:
    hd, page = q.shape[-1], pages.page_size
    if hd not in SUPPORTED_HEAD_DIMS:
        return f"head_dim {hd} (kernels support {SUPPORTED_HEAD_DIMS})"
    if page not in SUPPORTED_PAGE_SIZES:
        return f"page size {page} (kernels support {SUPPORTED_PAGE_SIZES})"
    return _dtype_reason(q, pages.k.dtype)


def gqa_kernel(q, pages: GQAPages, batch: PagedBatch, *, sm_scale=None, interpret=False):
    """Uniform batches: `paged_attention` on [R, q_len] rows; others: `ragged_paged_attention`."""
    N, NH, hd = q.shape
    R = batch.block_tables.shape[0]
    if _uniform(batch):
        from pallas_kernels.paged_attention import paged_attention as kernel
        T = batch.q_len
        out = kernel(q.reshape(R, T, NH, hd), pages.k, pages.v, batch.block_tables,
                     batch.kv_lens, sm_scale=sm_scale, soft_cap=None, interpret=interpret)
        return out.reshape(N, NH, hd)
    from pallas_kernels.ragged_paged_attention import ragged_paged_attention as kernel
    return kernel(q, pages.k, pages.v, batch.block_tables, batch.kv_lens, batch.cu_q_lens,
                  jnp.asarray([R], jnp.int32), sm_scale=sm_scale, soft_cap=None,
                  interpret=interpret)


GQA_ROUTE = register_route(AttentionRoute(
    pages_type=GQAPages, reference=gqa_reference, kernel=gqa_kernel,
    unsupported_reason=gqa_unsupported_reason, num_kv_heads=lambda pages: pages.k.shape[0]))


# ---------------------------------------------------------------- MLA pages: latent [P, S, R + dr]

def mla_reference(q, pages: LatentPages, batch: PagedBatch, *, sm_scale=None):
    """q [N, NH, R + dr] absorbed queries -> [N, NH, R]: the latent read as one shared KV head
    whose values are its first R = rank entries."""
    k = pages.latent[None]
    return paged_attention_reference(q, k, k[..., :pages.rank], batch, sm_scale=sm_scale)


def mla_unsupported_reason(q, pages: LatentPages, batch: PagedBatch, *,
                           interpret: bool = False) -> str | None:
    rank, page = pages.rank, pages.page_size
    rope = pages.latent.shape[-1] - rank
    min_rope = 8 if interpret else 16
    if not (_pow2(rank) and rank >= 16):
        return f"MLA kv_lora_rank {rank} (the MLA kernel needs a power of 2 >= 16)"
    if not (_pow2(rope) and rope >= min_rope):
        return f"MLA rope dim {rope} (the MLA kernel needs a power of 2 >= {min_rope})"
    if not (_pow2(page) and 4 <= page <= 256):
        return f"page size {page} (the MLA kernel needs a power of 2 in 4..256)"
    return _dtype_reason(q, pages.latent.dtype)


def mla_kernel(q, pages: LatentPages, batch: PagedBatch, *, sm_scale=None, interpret=False):
    """q [N, NH, R + dr] absorbed queries over the latent pages -> [N, NH, R]."""
    from pallas_kernels.mla_paged_attention import mla_paged_attention as kernel
    uniform = _uniform(batch)
    R = batch.block_tables.shape[0]
    return kernel(q, pages.latent, batch.block_tables, batch.kv_lens, batch.cu_q_lens,
                  jnp.asarray([R], jnp.int32), kv_lora_rank=pages.rank,
                  sm_scale=sm_scale, interpret=interpret,
                  block_q=batch.q_len if uniform else MLA_RAGGED_BLOCK_Q,
                  uniform_q_len=batch.q_len if uniform else None)


MLA_ROUTE = register_route(AttentionRoute(
    pages_type=LatentPages, reference=mla_reference, kernel=mla_kernel,
    unsupported_reason=mla_unsupported_reason, num_kv_heads=lambda pages: 1))
