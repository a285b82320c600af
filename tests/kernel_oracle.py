"""Test helpers (numpy): random paged KV caches with NaN-poisoned unused slots and
a dense float64 causal-softmax oracle computed from each sequence's gathered KV."""
from __future__ import annotations

import math
import os

import numpy as np


def interpret_mode() -> bool:
    """Kernels run interpreted on CPU unless MTPJAX_KERNELS_ON_DEVICE=1 (GPU runs)."""
    return os.environ.get("MTPJAX_KERNELS_ON_DEVICE", "0") != "1"


def draw_seeds(case: int) -> tuple[int, ...]:
    """Random draws for case number `case` of an interpreted Mosaic-GPU kernel test: one on
    the CPU, distinct across cases (the GPU interpreter runs every warpgroup's memory ops and
    barriers through host callbacks, several seconds a call here even with its programs
    compiled once per call by tests/gpu_interpreter.py), three when the kernel runs compiled
    on a GPU."""
    return (case,) if interpret_mode() else (case, case + 10, case + 20)


def random_paged_cache(rng, kv_lens, num_kv_heads, page_size, head_dim, max_pages,
                       extra_pages=3):
    """k/v pages [KVH, P, S, D] float32 and a randomly permuted block table [N, M].

    Every slot that is not inside some sequence's first kv_len positions is NaN, as
    are whole unused pages; table entries past ceil(kv_len / S) point at random
    (NaN) pages.
    """
    n = len(kv_lens)
    num_pages = n * max_pages + extra_pages
    perm = rng.permutation(num_pages)
    bt = perm[: n * max_pages].reshape(n, max_pages).astype(np.int32)
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = np.full(shape, np.nan, np.float32)
    v = np.full(shape, np.nan, np.float32)
    for s, kv_len in enumerate(kv_lens):
        assert kv_len <= max_pages * page_size
        for pos in range(kv_len):
            pg, slot = bt[s, pos // page_size], pos % page_size
            k[:, pg, slot] = rng.standard_normal((num_kv_heads, head_dim))
            v[:, pg, slot] = rng.standard_normal((num_kv_heads, head_dim))
    # Table entries past the used pages point at arbitrary (NaN) pages.
    for s, kv_len in enumerate(kv_lens):
        used = -(-kv_len // page_size)
        spare = perm[n * max_pages:]
        for j in range(used, max_pages):
            bt[s, j] = spare[rng.integers(len(spare))]
    return k, v, bt


def dense_attention(q, k_pages, v_pages, block_table, kv_len, *, sm_scale=None,
                    soft_cap=None):
    """Oracle for ONE sequence: q [Qn, H, D] at positions kv_len - Qn + i.

    Gathers the sequence's KV into dense [kv_len, KVH, D] and runs a float64
    causal softmax row by row; rows at negative positions are zeros.
    """
    q = np.asarray(q, np.float64)
    qn, h, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    g = h // kvh
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    pos = np.arange(kv_len)
    k = np.asarray(k_pages, np.float64)[:, block_table[pos // page_size], pos % page_size]
    v = np.asarray(v_pages, np.float64)[:, block_table[pos // page_size], pos % page_size]
    out = np.zeros((qn, h, d))
    for i in range(qn):
        p_i = kv_len - qn + i
        if p_i < 0:
            continue
        for hh in range(h):
            kk, vv = k[hh // g, : p_i + 1], v[hh // g, : p_i + 1]
            s = kk @ q[i, hh] * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            w = np.exp(s - s.max())
            out[i, hh] = (w / w.sum()) @ vv
    return out


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert np.isfinite(out).all(), "non-finite values in output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


TOL = {"float32": 1e-4, "bfloat16": 2e-2}
