"""draft_roll: per-segment left shift of MTP draft inputs with new entries at the tail.

For a ragged batch of S segments (cu_seq_lens), segment s of length L_s becomes the
LAST L_s entries of concat(segment, new[s, :num_new[s]]). Token ids, positions and
hidden rows are rolled in one fused pass; entries past cu_seq_lens[S] pass through.
This is the shift-and-gather that vLLM's multi-layer MTP proposer does in Triton
(seed 001), written as one Pallas (Triton backend) kernel.

Output token t of segment s (j = t - cu[s], src = j + num_new[s]):
    src <  L_s: old[cu[s] + src]           src >= L_s: new[s, src - L_s]
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import _checks

_TUNING_KEYS = ("block_t", "block_h", "h_loop", "num_warps")




def _kernel(ends_ref, cu_ref, num_new_ref, tok_ref, pos_ref, hid_ref,
            new_tok_ref, new_pos_ref, new_hid_ref,
            out_tok_ref, out_pos_ref, out_hid_ref, *, block_t, block_h, h_loop, n_max,
            num_tokens, hidden_size, num_segments):
    tb = pl.program_id(0)
    hb = pl.program_id(1)
    t = tb * block_t + jnp.arange(block_t, dtype=jnp.int32)
    # Static: when block_t divides T (block_h * h_loop divides Hd) the token (column)
    # bounds masks are all-true and are left out of the loads and stores.
    mask_t = num_tokens % block_t != 0
    mask_h = hidden_size % (block_h * h_loop) != 0
    in_range = t < num_tokens
    ends = ends_ref[...]  # [S_p] segment ends, padded with INT32_MAX
    # One segment search per token block, shared by the h_loop column blocks.
    seg = jnp.sum((ends[None, :] <= t[:, None]).astype(jnp.int32), axis=1)
    live = (seg < num_segments) & in_range
    seg_c = jnp.where(live, seg, 0)
    start = plgpu.load(cu_ref.at[seg_c])
    length = plgpu.load(cu_ref.at[seg_c + 1]) - start
    src = t - start + plgpu.load(num_new_ref.at[seg_c])
    use_old = in_range & (~live | (src < length))
    use_new = live & (src >= length)
    old_idx = jnp.where(live & use_old, start + src, jnp.where(in_range, t, 0))
    new_idx = jnp.where(use_new, seg_c * n_max + src - length, 0)

    @pl.when(hb == 0)
    def _():
        for ref, new_ref, out_ref in ((tok_ref, new_tok_ref, out_tok_ref),
                                      (pos_ref, new_pos_ref, out_pos_ref)):
            old = plgpu.load(ref.at[old_idx], mask=use_old, other=0)
            new = plgpu.load(new_ref.at[new_idx], mask=use_new, other=0)
            plgpu.store(out_ref.at[pl.ds(tb * block_t, block_t)], jnp.where(use_old, old, new),
                        mask=in_range if mask_t else None)

    shape = (block_t, block_h)
    old_rows = jnp.broadcast_to(old_idx[:, None], shape)
    new_rows = jnp.broadcast_to(new_idx[:, None], shape)
    m_old = jnp.broadcast_to(use_old[:, None], shape)
    m_new = jnp.broadcast_to(use_new[:, None], shape)
    m_row = jnp.broadcast_to(in_range[:, None], shape)
    sel = jnp.broadcast_to(use_old[:, None], shape)
    for j in range(h_loop):
        c0 = (hb * h_loop + j) * block_h
        col = c0 + lax.broadcasted_iota(jnp.int32, shape, 1)
        mo, mn, ms = m_old, m_new, (m_row if mask_t else None)
        if mask_h:
            col_ok = col < hidden_size
            mo, mn = mo & col_ok, mn & col_ok
            ms = col_ok if ms is None else ms & col_ok
        old = plgpu.load(hid_ref.at[old_rows, col], mask=mo, other=0)
        new = plgpu.load(new_hid_ref.at[new_rows, col], mask=mn, other=0)
        # Stores use slices (not clamped index vectors, whose duplicates would race).
        plgpu.store(out_hid_ref.at[pl.ds(tb * block_t, block_t), pl.ds(c0, block_h)],
                    jnp.where(sel, old, new), mask=ms)


def _check(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions, new_hidden,
           num_new):
    _checks.check_ndim("tokens", tokens, 1, "[T]")
    t = tokens.shape[0]
    _checks.check_int32("tokens", tokens)
    _checks.check_int32("positions", positions)
    if positions.shape != (t,):
        raise ValueError(f"positions shape {tuple(positions.shape)} must be ({t},)")
    _checks.check_ndim("hidden", hidden, 2, "[T, hidden_size]")
    if hidden.shape[0] != t:
        raise ValueError(f"hidden rows {hidden.shape[0]} must equal len(tokens) {t}")
    _checks.check_ndim("cu_seq_lens", cu_seq_lens, 1, "[S + 1]")
    _checks.check_int32("cu_seq_lens", cu_seq_lens)
    s = cu_seq_lens.shape[0] - 1
    if s < 1:
        raise ValueError(f"cu_seq_lens must have at least 2 entries, got {cu_seq_lens.shape[0]}")
    _checks.check_ndim("new_tokens", new_tokens, 2, "[S, N]")
    _checks.check_int32("new_tokens", new_tokens)
    if new_tokens.shape[0] != s:
        raise ValueError(f"new_tokens rows {new_tokens.shape[0]} must equal S = {s} "
                         f"(len(cu_seq_lens) - 1)")
    n = new_tokens.shape[1]
    _checks.check_int32("new_positions", new_positions)
    if new_positions.shape != (s, n):
        raise ValueError(f"new_positions shape {tuple(new_positions.shape)} must be ({s}, {n})")
    if new_hidden.shape != (s, n, hidden.shape[1]):
        raise ValueError(f"new_hidden shape {tuple(new_hidden.shape)} must be "
                         f"({s}, {n}, {hidden.shape[1]})")
    if new_hidden.dtype != hidden.dtype:
        raise ValueError(f"new_hidden dtype {new_hidden.dtype} must equal hidden dtype "
                         f"{hidden.dtype}")
    _checks.check_int32("num_new", num_new)
    if num_new.shape != (s,):
        raise ValueError(f"num_new shape {tuple(num_new.shape)} must be ({s},)")


def draft_roll(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions, new_hidden,
               num_new, *, interpret=False, **tuning):
    """Rolls each segment left by num_new[s] and appends new[s, :num_new[s]].

    Args:
      tokens, positions: int32 [T]. hidden: [T, Hd] (any float dtype).
      cu_seq_lens: int32 [S + 1] segment boundaries (cu[0] = 0, nondecreasing).
      new_tokens, new_positions: int32 [S, N]. new_hidden: [S, N, Hd].
      num_new: int32 [S], 0 <= num_new <= N (not checked: traced values).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      **tuning: block_t (tokens per program, 4), block_h (hidden columns per program,
        min(1024, next_pow2(Hd))), h_loop (column blocks per program, 1),
        num_warps (4).
    Returns:
      (tokens, positions, hidden) with the input shapes and dtypes.
    """
    _check(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions, new_hidden,
           num_new)
    bad = set(tuning) - set(_TUNING_KEYS)
    if bad:
        raise ValueError(f"unknown tuning options {sorted(bad)}; expected {_TUNING_KEYS}")
    return _draft_roll(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions,
                       new_hidden, num_new, interpret=interpret,
                       tuning=tuple(sorted(tuning.items())))


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def _draft_roll(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions, new_hidden,
                num_new, *, interpret, tuning):
    tuning = dict(tuning)
    t, hd = hidden.shape
    s, n = new_tokens.shape
    block_t = tuning.get("block_t", 4)
    block_h = tuning.get("block_h", min(1024, pl.next_power_of_2(hd)))
    s_p = pl.next_power_of_2(s)
    ends = jnp.full((s_p,), jnp.iinfo(jnp.int32).max, jnp.int32).at[:s].set(cu_seq_lens[1:])
    h_loop = max(1, min(tuning.get("h_loop", 1), pl.cdiv(hd, block_h)))
    kernel = functools.partial(_kernel, block_t=block_t, block_h=block_h, h_loop=h_loop, n_max=n,
                               num_tokens=t, hidden_size=hd, num_segments=s)

    def full(shape):
        return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

    args = (ends, cu_seq_lens, num_new, tokens, positions, hidden,
            new_tokens.reshape(s * n), new_positions.reshape(s * n),
            new_hidden.reshape(s * n, hd))
    out_shape = (jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32),
                 jax.ShapeDtypeStruct((t, hd), hidden.dtype))
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(t, block_t), pl.cdiv(hd, block_h * h_loop)),
        in_specs=[full(a.shape) for a in args],
        out_specs=[full(o.shape) for o in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.get("num_warps", 4),
                                             num_stages=1),
        interpret=interpret,
        name="draft_roll",
    )(*args)


@jax.jit
def draft_roll_reference(tokens, positions, hidden, cu_seq_lens, new_tokens, new_positions,
                         new_hidden, num_new):
    """Plain-jnp draft_roll (the XLA path); same semantics as `draft_roll`."""
    t = tokens.shape[0]
    s, n = new_tokens.shape
    idx = jnp.arange(t, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_seq_lens[1:], idx, side="right",
                           method="compare_all").astype(jnp.int32)
    live = seg < s
    seg_c = jnp.where(live, seg, 0)
    start = cu_seq_lens[seg_c]
    length = cu_seq_lens[seg_c + 1] - start
    src = idx - start + num_new[seg_c]
    use_old = ~live | (src < length)
    old_idx = jnp.where(live & use_old, start + src, idx)
    new_j = jnp.clip(src - length, 0, n - 1)

    def roll(old, new):
        o = old[old_idx]
        nw = new[seg_c, new_j]
        sel = use_old.reshape(use_old.shape + (1,) * (old.ndim - 1))
        return jnp.where(sel, o, nw)

    return roll(tokens, new_tokens), roll(positions, new_positions), roll(hidden, new_hidden)
