"""MLA (DeepSeek-V2/V3 multi-head latent attention) paged attention, absorbed form, over a
ragged batch: decode rows (q_len 1), MTP verify rows (q_len K+1, causal inside the row) and
prefill chunks in one call.

Every token of the cache holds one latent vector [c_kv (R) | k_rope (dr)] shared by all heads.
Head h's absorbed query q[t, h] = [q_nope W_UK (R) | q_rope (dr)] scores against the whole
latent; its output is the softmax-weighted sum of the c_kv parts (the values are the first R
latent entries). Output [T, H, R]; the caller applies W_UV.

Kernels: `kernel_mgpu.py` (Pallas Mosaic GPU: Hopper warpgroups, TMA and wgmma; bf16; the
default on Hopper GPUs) and `kernel.py` (Pallas Triton: any dtype, any GPU, and what
interpreted runs take by default). Both cut every sequence's query tokens into work items of
<= block_q tokens (on device, with jnp: per-step lengths never recompile); an item's tokens x
block_h heads form one tile, so a verify row's K+1 tokens read the latent pages once.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pallas_kernels import _checks
from pallas_kernels._device import HOPPER_SMEM_BYTES, num_sms
from pallas_kernels._hopper import on_hopper
from pallas_kernels.paged_reference import paged_attention_tokens, ragged_token_rows
from pallas_kernels.mla_paged_attention.kernel import mla_core
from pallas_kernels.mla_paged_attention.mosaic_tiles import mla_mosaic
from pallas_kernels.mla_paged_attention.work_items import item_ends, max_items

_TUNING_KEYS = ("block_q", "block_h", "block_k", "num_splits", "num_warps", "num_stages",
                "value_split", "qk_chunk", "keys_first", "kernel", "share_logits", "compact",
                "seesaw")
_MOSAIC_FLAGS = ("share_logits", "compact", "seesaw")   # bool options of kernel="mosaic" only
KERNELS = ("triton", "mosaic")
MAX_ROWS = 64   # default tile rows (block_q * block_h): a [64, 512] f32 accumulator


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs, rank, interpret):
    _checks.check_ndim("q", q, 3, "[num_tokens, num_heads, kv_lora_rank + rope_dim]")
    _checks.check_ndim("latent_pages", latent, 3,
                       "[num_pages, page_size, kv_lora_rank + rope_dim]")
    if jnp.dtype(q.dtype) not in _checks.SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be bfloat16 or float32, got {q.dtype}")
    if latent.dtype != q.dtype:
        raise ValueError(f"latent_pages dtype {latent.dtype} must equal q dtype {q.dtype}")
    width = q.shape[2]
    if latent.shape[2] != width:
        raise ValueError(f"latent_pages width {latent.shape[2]} must equal q width {width} "
                         f"(kv_lora_rank + rope_dim)")
    if not isinstance(rank, int) or not (_pow2(rank) and rank >= 16):
        raise ValueError(f"kv_lora_rank must be a power of 2 >= 16, got {rank!r}")
    rope = width - rank
    min_rope = 8 if interpret else 16  # Triton's dot needs K >= 16; the interpreter does not
    if not (_pow2(rope) and rope >= min_rope):
        raise ValueError(f"rope_dim = width {width} - kv_lora_rank {rank} = {rope} must be a "
                         f"power of 2 >= {min_rope}")
    page_size = latent.shape[1]
    if not (_pow2(page_size) and 4 <= page_size <= 256):
        raise ValueError(f"page_size must be a power of 2 in 4..256, got {page_size}")
    _checks.check_ragged_rows(block_tables, kv_lens, cu_q_lens, num_seqs)


def _splits_and_scale(num_splits, sm_scale, width) -> float:
    """Checks num_splits and sm_scale (both kernels); -> the scale (default width ** -0.5)."""
    if not 1 <= num_splits <= 256:
        raise ValueError(f"num_splits must be in 1..256, got {num_splits}")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"sm_scale must be > 0 or None, got {sm_scale}")
    return width ** -0.5 if sm_scale is None else float(sm_scale)


def _decode_sized(block_q: int, block_h: int) -> bool:
    """Is a tile of block_q x block_h rows decode-sized (<= 16 rows: H=16 decode)?"""
    return block_q * block_h <= 16


def _tile(num_heads, block_q):
    """(block_q rounded up to a power of 2, block_h: the largest power of 2 dividing H that
    keeps block_q * block_h <= 64 rows)."""
    block_q = 1 << (max(1, block_q) - 1).bit_length()
    h_div = num_heads & -num_heads                        # largest power of 2 dividing H
    return block_q, max(1, min(h_div, MAX_ROWS // block_q))


def _splits(num_tokens, num_heads, num_seqs, max_pages, page_size, block_h, block_k, waves):
    """KV splits (a power of 2) for ~`waves` waves of CTAs over the SMs, each split >= 4 KV
    blocks long."""
    items = min(num_seqs, num_tokens) * (num_heads // block_h)
    splits = 1
    while (items * splits * 2 <= waves * num_sms()
           and splits * 2 * block_k * 4 <= max_pages * page_size):
        splits *= 2
    return splits


def default_tuning(num_tokens, num_heads, num_seqs, max_pages, page_size, block_q=1):
    """Tile, block and split sizes (H100 sweeps at B=64, ctx 4096, 576/512, docs/kernels.md).

    rows = block_q * block_h <= 64 (a [64, 512] f32 accumulator is half the register file).
    Decode-sized tiles (<= 16 rows): 4 warps, no software pipelining, KV splits for ~2 waves
    over the SMs. Larger tiles: 8 warps, 2 pipeline stages, splits for ~1 wave (one CTA per SM
    fits). Both: 32-token KV blocks with the logits computed keys first (None here: on unless
    value_split or qk_chunk is given, or a decode-sized tile's block spans several pages:
    that tile loads its block piecewise, and keys first is much slower there; everywhere else
    it beat 64-token blocks query first on the H100 and H200, docs/kernels.md).
    """
    block_q, block_h = _tile(num_heads, block_q)
    small = _decode_sized(block_q, block_h)
    block_k = 32
    splits = _splits(num_tokens, num_heads, num_seqs, max_pages, page_size, block_h, block_k,
                     waves=2 if small else 1)
    return dict(block_q=block_q, block_h=block_h, block_k=block_k, num_splits=splits,
                num_warps=4 if small else 8, num_stages=1 if small else 2, value_split=1,
                qk_chunk=None, keys_first=None)


def mla_paged_attention(q, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs, *,
                        kv_lora_rank, sm_scale=None, interpret=False, uniform_q_len=None,
                        **tuning):
    """Causal absorbed-form MLA attention over a paged latent cache, ragged batch.

    Args:
      q: [T, H, R + dr] bf16 or f32: [q_nope W_UK | q_rope] per token and head, tokens of all
        sequences flattened. R = kv_lora_rank (power of 2 >= 16), dr = rope dim (power of 2,
        >= 16 compiled, >= 8 interpreted).
      latent_pages: [P, S, R + dr], same dtype: per token [c_kv | k_rope]. S a power of 2 in
        4..256.
      block_tables: int32 [num_seqs_max, M] page ids per sequence.
      kv_lens: int32 [num_seqs_max], KV length incl. the sequence's query tokens (written).
      cu_q_lens: int32 [num_seqs_max + 1], cu_q_lens[0] = 0, nondecreasing; sequence s owns
        tokens cu_q_lens[s]:cu_q_lens[s+1]; its token j sits at position kv_lens[s] - q_len + j
        and sees KV 0..position. Rows with position < 0 output zeros.
      num_seqs: int32 scalar or [1]; sequences past it are padding. Tokens no live sequence
        owns (past cu_q_lens[num_seqs], or of padding sequences) output zeros.
      kv_lora_rank: R (static): values are the first R latent entries.
      sm_scale: logit scale, default (R + dr) ** -0.5 (MLA models pass theirs).
      interpret: run the Pallas kernel interpreted (CPU tests).
      **tuning: block_q (query tokens per tile, rounded up to a power of 2; default 1: the
        dispatch passes the q_len of a uniform batch), block_h (heads per tile, default
        min(64 // block_q, largest power of 2 dividing H)), block_k (KV tokens per inner step),
        num_splits (KV splits), num_warps, num_stages: defaults in `default_tuning`.
        value_split (programs per tile, each owning R / value_split output columns and
        recomputing the logits; default 1) and qk_chunk (latent columns per QK dot, loaded
        piecewise; default R): opt-in ways to cut live registers (docs/kernels.md: the
        64-row tiles spill); both measured slower on the H100. keys_first (logits computed
        as latent . q^T, so wgmma reads the query from shared memory instead of holding it
        in registers; default on, except with value_split or qk_chunk, or for a decode-
        sized tile whose KV block spans several pages: `default_tuning`).
        kernel: "triton" (`kernel.py`), "mosaic" (`kernel_mgpu.py`: Hopper warpgroups, bf16;
        takes block_q, block_h, block_k (a multiple of 64), num_splits, num_stages,
        share_logits, compact (`mosaic_tiles.py`: tiles of only their live rows; default
        on with uniform_q_len) and seesaw (`kernel_seesaw.py`: FlashMLA's two-warpgroup
        schedule; 64 rope columns, block_k 64); defaults in `mosaic_tuning`) or None:
        `default_kernel` ("mosaic" on a Hopper GPU where it fits).
      uniform_q_len: None, or q when every sequence has exactly q tokens at q * s (T =
        num_seqs_max * q; decode and verify steps): with compact tiles and block_q == q the
        Mosaic kernel reads q and writes the output in place, token-major (tiles by
        reshape where a tile's heads are not a multiple of 8). The caller vouches for it
        (values are not checked under jit); the Triton kernel ignores it.
    Returns:
      [T, H, R] in q's dtype (softmax and accumulation in f32).
    """
    num_seqs = jnp.asarray(num_seqs)
    _check(q, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs, kv_lora_rank, interpret)
    bad = set(tuning) - set(_TUNING_KEYS)
    if bad:
        raise ValueError(f"unknown tuning options {sorted(bad)}; expected {_TUNING_KEYS}")
    t, h, width = q.shape
    if tuning.get("kernel") is None:
        tuning["kernel"] = default_kernel(q, latent_pages, kv_lora_rank, interpret)
    if tuning["kernel"] not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {tuning['kernel']!r}")
    if tuning["kernel"] == "mosaic":
        return _mosaic(q, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                       kv_lora_rank, sm_scale, interpret, uniform_q_len, tuning)
    tuning.pop("kernel")
    for key in _MOSAIC_FLAGS:
        if key in tuning:
            raise ValueError(f"{key} is an option of kernel='mosaic', not of the Triton kernel")
    full = default_tuning(t, h, block_tables.shape[0], block_tables.shape[1],
                          latent_pages.shape[1], tuning.get("block_q", 1))
    full.update(tuning)
    if not 1 <= full["block_q"] <= 256:
        raise ValueError(f"block_q must be in 1..256, got {full['block_q']}")
    full["block_q"] = 1 << (full["block_q"] - 1).bit_length()   # a power of 2 (Triton tiles)
    for key in ("block_q", "block_h", "block_k"):
        if not (_pow2(full[key]) and full[key] <= 256):
            raise ValueError(f"{key} must be a power of 2 in 1..256, got {full[key]}")
    if h % full["block_h"]:
        raise ValueError(f"block_h {full['block_h']} must divide num_heads {h}")
    if full["block_k"] < 16 and not interpret:
        raise ValueError(f"block_k must be >= 16 compiled (Triton dot), got {full['block_k']}")
    vs, qc = full["value_split"], full["qk_chunk"]
    if not (_pow2(vs) and kv_lora_rank % vs == 0 and kv_lora_rank // vs >= 16):
        raise ValueError(f"value_split must be a power of 2 leaving >= 16 of kv_lora_rank="
                         f"{kv_lora_rank} columns per program, got {vs}")
    if qc is not None and not (_pow2(qc) and 16 <= qc <= kv_lora_rank):
        raise ValueError(f"qk_chunk must be None or a power of 2 in 16..kv_lora_rank="
                         f"{kv_lora_rank}, got {qc}")
    keys_first_fits = vs == 1 and qc in (None, kv_lora_rank)
    if full["keys_first"] is None:     # the default, where the other options allow it
        full["keys_first"] = keys_first_fits and not (
            _decode_sized(full["block_q"], full["block_h"])
            and latent_pages.shape[1] < full["block_k"])
    if full["keys_first"] not in (True, False, 0, 1):
        raise ValueError(f"keys_first must be a bool, got {full['keys_first']!r}")
    full["keys_first"] = bool(full["keys_first"])
    if full["keys_first"] and not keys_first_fits:
        raise ValueError(f"keys_first takes value_split=1 and no qk_chunk, got value_split={vs}"
                         f", qk_chunk={qc}")
    sm_scale = _splits_and_scale(full["num_splits"], sm_scale, width)
    return _mla(q, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs.reshape(()),
                rank=kv_lora_rank, sm_scale=sm_scale, interpret=interpret,
                tuning=tuple(sorted(full.items())))


def default_kernel(q, latent, rank, interpret) -> str:
    """"mosaic" on a Hopper GPU where its shapes fit (bf16, kv_lora_rank % 128 == 0, width %
    64 == 0, pages >= 8 tokens), else "triton". Interpreted runs take the Triton kernel:
    its interpreter is far faster; tests ask for kernel="mosaic" explicitly. The environment
    variable MTPJAX_MLA_KERNEL (triton / mosaic) overrides it, for end-to-end A/B runs."""
    forced = os.environ.get("MTPJAX_MLA_KERNEL")   # end-to-end A/B runs (docs/benchmarks.md)
    if forced is not None:
        if forced not in KERNELS:
            raise ValueError(f"MTPJAX_MLA_KERNEL must be one of {KERNELS}, got {forced!r}")
        return forced
    if interpret or q.dtype != jnp.bfloat16 or rank % 128 or q.shape[2] % 64 or (
            latent.shape[1] < 8):
        return "triton"
    return "mosaic" if on_hopper() else "triton"


def mosaic_tuning(num_tokens, num_heads, num_seqs, max_pages, page_size, block_q=1):
    """Tiles and splits of the Mosaic-GPU kernel: 64-row tiles (block_q * block_h <= 64),
    64-token KV blocks (wgmma's K for the values), 2 shared-memory stages (what fits beside
    the query tile: 3 x 72 KiB), KV splits for ~1 wave over the SMs (one CTA per SM).
    compact None: on for uniform batches (`uniform_q_len` given: decode and verify steps),
    off otherwise: compact tiles skip the padding rows a 64-row tile of a small H carries
    (no gain at H=128 verify, whose tiles are full either way).
    seesaw None: `_seesaw_default`."""
    block_q, block_h = _tile(num_heads, block_q)
    splits = _splits(num_tokens, num_heads, num_seqs, max_pages, page_size, block_h,
                     block_k=64, waves=1)
    return dict(block_q=block_q, block_h=block_h, block_k=64, num_splits=splits,
                num_stages=2, share_logits=True, compact=None, seesaw=None)


def _seesaw_default(full, uniform_q_len, num_heads, rope, page_size) -> bool:
    """FlashMLA's schedule (`kernel_seesaw.py`) where it was measured faster: uniform steps
    of several query tokens whose rows per sequence (q_len x H) make the step compute-bound
    (>= 256: each KV block serves >= 4 tiles, ~2 FLOPs a latent byte per row against the
    H100's ~270 FLOPs a byte), whose tiles need no KV split, and whose pages hold a whole
    64-token block (one TMA copy a half block: the seesaw's compute warpgroups issue their
    own loads, block-table reads included, while the split kernel's memory warpgroup hides
    page 16's four). Measured faster only at H=128 verify at page 64; slower at page 16,
    at H=128 decode and at H=16 (docs/benchmarks.md, kernels)."""
    return (uniform_q_len is not None and uniform_q_len > 1 and uniform_q_len * num_heads >= 256
            and full["num_splits"] == 1 and rope == 64 and full["block_k"] == 64
            and page_size >= 64)


def _mosaic(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs, rank, sm_scale,
            interpret, uniform_q_len, tuning):
    """Checks and defaults of kernel="mosaic" (`kernel_mgpu.py`), then the call."""
    t, h, width = q.shape
    tuning = dict(tuning)
    tuning.pop("kernel")
    unused = set(tuning) - {"block_q", "block_h", "block_k", "num_splits", "num_stages",
                            *_MOSAIC_FLAGS}
    if unused:
        raise ValueError(f"kernel='mosaic' takes block_q, block_h, block_k, num_splits, "
                         f"num_stages, share_logits, compact and seesaw, got "
                         f"{sorted(unused)}")
    if q.dtype != jnp.bfloat16:
        raise ValueError(f"kernel='mosaic' takes bfloat16 (wgmma), got {q.dtype}")
    if rank % 128 or width % 64:
        raise ValueError(f"kernel='mosaic' needs kv_lora_rank % 128 == 0 and width % 64 == 0 "
                         f"(64-column tiles, two value halves), got {rank} and {width}")
    page_size = latent.shape[1]
    if page_size < 8:
        raise ValueError(f"kernel='mosaic' needs page_size >= 8 (8-row tiles), got {page_size}")
    full = mosaic_tuning(t, h, block_tables.shape[0], block_tables.shape[1], page_size,
                         tuning.get("block_q", 1))
    full.update(tuning)
    full["block_q"] = 1 << (max(1, full["block_q"]) - 1).bit_length()
    if not (_pow2(full["block_h"]) and h % full["block_h"] == 0
            and full["block_q"] * full["block_h"] <= MAX_ROWS):
        raise ValueError(f"kernel='mosaic' needs block_h a power of 2 dividing num_heads {h} "
                         f"and block_q * block_h <= {MAX_ROWS}, got block_q={full['block_q']},"
                         f" block_h={full['block_h']}")
    if full["block_k"] % 64:
        raise ValueError(f"kernel='mosaic' needs block_k a multiple of 64, got "
                         f"{full['block_k']}")
    if uniform_q_len is not None and not (isinstance(uniform_q_len, int) and uniform_q_len >= 1
                                          and t == block_tables.shape[0] * uniform_q_len):
        raise ValueError(f"uniform_q_len must be None or an int q with num_tokens {t} == "
                         f"num_seqs_max {block_tables.shape[0]} * q, got {uniform_q_len!r}")
    if full["compact"] is None:
        full["compact"] = uniform_q_len is not None
    if full["seesaw"] is None:
        full["seesaw"] = _seesaw_default(full, uniform_q_len, h, width - rank, page_size)
    for key in _MOSAIC_FLAGS:
        if full[key] not in (True, False, 0, 1):
            raise ValueError(f"{key} must be a bool, got {full[key]!r}")
    if full["seesaw"] and (width - rank != 64 or full["block_k"] != 64):
        raise ValueError(f"kernel='mosaic', seesaw=True: needs 64 rope columns (width "
                         f"{width} - kv_lora_rank {rank}) and block_k 64, got block_k "
                         f"{full['block_k']}")
    smem = 2 * (MAX_ROWS + full["num_stages"] * full["block_k"]) * width + 2 * 1024 + (
        2 * MAX_ROWS * full["block_k"] if full["share_logits"] else 0)
    if full["num_stages"] < 2 or smem > HOPPER_SMEM_BYTES:
        raise ValueError(f"kernel='mosaic': num_stages={full['num_stages']} with block_k="
                         f"{full['block_k']} needs {smem} B of shared memory; it takes >= 2 "
                         f"stages within {HOPPER_SMEM_BYTES // 1024} KiB")
    sm_scale = _splits_and_scale(full["num_splits"], sm_scale, width)
    return _mla_mosaic(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs.reshape(()),
                       rank=rank, sm_scale=sm_scale, block_q=full["block_q"],
                       block_h=full["block_h"], block_kv=full["block_k"],
                       num_splits=full["num_splits"], num_stages=full["num_stages"],
                       share_logits=bool(full["share_logits"]), interpret=interpret,
                       compact=bool(full["compact"]), uniform_q_len=uniform_q_len,
                       seesaw=bool(full["seesaw"]))


_mla_mosaic = jax.jit(mla_mosaic, static_argnames=(
    "rank", "sm_scale", "block_q", "block_h", "block_kv", "num_splits", "num_stages",
    "share_logits", "interpret", "compact", "uniform_q_len", "seesaw"))


@functools.partial(jax.jit, static_argnames=("rank", "sm_scale", "interpret", "tuning"))
def _mla(q, latent, block_tables, kv_lens, cu_q_lens, num_seqs, *, rank, sm_scale, interpret,
         tuning):
    tuning = dict(tuning)
    bq = tuning["block_q"]
    q_lens, ends = item_ends(cu_q_lens, num_seqs, bq)
    num_items = max_items(q.shape[0], block_tables.shape[0], bq)
    return mla_core(q, latent, block_tables, kv_lens, q_lens, cu_q_lens, ends, num_items,
                    rank=rank, block_q=bq, block_h=tuning["block_h"],
                    block_k=tuning["block_k"], num_splits=tuning["num_splits"],
                    sm_scale=sm_scale, num_warps=tuning["num_warps"],
                    num_stages=tuning["num_stages"], interpret=interpret,
                    value_split=tuning["value_split"], qk_chunk=tuning["qk_chunk"],
                    keys_first=tuning["keys_first"])


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "sm_scale", "token_chunk"))
def mla_paged_attention_reference(q, latent_pages, block_tables, kv_lens, cu_q_lens, num_seqs,
                                  *, kv_lora_rank, sm_scale=None, token_chunk=64):
    """The one jnp paged attention (`pallas_kernels.paged_reference`) on latent pages (same
    arguments as `mla_paged_attention`, no tuning): one shared KV head whose values are the
    first kv_lora_rank entries of the keys. Tokens go through it in chunks of `token_chunk`
    (`lax.map`), so memory is O(token_chunk * M * S * (R + dr)).
    """
    t, h, width = q.shape
    scale = width ** -0.5 if sm_scale is None else sm_scale
    seq, pos = ragged_token_rows(cu_q_lens, kv_lens, num_seqs, t)
    k_pages = latent_pages[None]                                   # [1, P, S, R + dr]
    v_pages = latent_pages[None, ..., :kv_lora_rank]               # [1, P, S, R]

    def one(args):
        q_t, seq_t, pos_t = args                                   # [H, R + dr], (), ()
        return paged_attention_tokens(q_t[None], k_pages, v_pages, block_tables, kv_lens,
                                      seq_t[None], pos_t[None], sm_scale=scale,
                                      precision="highest")[0]

    return jax.lax.map(one, (q, seq, pos), batch_size=min(t, token_chunk))
