"""Ragged paged attention: one call for a batch mixing prefill chunks, MTP
verify segments and single-token decodes.

Kernel: `pallas_kernels._paged_core` (Pallas, Triton backend). The wrapper cuts
every sequence's query tokens into work items of <= block_q tokens (computed on
device with jnp, so per-step lengths never recompile); an item's block_q tokens
x the G query heads of one KV head form one tile.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._paged_core import pad_group, paged_core, unpad_group
from pallas_kernels.paged_reference import paged_attention_tokens, ragged_token_rows

_TUNING_KEYS = ("block_q", "pages_per_block", "num_warps", "num_stages", "small_q",
                "small_num_splits", "small_pages_per_block", "small_num_warps",
                "small_num_stages")


def _work_items(q_lens, num_tokens, block_q, select):
    """Cumulative work-item counts per sequence (items of <= block_q tokens for the
    sequences where `select` holds) and a static upper bound on their number.

    The kernel maps a program id back to (sequence, token block) itself, so this is
    the only per-step index work done outside the kernel (one small fusion).
    """
    s = q_lens.shape[0]
    n_blocks = jnp.where(select, (q_lens + block_q - 1) // block_q, 0)
    ends = jnp.cumsum(n_blocks).astype(jnp.int32)
    w_max = min(-(-num_tokens // block_q) + s, num_tokens + s)  # >= sum(ceil(len/bq))
    return ends, w_max


def ragged_paged_attention(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                           *, sm_scale=None, soft_cap=None, interpret=False, **tuning):
    """Causal paged GQA attention over a ragged batch of query tokens.

    Args:
      q: [T, H, D] bf16 or f32, tokens of all sequences flattened.
      k_pages, v_pages: [KVH, P, S, D], same dtype as q; S in 8..64, D in {64, 128}.
      block_tables: int32 [num_seqs_max, M].
      kv_lens: int32 [num_seqs_max], KV length incl. the sequence's query tokens.
      cu_q_lens: int32 [num_seqs_max + 1], cu_q_lens[0] = 0, nondecreasing; sequence s
        owns tokens cu_q_lens[s]:cu_q_lens[s+1]; its token j is at position
        kv_lens[s] - q_len_s + j (causal). Rows with position < 0 output zeros.
      num_seqs: int32 scalar or [1]; sequences past it are padding. Tokens past
        cu_q_lens[num_seqs] output zeros.
      sm_scale: default 1/sqrt(D). soft_cap: soft_cap * tanh(logits / soft_cap).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      **tuning: small_q (sequences with <= small_q tokens are decode/verify items
        of one tile each, default 8), block_q (query tokens per tile for longer
        sequences, default 64 // G rounded to a power of 2), pages_per_block
        (default 64 // S), num_warps (4), num_stages (2); small_num_splits (KV
        splits for the small items, 1), small_pages_per_block (64 // S),
        small_num_warps (4), small_num_stages (1).
    Returns:
      [T, H, D] in q's dtype.
    """
    _checks.check_ndim("q", q, 3, "[num_tokens, num_heads, head_dim]")
    t, h, d = q.shape
    _checks.check_kv(q, k_pages, v_pages, h, d)
    num_seqs = jnp.asarray(num_seqs)
    _checks.check_ragged_rows(block_tables, kv_lens, cu_q_lens, num_seqs)
    _checks.check_scalars(sm_scale, soft_cap)
    bad = set(tuning) - set(_TUNING_KEYS)
    if bad:
        raise ValueError(f"unknown tuning options {sorted(bad)}; expected {_TUNING_KEYS}")
    for key in ("block_q", "small_q"):
        if key in tuning and not 1 <= tuning[key] <= 256:
            raise ValueError(f"{key} must be in 1..256, got {tuning[key]}")
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    return _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                   num_seqs.reshape(()), sm_scale=sm_scale, soft_cap=soft_cap,
                   interpret=interpret, tuning=tuple(sorted(tuning.items())))


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "interpret", "tuning"))
def _ragged(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *, sm_scale,
            soft_cap, interpret, tuning):
    tuning = dict(tuning)
    t, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    g = h // kvh
    g_p = 1 << (g - 1).bit_length()
    s = block_tables.shape[0]
    live = jnp.arange(s, dtype=jnp.int32) < num_seqs
    q_lens = jnp.where(live, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    # Two item classes, two launches into one output buffer: sequences with
    # <= small_q tokens (decode / verify) get one small tile each (and optional
    # KV splits); longer ones (prefill chunks) get tiles of block_q tokens.
    small_q = tuning.get("small_q", 8)
    block_q = tuning.get("block_q", max(1, 64 // g_p))
    block_q = 1 << (block_q - 1).bit_length()
    qp = pad_group(q, kvh)
    common = dict(group=g, sm_scale=sm_scale, soft_cap=soft_cap, interpret=interpret)
    # Tokens past cu_q_lens[num_seqs] must read zeros. The first launch with one KV
    # split writes them itself (tail items) into an uninitialized buffer instead of
    # starting from a zero-filled one: that fill was an extra pass over the output
    # (ncu: 22 of 145 us for 4 x 512 tokens at 64/8).
    tail = jnp.stack([jnp.clip(cu_q_lens[jnp.minimum(num_seqs, s)], 0, t), jnp.int32(t)])
    small_splits = tuning.get("small_num_splits", 1)
    out = None
    if t > small_q:
        ends, w_max = _work_items(q_lens, t, block_q, q_lens > small_q)
        out = paged_core(
            qp, k_pages, v_pages, block_tables, kv_lens, q_lens, cu_q_lens, ends, w_max + 1,
            block_q=block_q,
            pages_per_block=tuning.get("pages_per_block", max(1, 64 // page_size)),
            num_splits=1, num_warps=tuning.get("num_warps", 4),
            num_stages=tuning.get("num_stages", 2), tail_bounds=tail, **common)
    # Small launch first (t <= small_q): the tail has <= small_q tokens, one item.
    small_tail = out is None and small_splits == 1
    ends, _ = _work_items(q_lens, t, small_q, q_lens <= small_q)
    out = paged_core(
        qp, k_pages, v_pages, block_tables, kv_lens, q_lens, cu_q_lens, ends,
        min(s, t) + int(small_tail),
        block_q=small_q,
        pages_per_block=tuning.get("small_pages_per_block", max(1, 64 // page_size)),
        num_splits=small_splits,
        num_warps=tuning.get("small_num_warps", 4),
        num_stages=tuning.get("small_num_stages", 1), out_init=out,
        tail_bounds=tail if small_tail else None, **common)
    return unpad_group(out, h)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap"))
def ragged_paged_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, cu_q_lens,
                                     num_seqs, *, sm_scale=None, soft_cap=None):
    """The one jnp paged attention (`pallas_kernels.paged_reference`) in this kernel's layout:
    token i of sequence s (cu_q_lens[s] <= i < cu_q_lens[s + 1], s < num_seqs) sits at position
    kv_lens[s] - q_len_s + (i - cu_q_lens[s]); tokens past the live sequences get zeros."""
    seq, pos = ragged_token_rows(cu_q_lens, kv_lens, num_seqs, q.shape[0])
    return paged_attention_tokens(q, k_pages, v_pages, block_tables, kv_lens, seq, pos,
                                  sm_scale=sm_scale, soft_cap=soft_cap, precision="highest")
