"""MLA paged attention as a Pallas Mosaic-GPU (Hopper warpgroup) kernel, absorbed form, bf16.

Why a second kernel: the Triton one (`kernel.py`) holds a [64, 512] f32 accumulator in one
CTA's registers, and at H=128 computes at ~170 of ~750 TFLOP/s (docs/kernels.md). Here, as in
FlashMLA (deepseek-ai/FlashMLA, docs/20250422-new-kernel-deep-dive.md), a CTA runs three
warpgroups on one tile of 64 query rows:

    wg 0     logits: q . latent^T for a KV block ([64, block_kv], 576 deep, wgmma from shared
             memory), the causal mask and the online softmax; hands P (bf16) and the
             rescale alpha to wg 1 through shared memory (share_logits; without it wg 1
             computes the same logits itself) and accumulates P . c_kv[:, :R/2].
    wg 1     accumulates P . c_kv[:, R/2:]. Each accumulator is [64, R/2] f32.
    wg 2     memory: TMA-copies the latent blocks (one copy per page a block touches) into a
             ring of `num_stages` shared-memory slots, reusing a slot when both compute
             warpgroups have released it.

Rows of a tile: token r // block_h, head r % block_h of one work item (<= block_q query tokens
of one sequence, folded into the rows like the Triton kernel, so verify reads the KV once).
The wrapper (`mosaic_tiles.py`) gathers the queries of a ragged batch into tiles and the
outputs back; a uniform batch (decode, verify) the kernel reads and writes in place,
token-major (`tile_views`).

Layouts (n = tiles, R = kv_lora_rank, W = R + dr):
    q_tiles      [n, rows, W] bf16  rows <= 64, a multiple of 8 (the tile's live rows); or a
                 uniform batch token-major, [S, block_q, H, W] (tile i: sequence
                 tile_seq[i], heads of group i % (H / block_h); no tiles built)
    latent       [P, S, W]  bf16    the paged latent cache
    block_tables [num_seqs, M] int32
    tile_seq     [n] int32  the tile's sequence
    tile_pos0    [n] int32  KV position of the tile's first query token
    tile_ntok    [n] int32  query tokens in the tile (0: a padding tile, nothing computed)
    out          [n, splits, rows, R] bf16   (normalized per split; token-major:
                                             [splits, S, block_q, H, R])
    lse          [n, splits, rows] f32       (log2-sum-exp of the scaled logits, per split)

Profile (`mla_tiles_mgpu`'s `profile`, compiled only): Mosaic GPU's on-device profiler records,
per warpgroup and KV block, the named regions "logits" (wg 0: the slot wait and the QK
product), "softmax" (wg 0), "wait_p" (wg 1: the slot and P waits), "wait_slot" (memory
warpgroup: the slot's release) and "load" (memory warpgroup: a wait on the block's copies
that only the profile adds, to time them); `mtpjax.bench.mla_profile` reads the trace. The
regions are named scopes, so without a profile the kernel is the same.

Causality: row r (token j = r // block_h) sees KV positions 0 .. pos0 + j; the blocks every
row sees in full come first and build no mask. The KV rows past
the tile's last position in its last block are zeroed in shared memory (each warpgroup its
value half) before P . V: masked logits give p = 0, but 0 * NaN from an unwritten slot is NaN.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir.dialects import llvm, nvvm   # no public module for these (JAX 0.10-0.11)
from jax.extend.mlir import ir
from jax.extend.mlir.dialects import arith, scf, vector

from pallas_kernels._hopper import interpret_params

LOG2E = math.log2(math.e)
TILE_ROWS = 64          # one wgmma M; queries of a tile
LAZY_MAX = 8.0         # log2 units: P <= 2^8 against a running max that may lag
MASKED = -1e30          # finite: a row with no visible key in a split gets weight 0, not NaN
EXP2_EMULATED = 4       # of each wg 0 thread's 32 exp2s per block: on the FMA units, not MUFU
# (offloads the MUFU, which limits wg 0's softmax; 8 measured no better: docs/kernels.md)
# exp2 on [0, 1): FlashAttention-4's cubic (max relative error 8.8e-5; P is bf16, 2^-9)
EXP2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
             0.077119089663028717041015625)


def _accumulate(acc, p16, values, interpret, then=None):
    """acc [64, R/2] f32 + p16 [64, block_kv] (registers or shared memory) . values
    [block_kv, R/2] (shared memory); then() (stores, barrier arrivals), if given, runs
    after the wgmma's issue and before its wait."""
    if interpret:   # the GPU interpreter has no run_state rule nor register wgmma operands
        p = p16 if isinstance(p16, jax.Array) else p16[...]
        out = acc + jnp.dot(p, values[...], preferred_element_type=jnp.float32)
        if then is not None:
            then()
        return out

    def into(ref):
        plgpu.wgmma(ref, p16, values)
        if then is not None:
            then()
    return pl.run_state(into)(plgpu.ACC.init(acc))


def _logits(q_smem, keys, interpret):
    """q [64, W] . keys [block_kv, W]^T -> [64, block_kv] f32, both in shared memory."""
    if interpret:   # the GPU interpreter's wgmma takes no transposed operand
        return jnp.dot(q_smem[...], keys[...].T, preferred_element_type=jnp.float32)

    def run(ref):
        plgpu.wgmma(ref, q_smem, plgpu.transpose_ref(keys, (1, 0)))
        plgpu.wgmma_wait(0)
        return ref[...]
    return pl.run_scoped(run, plgpu.ACC((q_smem.shape[0], keys.shape[0]), jnp.float32))


def _rescaled(acc, alpha, interpret):
    """acc [64, C] f32 * alpha [64] (per row), the multiplies skipped by each thread whose
    rows all have alpha == 1: with the lazy running max (`LAZY_MAX`) that is nearly every
    block, and the 128 multiplies per thread otherwise sit between the softmax and the
    value product, with the tensor cores idle."""
    if interpret:
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
        return_type=plgpu.ShapeDtypeStruct(acc.shape, jnp.float32, layout=plgpu.Layout.WGMMA))
    def per_thread(ctx, acc, alpha):
        del ctx
        one = arith.constant(ir.F32Type.get(), 1.0)
        needed = None
        for reg in alpha.registers.flat:
            elems = [reg]
            if isinstance(reg.type, ir.VectorType):
                elems = [vector.extract(reg, dynamic_position=[],
                                        static_position=ir.DenseI64ArrayAttr.get([i]))
                         for i in range(ir.VectorType(reg.type).shape[0])]
            for e in elems:     # != 1, or NaN
                ne = arith.cmpf(arith.CmpFPredicate.UNE, e, one)
                needed = ne if needed is None else arith.ori(needed, ne)
        regs = list(acc.registers.flat)
        branch = scf.IfOp(needed, [r.type for r in regs], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scaled = acc * alpha.broadcast_minor(acc.shape[1])
            scf.yield_(list(scaled.registers.flat))
        with ir.InsertionPoint(branch.else_block):
            scf.yield_(regs)
        out = np.empty(acc.registers.shape, dtype=object)
        out.flat[:] = list(branch.results)
        return mgpu.FragmentedArray(_registers=out, _layout=acc.layout, _is_signed=None)

    return per_thread(acc, alpha)


def exp2_poly(x):
    """2^x [any shape] f32 as the kernel's emulated exp2 computes it (`_EXP2_PTX`), for the
    interpreter and the tests: x clamped to >= -127, split into floor n and fraction f,
    the cubic of f, and n added to its exponent bits."""
    xc = jnp.maximum(x, -127.0)
    n = jnp.floor(xc)
    f = xc - n
    c0, c1, c2, c3 = (jnp.float32(c) for c in EXP2_POLY)
    p = (f * c3 + c2) * f + c1
    p = p * f + c0
    bits = lax.bitcast_convert_type(p, jnp.int32) + (n.astype(jnp.int32) << 23)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _f32(value):
    """A PTX f32 literal."""
    return "0f%08X" % np.float32(value).view(np.uint32)


# floor(x) by an add that rounds down against 1.5 * 2^23 (no FRND, which is not an FMA-unit
# instruction): the integer sits in the sum's low mantissa bits, so `shl 23` puts it into
# the exponent field of the cubic's value in [1, 2).
_EXP2_PTX = f"""{{
.reg .f32 xc, r, rb, f, p;
.reg .b32 e, pb;
max.f32 xc, $1, {_f32(-127.0)};
add.rm.f32 r, xc, {_f32(1.5 * 2**23)};
sub.f32 rb, r, {_f32(1.5 * 2**23)};
sub.f32 f, xc, rb;
fma.rn.f32 p, f, {_f32(EXP2_POLY[3])}, {_f32(EXP2_POLY[2])};
fma.rn.f32 p, p, f, {_f32(EXP2_POLY[1])};
fma.rn.f32 p, p, f, {_f32(EXP2_POLY[0])};
mov.b32 e, r;
mov.b32 pb, p;
shl.b32 e, e, 23;
add.s32 pb, pb, e;
mov.b32 $0, pb;
}}"""


def _exp2_split(x, interpret):
    """exp2 of x [64, C] f32 (WGMMA layout) with each thread's first EXP2_EMULATED values
    as a polynomial on the FMA units, the rest on MUFU.EX2. Those are the first 8 columns:
    a thread's first two registers hold 2 of columns 0-7 in each of its rows r and r + 8,
    and its quad of threads covers the 8. MUFU issues 4 lanes a cycle per SM
    sub-partition against 32 for an FFMA, and wg 0's 32 exp2s per block sit on its serial
    path (FlashAttention-4 splits them the same way)."""
    if interpret:
        col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
        return jnp.where(col < 2 * EXP2_EMULATED, exp2_poly(x), jnp.exp2(x))

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=plgpu.Layout.WGMMA))
    def per_thread(ctx, x):
        del ctx
        # Mosaic's own per-element lifting of a PTX instruction over vector registers (what
        # FragmentedArray.exp2(approx=True) uses for MUFU.EX2).
        lift = mgpu.FragmentedArray._lift_fast_instr
        poly = lift(lambda e: llvm.inline_asm(ir.F32Type.get(), [e], _EXP2_PTX, "=f,f"))
        mufu = lift("ex2.approx.ftz.f32")
        per_reg = x.layout.vector_length
        assert EXP2_EMULATED % per_reg == 0, (EXP2_EMULATED, per_reg)
        out = np.empty(x.registers.shape, dtype=object)
        out.flat[:] = [poly(r) if k < EXP2_EMULATED // per_reg else mufu(r)
                       for k, r in enumerate(x.registers.flat)]
        return mgpu.FragmentedArray(_registers=out, _layout=x.layout, _is_signed=None)

    return per_thread(x)


def _fence_for_wgmma(interpret):
    """Makes this thread's shared-memory writes visible to wgmma (the async proxy) without
    commit_smem's warpgroup barrier: every thread arrives on the hand-over barrier after
    its own fence (128 arrivals per warpgroup), so no thread needs to wait for the others."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    fence()


def _full(shape, value, layout, interpret):
    x = jnp.full(shape, value, jnp.float32)
    return x if interpret else plgpu.layout_cast(x, layout)   # no CPU rule for layout_cast


def _load_rows(ref, interpret):
    """A [64] f32 vector from shared memory in the layout of the logits' row statistics."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


def _iota(shape, dim, interpret):
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def zero_rows_past(values, k0, kv_end, interpret):
    """Zeroes in place the rows of a shared-memory value block [bk, C] (first KV position k0)
    at or past kv_end: unwritten or spare pages may hold NaN, and 0 * NaN is NaN."""
    v = values[...]
    rows = _iota(v.shape, 0, interpret) + k0
    values[...] = jnp.where(rows < kv_end, v, jnp.zeros_like(v))
    plgpu.commit_smem()


def kv_block_pages(lat_ref, bt_ref, seq, k0, *, block_kv, page_size):
    """The (page, first row) of each page piece of KV positions k0 .. k0 + block_kv - 1 of
    sequence `seq` (one per page the block touches)."""
    copies = max(1, block_kv // page_size)
    rows = min(block_kv, page_size)
    max_entry = jnp.int32(bt_ref.shape[1] - 1)
    num_pages = lat_ref.shape[0]
    out = []
    for j in range(copies):
        tok = k0 + j * rows
        # The last block may run past the table (its rows past kv_end are masked): clamp
        # the entry, and the page id, into range.
        entry = jnp.minimum(lax.div(tok, jnp.int32(page_size)), max_entry)
        page = jnp.clip(bt_ref[seq, entry], 0, num_pages - 1)
        out.append((page, lax.rem(tok, jnp.int32(page_size))))
    return out


def copy_kv_block(lat_ref, pages, ring, slot, barrier, *, rows):
    """TMA-copies the page pieces `pages` ((page, first row) each, from `kv_block_pages`;
    `rows` rows each) of the paged latent cache into ring[slot] [block_kv, W], each copy
    arriving on `barrier`."""
    for j, (page, row0) in enumerate(pages):
        src = (page, pl.ds(row0, rows))
        plgpu.copy_gmem_to_smem(lat_ref.at[src], ring.at[slot, pl.ds(j * rows, rows)], barrier)


def _rows(ref, row0, rows):
    """ref[row0 : row0 + rows] (whole 8-row tiles of a swizzled buffer are contiguous)."""
    return ref if (row0, rows) == (0, ref.shape[0]) else ref.at[pl.ds(row0, rows)]


def token_major(ref, tile_rank):
    """Does an HBM query/output array hold a uniform batch token-major ([S, block_q, H, ...],
    `tile_rank` + 1 dims) rather than as tiles ([n, ..., rows, C], `tile_rank` dims)?"""
    return ref.ndim == tile_rank + 1


def tile_live_rows(q_ref, block_h):
    """Query rows a tile holds in HBM: a tile array's rows, or block_q x block_h."""
    return q_ref.shape[1] * (block_h if token_major(q_ref, 3) else 1)


def tile_views(ref, tile, seq, block_h, split=None):
    """A tile's rows in an HBM array, as [(first tile row, cols -> [rows, cols] view)]: one
    piece of a tile array (q [n, rows, W]; out [n, splits, rows, R] with `split`), or one
    piece per query token of a token-major array (q [S, block_q, H, W]; out [splits, S,
    block_q, H, R]): the block_h heads of group tile % (H / block_h). Reading and writing a
    uniform batch token-major spares the two transposes that tiles would cost around the
    kernel (a tenth of an H=128 verify step)."""
    if not token_major(ref, 3 if split is None else 4):
        lead = (tile,) if split is None else (tile, split)
        return [(0, lambda cols: ref.at[(*lead, slice(None), cols)])]
    lead = (seq,) if split is None else (split, seq)
    groups = ref.shape[-2] // block_h
    heads = pl.ds(lax.rem(tile, jnp.int32(groups)) * block_h, block_h)
    return [(j * block_h, lambda cols, j=j: ref.at[(*lead, j, heads, cols)])
            for j in range(ref.shape[-3])]


def query_copies(q):
    """TMA copies a tile's query load takes per column range (see `copy_query`)."""
    return q.shape[1] if token_major(q, 3) else 1


def copy_query(q_ref, cols, smem, barrier, tile, seq, block_h):
    """TMA-copies columns `cols` of a tile's query rows into smem [64, C] (its first live
    rows), `query_copies` copies each arriving on `barrier`."""
    for row0, view in tile_views(q_ref, tile, seq, block_h):
        src = view(cols)
        plgpu.copy_gmem_to_smem(src, _rows(smem, row0, src.shape[0]), barrier)


def store_tile(stage, lse_rows, out_ref, lse_ref, tile, split, seq, wg, live, block_h):
    """Stores a warpgroup's staged output half [64, R/2] into its columns of the tile's
    first `live` rows (`tile_views`), and from wg 0 the staged log2-sum-exp rows [64], then
    waits for the copies."""
    half = stage.shape[1]
    plgpu.commit_smem()
    for row0, view in tile_views(out_ref, tile, seq, block_h, split):
        dst = view(pl.ds(wg * half, half))
        plgpu.copy_smem_to_gmem(_rows(stage, row0, dst.shape[0]), dst)

    @pl.when(wg == 0)
    def _():
        plgpu.copy_smem_to_gmem(_rows(lse_rows, 0, live), lse_ref.at[tile, split])

    plgpu.wait_smem_to_gmem(0)


def tile_blocks(tile_seq_ref, tile_pos0_ref, tile_ntok_ref, *, block_kv, num_splits):
    """This CTA's work in a (tile, split) grid: (tile, split, seq, pos0, kv_end, first_step,
    steps): the tile's sequence, the KV position of its first query token, its KV end
    (positions 0 .. kv_end - 1; 0 for a padding tile), and the split's first block and
    block count."""
    tile = lax.axis_index("tile")
    split = lax.axis_index("split")
    seq = tile_seq_ref[tile]
    pos0 = tile_pos0_ref[tile]
    ntok = tile_ntok_ref[tile]
    kv_end = jnp.where(ntok > 0, pos0 + ntok, 0)
    total_steps = lax.div(kv_end + (block_kv - 1), jnp.int32(block_kv))
    per_split = lax.div(total_steps + (num_splits - 1), jnp.int32(num_splits))
    first_step = split * per_split
    steps = jnp.clip(total_steps - first_step, 0, per_split)
    return tile, split, seq, pos0, kv_end, first_step, steps


def visible_keys(shape, k0, pos0, block_h, interpret):
    """The causal mask of a logits block [64, bk] whose first key is KV position k0: row r
    (token r // block_h, at position pos0 + r // block_h) sees keys at or before it."""
    row_tok = lax.div(_iota(shape, 0, interpret), jnp.int32(block_h))
    return (_iota(shape, 1, interpret) + k0) <= (row_tok + pos0)


def lazy_max(m_prev, block_max):
    """The lazy running max: it moves only when a block's max exceeds it by more than
    LAZY_MAX, so P <= 2^LAZY_MAX and most blocks need no rescale (`_rescaled`): fewer
    multiplies on wg 0's serial softmax path."""
    return jnp.where(block_max > m_prev + LAZY_MAX, block_max, m_prev)


def rescale_factor(m_old, m_new):
    """exp2(m_old - m_new), exactly 1 where the max did not move (`_rescaled` skips it)."""
    return jnp.where(m_new == m_old, 1.0, jnp.exp2(m_old - m_new))


def check_tiles(q_tiles, latent, rank, block_kv, block_h, num_tiles):
    """The Mosaic MLA kernel's checks of its query inputs: tiles [n, rows, W], or a uniform
    batch token-major [S, block_q, H, W] (S x H / block_h tiles)."""
    width = q_tiles.shape[-1]
    page_size = latent.shape[1]
    if token_major(q_tiles, 3):
        s, _, h = q_tiles.shape[:3]
        if block_h % 8 or h % block_h or num_tiles != s * (h // block_h):
            raise ValueError(f"token-major queries [S, block_q, H, W] = {q_tiles.shape} need "
                             f"block_h a multiple of 8 dividing H and S * H / block_h tiles, "
                             f"got block_h {block_h} and {num_tiles} tiles")
    elif not (q_tiles.ndim == 3 and q_tiles.shape[0] == num_tiles):
        raise ValueError(f"queries must be tiles [n, rows, W] or token-major [S, block_q, H, "
                         f"W], with n = {num_tiles} tiles, got {q_tiles.shape}")
    rows = tile_live_rows(q_tiles, block_h)
    if not (8 <= rows <= TILE_ROWS and rows % 8 == 0):
        raise ValueError(f"q_tiles must hold a multiple of 8 rows, at most {TILE_ROWS}, per "
                         f"tile, got {rows}")
    if q_tiles.dtype != jnp.bfloat16 or latent.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic-GPU MLA kernel takes bfloat16, got {q_tiles.dtype} / "
                         f"{latent.dtype}")
    if width % 64 or rank % 128:
        raise ValueError(f"width {width} must be a multiple of 64 and kv_lora_rank {rank} of "
                         f"128 (64-column swizzled tiles, two value halves)")
    if block_kv % 8 or block_kv % min(block_kv, page_size) or min(block_kv, page_size) % 8:
        raise ValueError(f"block_kv {block_kv} and page_size {page_size}: a block must be "
                         f"whole 8-row pieces of pages")


def run_tiles(kernel, scratch, barriers, args, *, num_splits, rank, block_h, num_threads,
              interpret, profile=None):
    """Launches a Mosaic MLA kernel over a (tile, split) grid, warpgroups named "wg":
    kernel(*refs, (scratch refs, barrier refs)) with refs = tile_seq, tile_pos0, tile_ntok,
    block_tables, q, latent (inputs; `args`) then out, lse -> (out bf16, lse [n, splits, rows]
    f32); out is [n, splits, rows, R] for tiles q [n, rows, W], [splits, S, block_q, H, R]
    for token-major q [S, block_q, H, W]."""
    q = args[4]
    n, rows = args[0].shape[0], tile_live_rows(q, block_h)
    out_shape = ((num_splits, *q.shape[:3], rank) if token_major(q, 3)
                 else (n, num_splits, rows, rank))

    def entry(*refs):
        pl.run_scoped(lambda *scoped: kernel(*refs, scoped), scratch, barriers,
                      collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(out_shape, jnp.bfloat16),
                  jax.ShapeDtypeStruct((n, num_splits, rows), jnp.float32)),
        grid=(n, num_splits), grid_names=("tile", "split"),
        num_threads=num_threads, thread_name="wg",
        # The row max/sum reductions stay inside a warp (WGMMA layout): no cross-warp
        # scratch, whose default 2 KiB the shared-logits buffers need.
        # No automatic warpgroup barriers around shared-memory stores: Mosaic puts one
        # before and one after each, five per KV block on wg 0's path to its P . V. They
        # order a warpgroup's threads against each other; here no thread reads what
        # another thread of its warpgroup stores except through wgmma or a TMA store,
        # which follow commit_smem (zeroed value rows, staged outputs) or an mbarrier every
        # thread arrives on (P, alpha, l); the automatic barriers were pure serial cost.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, reduction_scratch_bytes=0, unsafe_no_auto_barriers=True,
            **({} if profile is None else dict(profile_dir=profile[0],
                                               profile_space=profile[1]))),
        interpret=interpret_params() if interpret else None,
    )(*args)


def _kernel(tile_seq_ref, tile_pos0_ref, tile_ntok_ref, bt_ref, q_ref, lat_ref,
            out_ref, lse_ref, scoped, *, block_h, block_kv, rank, num_splits, num_stages,
            page_size, scale_log2, share_logits, zero_masked, interpret, profile):
    (q_smem, p_smem, (kv_smem, o_stage), lse_smem, alpha_smem), bars = scoped
    q_bar, kv_bars, consumed_bars, done_bar, p_ready, p_free = bars
    tile, split, seq, pos0, kv_end, first_step, steps = tile_blocks(
        tile_seq_ref, tile_pos0_ref, tile_ntok_ref, block_kv=block_kv, num_splits=num_splits)
    wg = lax.axis_index("wg")
    half = rank // 2
    live = tile_live_rows(q_ref, block_h)   # rows a tile holds in HBM (<= 64; the rest idle)
    rows_layout = plgpu.Layout.WGMMA.reduce(1)

    def values_of(slot, k0, final):
        """This warpgroup's value half of a KV slot [block_kv, R/2]. In the final step its
        rows past kv_end are zeroed in place first (unwritten slots may hold NaN, and
        0 * NaN is NaN); the other warpgroup may read those rows' logits meanwhile: they
        are masked either way."""
        values = kv_smem.at[slot, :, pl.ds(wg * half, half)]
        if final:
            zero_rows_past(values, k0, kv_end, interpret)
        return values

    def softmax_step(s, k0, m_i, l_i, masked):
        """Masked (if `masked`), scaled logits [64, block_kv] -> (p, alpha, m_new, l_new),
        online."""
        if masked:      # index tiles built here: not 64 registers held across the loop
            visible = visible_keys(s.shape, k0, pos0, block_h, interpret)
            s = jnp.where(visible, s * scale_log2, MASKED)
            m_new = lazy_max(m_i, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            if zero_masked:     # a row with no visible key: l = 0, output 0, weight 0
                p = jnp.where(visible, p, 0.0)
        else:
            # The max of the raw logits (the scale is > 0, so max(s) * c == max(s * c)
            # exactly), and the scale inside exp2's argument, where it fuses into one FFMA
            # with the subtraction: 32 fewer multiplies per thread on wg 0's serial path.
            m_new = lazy_max(m_i, s.max(axis=1) * scale_log2)
            p = _exp2_split(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]),
                            interpret)
        alpha = rescale_factor(m_i, m_new)
        return p, alpha, m_new, l_i * alpha + p.sum(axis=1)

    def block_softmax(i, m_i, l_i, masked):
        """Step i's slot (waited for), first KV position, and softmax of its logits."""
        slot = lax.rem(i, jnp.int32(num_stages))
        k0 = (first_step + i) * block_kv
        with jax.named_scope("logits"):
            plgpu.barrier_wait(kv_bars.at[slot])
            s = _logits(q_smem, kv_smem.at[slot], interpret)
        with jax.named_scope("softmax"):
            return (slot, k0) + softmax_step(s, k0, m_i, l_i, masked)

    def scaled(acc, alpha):
        return _rescaled(acc, alpha, interpret)

    def run_steps(step, carry):
        """Steps 0 .. steps - 2, then the final one (which zeroes the rows past kv_end). The
        steps whose block every row sees in full (global blocks below (pos0 + 1) //
        block_kv) run first and build no causal mask; the rest (a suffix) mask, so only the
        tail pays for the mask."""
        unmasked = jnp.clip(lax.div(pos0 + 1, jnp.int32(block_kv)) - first_step, 0,
                            jnp.maximum(steps - 1, 0))
        carry = lax.fori_loop(0, unmasked, functools.partial(step, final=False, masked=False),
                              carry)
        carry = lax.fori_loop(unmasked, steps - 1,
                              functools.partial(step, final=False, masked=True), carry)
        return lax.cond(steps > 0, lambda c: step(steps - 1, c, final=True, masked=True),
                        lambda c: c, carry)

    # share_logits: wg 0 computes each block's logits and softmax once and hands P (and the
    # rescale alpha) to wg 1 through shared memory (p_smem, alpha_smem; barriers p_ready,
    # p_free): the tensor cores do the 576-deep QK product once per block, not once per
    # warpgroup. Otherwise both warpgroups compute it.

    @pl.when(wg < 2)
    def _compute():
        # 240 + 240 + 24 = 3 x 168, the registers a thread gets at launch (64K for 384
        # threads, rounded down to 8). At 232 / 40, ptxas reloaded 8 spilled values a block
        # in wg 0's loop; at 240 / 24, 3 (the memory warpgroup needs few).
        plgpu.set_max_registers(240, action="increase")

        @pl.when(wg == 0)
        def _():
            copy_query(q_ref, pl.ds(0, q_ref.shape[-1]), q_smem, q_bar, tile, seq, block_h)

        plgpu.barrier_wait(q_bar)
        acc = _full((TILE_ROWS, half), 0.0, plgpu.Layout.WGMMA, interpret)
        m_i = _full((TILE_ROWS,), MASKED, rows_layout, interpret)
        l_i = _full((TILE_ROWS,), 0.0, rows_layout, interpret)

        def finish(acc, m_f, l_safe):
            """Normalize, stage in shared memory, store (m_f None: wg 1 with shared logits,
            whose l wg 0 leaves in alpha_smem)."""
            # Both warpgroups are past their last read of the KV ring, which o_stage aliases.
            plgpu.barrier_arrive(done_bar)
            plgpu.barrier_wait(done_bar)
            if m_f is None:
                l_safe = _load_rows(alpha_smem, interpret)
            acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            stage = o_stage.at[wg]
            stage[...] = acc.astype(stage.dtype)
            if m_f is not None:
                @pl.when(wg == 0)
                def _():
                    lse_smem[...] = m_f + jnp.log2(l_safe)

            store_tile(stage, lse_smem, out_ref, lse_ref, tile, split, seq, wg, live, block_h)

        if not share_logits:
            def step(i, carry, *, final, masked):
                acc, m_i, l_i = carry
                slot, k0, p, alpha, m_new, l_new = block_softmax(i, m_i, l_i, masked)
                acc = _accumulate(scaled(acc, alpha), p.astype(q_smem.dtype),
                                  values_of(slot, k0, final), interpret)
                plgpu.barrier_arrive(consumed_bars.at[slot])
                return acc, m_new, l_new

            acc, m_f, l_f = run_steps(step, (acc, m_i, l_i))
            finish(acc, m_f, jnp.where(l_f > 0, l_f, 1.0))
            return

        @pl.when(wg == 0)
        def _producer():
            def step(i, carry, *, final, masked):
                acc, m_i, l_i = carry
                slot, k0, p, alpha, m_new, l_new = block_softmax(i, m_i, l_i, masked)
                p16 = p.astype(q_smem.dtype)

                @pl.when(i > 0)
                def _():
                    plgpu.barrier_wait(p_free)     # wg 1 is done with the last P and alpha

                def hand_over():
                    p_smem[...] = p16
                    alpha_smem[...] = alpha
                    _fence_for_wgmma(interpret)     # wg 1's wgmma reads P after p_ready
                    plgpu.barrier_arrive(p_ready)

                # P . V's wgmma is issued first and the hand-over runs while it computes:
                # wg 0 reads its P from registers, so only wg 1 waits for the stores.
                # The row sums stay before it: their FADDs hide behind the exp2s.
                acc = _accumulate(scaled(acc, alpha), p16, values_of(slot, k0, final),
                                  interpret, then=hand_over)
                plgpu.barrier_arrive(consumed_bars.at[slot])
                return acc, m_new, l_new

            acc_f, m_f, l_f = run_steps(step, (acc, m_i, l_i))
            l_safe = jnp.where(l_f > 0, l_f, 1.0)

            @pl.when(steps > 0)
            def _():
                plgpu.barrier_wait(p_free)

            alpha_smem[...] = l_safe               # wg 1 reads it after done_bar
            plgpu.commit_smem()
            finish(acc_f, m_f, l_safe)

        @pl.when(wg == 1)
        def _consumer():
            def step(i, acc, *, final, masked):
                del masked          # wg 1 takes P as wg 0 masked it
                slot = lax.rem(i, jnp.int32(num_stages))
                k0 = (first_step + i) * block_kv
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(kv_bars.at[slot])
                    plgpu.barrier_wait(p_ready)
                acc = scaled(acc, _load_rows(alpha_smem, interpret))
                acc = _accumulate(acc, p_smem, values_of(slot, k0, final), interpret)
                plgpu.barrier_arrive(p_free)
                plgpu.barrier_arrive(consumed_bars.at[slot])
                return acc

            finish(run_steps(step, acc), None, None)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(24, action="decrease")     # the minimum setmaxnreg takes

        @pl.loop(0, steps)
        def _(i):
            slot = lax.rem(i, jnp.int32(num_stages))
            # The block-table loads go before the slot wait: their global-memory latency
            # then passes while the slot is still in use, not after its release (most
            # at page 16: four loads a block).
            pages = kv_block_pages(lat_ref, bt_ref, seq, (first_step + i) * block_kv,
                                   block_kv=block_kv, page_size=page_size)

            with jax.named_scope("wait_slot"):
                @pl.when(i >= num_stages)
                def _():
                    plgpu.barrier_wait(consumed_bars.at[slot])

            copy_kv_block(lat_ref, pages, kv_smem, slot, kv_bars.at[slot],
                          rows=min(block_kv, page_size))
            if profile:     # the copies' latency (the compute warpgroups wait too, later)
                with jax.named_scope("load"):
                    plgpu.barrier_wait(kv_bars.at[slot])

        # Observe the last releases too (nothing waits on them otherwise; JAX's GPU
        # interpreter checks that every phase of a barrier was seen).
        @pl.loop(jnp.maximum(steps - num_stages, 0), steps)
        def _(i):
            plgpu.barrier_wait(consumed_bars.at[lax.rem(i, jnp.int32(num_stages))])


def mla_tiles_mgpu(q_tiles, latent, block_tables, tile_seq, tile_pos0, tile_ntok, *, rank,
                   block_h, sm_scale, block_kv=64, num_splits=1, num_stages=2,
                   share_logits=True, zero_masked=False, interpret=False, profile=None):
    """Runs the kernel over [n, rows, W] query tiles -> (out [n, splits, rows, R] bf16,
    lse [n, splits, rows] f32), rows <= 64 a multiple of 8: the tile's first rows (a tile of
    fewer than 64 live rows need not be padded in HBM). Or over a uniform batch token-major,
    q [S, block_q, H, W] (tile i: sequence tile_seq[i], heads of group i % (H / block_h))
    -> (out [splits, S, block_q, H, R], lse as for tiles). zero_masked: rows that see no key
    (in a split, or at all) output exactly 0 with log2-sum-exp -1e30, so callers need not
    mask them. profile: None, or (directory, events): the on-device profiler's trace of each
    call into the directory (Perfetto JSON), with room for `events` regions per warpgroup
    (two a KV block on wg 0, and up to two of Mosaic's own; the events take the shared
    memory's last ~1 KiB, 19 at the default shapes, so 8 KV blocks). See the module
    docstring for the regions and the layouts."""
    check_tiles(q_tiles, latent, rank, block_kv, block_h, tile_seq.shape[0])
    if profile is not None and (interpret or not isinstance(profile, (tuple, list))
                                or len(profile) != 2 or not isinstance(profile[1], int)
                                or profile[1] < 1):
        raise ValueError(f"profile must be None or (directory, events >= 1), compiled only, "
                         f"got {profile!r} with interpret={interpret}")
    if not sm_scale > 0:    # the softmax takes the max of the unscaled logits
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    width = q_tiles.shape[-1]
    page_size = latent.shape[1]
    swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = functools.partial(
        _kernel, block_h=block_h, block_kv=block_kv, rank=rank, num_splits=num_splits,
        num_stages=num_stages, page_size=page_size, scale_log2=float(sm_scale) * LOG2E,
        share_logits=share_logits, zero_masked=zero_masked, interpret=interpret,
        profile=profile is not None)
    copies = max(1, block_kv // page_size)

    ring = plgpu.SMEM((num_stages, block_kv, width), jnp.bfloat16, transforms=swizzled)
    output = plgpu.SMEM((2, TILE_ROWS, rank // 2), jnp.bfloat16, transforms=swizzled)
    # The KV ring, then (after the loop) the output halves, in the same shared memory. The
    # interpreter has no RefUnion (nor a shared-memory limit): two buffers there.
    ring_then_output = (ring, output) if interpret else plgpu.RefUnion(ring, output)

    # share_logits: P [64, block_kv] bf16 and a [64] f32 row vector (alpha, then l) handed
    # from wg 0 to wg 1, with a barrier each way. Swizzled buffers first: each is 1024-byte
    # aligned, and with both options the total is within 2.5 KiB of the 227 KiB limit.
    rows_f32 = plgpu.SMEM((TILE_ROWS,), jnp.float32)

    return run_tiles(
        kernel,
        (plgpu.SMEM((TILE_ROWS, width), jnp.bfloat16, transforms=swizzled),
         plgpu.SMEM((TILE_ROWS, block_kv), jnp.bfloat16, transforms=swizzled)
         if share_logits else None,
         ring_then_output,
         rows_f32,
         rows_f32 if share_logits else None),
        (plgpu.Barrier(num_arrivals=query_copies(q_tiles)),
         plgpu.Barrier(num_arrivals=copies, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
         plgpu.Barrier(num_arrivals=2),
         plgpu.Barrier() if share_logits else None,
         plgpu.Barrier() if share_logits else None),
        (tile_seq, tile_pos0, tile_ntok, block_tables, q_tiles, latent),
        num_splits=num_splits, rank=rank, block_h=block_h, num_threads=3, interpret=interpret,
        profile=None if profile is None else (str(profile[0]), int(profile[1])))
