"""Paged attention for decode (Q = 1) and MTP verify (Q = K + 1 <= 8) batches.

Kernel: `pallas_kernels._paged_core` (Pallas, Triton backend). Each batch row b
is one work item: its Q query tokens x the G = H/KVH query heads of one KV head
form one tile, so every K/V page is read once per (request, KV head, split).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._device import num_sms
from pallas_kernels._paged_core import pad_group, paged_core, unpad_group
from pallas_kernels.paged_reference import paged_attention_rows

MAX_Q = 8
_TUNING_KEYS = ("pages_per_block", "num_splits", "num_warps", "num_stages", "direct_items")


def _default_num_splits(batch, num_kv_heads, max_pages, pages_per_block):
    """Split the KV so that small batches still fill the GPU (~2 waves)."""
    programs = batch * num_kv_heads
    splits = 1
    while programs * splits * 2 <= 2 * num_sms() and splits * 2 * pages_per_block <= max_pages:
        splits *= 2
    return splits


def paged_attention(q, k_pages, v_pages, block_tables, kv_lens, *, sm_scale=None,
                    soft_cap=None, interpret=False, **tuning):
    """Causal paged GQA attention of Q query tokens per request.

    Args:
      q: [B, Q, H, D] bf16 or f32, 1 <= Q <= 8.
      k_pages, v_pages: [KVH, P, S, D], same dtype as q; S in 8..64, D in {64, 128}.
      block_tables: int32 [B, M], page ids of each request.
      kv_lens: int32 [B], KV length INCLUDING the Q query tokens (already written).
        Query i sits at position kv_lens[b] - Q + i and sees KV 0..that position.
        Rows whose position is < 0 output zeros.
      sm_scale: logit scale, default 1/sqrt(D).
      soft_cap: if set, logits become soft_cap * tanh(logits / soft_cap)
        (applied after sm_scale).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      **tuning: pages_per_block (KV pages per inner step, default 64 // S; 128 // S
        for tiles of >= 32 rows, Q * G_p), num_splits (KV splits; default from
        batch size), num_warps (4; 8 for tiles of >= 32 rows),
        num_stages (1: no shared-memory pipelining; measured best on H100, see
        docs/kernels.md), direct_items (True: one work item per request, no
        in-kernel item search and no output memset; False is the ragged path).
    Returns:
      [B, Q, H, D] in q's dtype (accumulation in f32).
    """
    _checks.check_ndim("q", q, 4, "[batch, q_len, num_heads, head_dim]")
    b, q_len, h, d = q.shape
    if not 1 <= q_len <= MAX_Q:
        raise ValueError(f"q_len (q.shape[1]) must be in 1..{MAX_Q}, got {q_len}")
    _checks.check_kv(q, k_pages, v_pages, h, d)
    _checks.check_ndim("block_tables", block_tables, 2, "[batch, max_pages]")
    _checks.check_int32("block_tables", block_tables)
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables batch {block_tables.shape[0]} must equal q batch {b}")
    _checks.check_int32("kv_lens", kv_lens)
    if kv_lens.shape != (b,):
        raise ValueError(f"kv_lens shape {tuple(kv_lens.shape)} must be ({b},)")
    _checks.check_scalars(sm_scale, soft_cap)
    bad = set(tuning) - set(_TUNING_KEYS)
    if bad:
        raise ValueError(f"unknown tuning options {sorted(bad)}; expected {_TUNING_KEYS}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    return _paged_attention(q, k_pages, v_pages, block_tables, kv_lens, sm_scale=sm_scale,
                            soft_cap=soft_cap, interpret=interpret,
                            tuning=tuple(sorted(tuning.items())))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret", "tuning"))
def _paged_attention(q, k_pages, v_pages, block_tables, kv_lens, *, sm_scale, soft_cap,
                     interpret, tuning):
    tuning = dict(tuning)
    b, q_len, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    m = block_tables.shape[1]
    # Tiles of >= 32 rows (Q * G_p, e.g. Q=4 at G=8) need ~175 registers/thread at
    # 4 warps and 64-token KV blocks: 2 CTAs/SM, 1.94 waves at B=64, KVH=8 (ncu, H100).
    # 8 warps and 128-token blocks measured faster there (docs/kernels.md).
    g_p = 1 << (h // kvh - 1).bit_length()
    rows = g_p * (1 << (max(q_len, -(-16 // g_p)) - 1).bit_length())
    big = rows >= 32
    ppb = tuning.get("pages_per_block", max(1, (128 if big else 64) // page_size))
    ppb = max(1, min(ppb, 1 << (m - 1).bit_length()))
    splits = tuning.get("num_splits") or _default_num_splits(b, kvh, m, ppb)
    items = jnp.arange(b + 1, dtype=jnp.int32)  # one work item per request
    out = paged_core(
        pad_group(q.reshape(b * q_len, h, d), kvh), k_pages, v_pages, block_tables, kv_lens,
        jnp.full((b,), q_len, jnp.int32), items * q_len, items[1:], b,
        group=h // kvh, block_q=q_len, pages_per_block=ppb, num_splits=splits, sm_scale=sm_scale,
        soft_cap=soft_cap, num_warps=tuning.get("num_warps", 8 if big else 4),
        num_stages=tuning.get("num_stages", 1), interpret=interpret,
        direct_items=tuning.get("direct_items", True))
    return unpad_group(out, h).reshape(b, q_len, h, d)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap"))
def paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, *,
                              sm_scale=None, soft_cap=None):
    """The one jnp paged attention (`pallas_kernels.paged_reference`) in this kernel's layout:
    q [B, Q, H, D], the Q queries of row b at positions kv_lens[b] - Q .. kv_lens[b] - 1."""
    q_len = q.shape[1]
    positions = kv_lens[:, None] - q_len + jnp.arange(q_len)[None, :]   # [B, Q]
    return paged_attention_rows(q, k_pages, v_pages, block_tables, kv_lens, positions,
                                sm_scale=sm_scale, soft_cap=soft_cap, precision="highest")
