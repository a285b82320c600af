"""The "stream" variant of the FP8 weight-only matmul: a decode GEMV that streams the e4m3 weight
through registers at the memory's rate.

    x        [M, K]    bf16 / f16 / float32, unpadded: a dot's rows past M load as zeros,
                       fma reads only the real rows (no XLA op pads or converts x)
    values   [K, N]    float8_e4m3fn
    scale    [ceil(K / bK), ceil(N / bN)] float32
    partials [splits, M, N] float32 (the real rows only), summed by the caller; with one
             split and no per-row factor, the output itself in x's dtype (no XLA op after)

Why a second kernel: the "tiles" kernel (kernel.py) hands each e4m3 tile to Triton's dot as a
load. Compiled for sm_90 (`pallas_kernels/_triton_inspect.py`: the TTIR that Pallas emits, run
through the `triton` package's compiler), Triton's pipeliner stages that tile in shared memory
with 8-byte cp.async copies and reads it back into the MMA's B-operand fragments, which pair
K-consecutive values while the tile is stored N-contiguous: the loop body reads shared memory one
byte at a time (128 LDS.U8 per thread per 128 x 128 tile, plus the byte packing, 482
instructions a thread at 4 warps), waits on a barrier, and loads the tile's scale with an
unpipelined global load.

Program (n, s) owns `block_n` output columns and the s-th of `splits` ranges of K, walked in
`block_k`-row steps that each lie in one scale row. Each step's tile goes global -> registers with
16-byte loads (N contiguous; the loaded tile is a loop-carried value, so Triton's pipeliner
leaves it alone) and is used in one of two modes:
  dot: the tile widens in registers to x's dtype, is written to shared memory as 16-byte
       rows and read back by ldmatrix.trans into the MMA's fragments; one dot of the step
       against x, times the block's scale. The default at every M (`stream_mode`). x bf16 (the
       default compute): 362 instructions a thread per 128 x 128 step at 8 warps and 1 row, and
       no XLA op before the kernel; compute="float16" (x scaled per row into f16 by XLA, two
       small kernels before this one): 265, e4m3 -> f16 being one conversion per two values.
  fma: acc_m [block_k, block_n] += (x[m, k] * block scale) * w[k, n] for each row m, plain
       float32 FMAs in the tile's own register layout; each acc_m is summed over its K axis
       once, after the loop: no shared memory and no barrier at all, but the widening to
       float32 costs ~5 instructions a value (404 a thread per step at 1 row), and registers
       grow with Mp x block_k x block_n: for a few rows.
The loop carries the next `prefetch` steps' tiles, x chunks and scales: their loads are issued a
step (or two) before their use, so a program keeps `prefetch` tiles in flight while it works on
the current one, with no shared-memory staging buffer, whatever Triton's pipeliner does
(`prefetch=0` hands the loads back to it: `num_stages` then stages the tile in shared memory).
Instruction counts: Triton 3.9's compiler for sm_90a; XLA's bundled Triton may differ a little.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MODES = ("dot", "fma")
FMA_ACC_ELEMENTS = 16384         # Mp x block_k x block_n of the fma accumulator, by default


def stream_rows(M: int, mode: str) -> int:
    """Padded rows: a power of two (Triton's tensors), >= 16 for a dot (its MMA's rows)."""
    p = 1 << max(0, M - 1).bit_length()
    return max(16, p) if mode == "dot" else p


def stream_mode(M: int) -> str:
    """The default mode for M rows: dot at every M (fewer instructions per weight byte than
    fma even at one row, see the module docstring; fma's FMAs also grow with the rows)."""
    del M
    return "dot"


def stream_block_k(sub: int, Mp: int, block_n: int, mode: str) -> int:
    """Rows per step: the scale-aligned step `sub` (<= 128), shrunk for fma so that the
    accumulator Mp x block_k x block_n stays within FMA_ACC_ELEMENTS (>= 16 rows)."""
    if mode == "dot":
        return sub
    bk = sub
    while bk > 16 and Mp * bk * block_n > FMA_ACC_ELEMENTS:
        bk //= 2
    return bk


def stream_splits(n_cols: int, k_steps: int, M: int, K: int, num_sms: int) -> int:
    """K splits: the fewest with n_cols x splits >= 2 programs per SM (two CTAs' loads in
    flight on each), each split >= 2 steps, and the float32 partials' traffic (written and
    read: 8 x splits x M x N bytes) at most 1/8 of the e4m3 weight's K x N."""
    s = 1
    while (n_cols * s < 2 * num_sms and k_steps % (s * 2) == 0 and k_steps // (s * 2) >= 2
           and 64 * (s * 2) * M <= K):
        s *= 2
    return s


def fp8_stream_kernel(x_ref, w_ref, s_ref, o_ref, *, rows: int, block_k: int, block_n: int,
                      k_steps: int, scale_block: tuple[int, int], mode: str, prefetch: int):
    """Program (n, s): o_ref [Mp, block_n] = float32 partial over the s-th K range; only its
    first `rows` rows are loaded from x and stored (x and the partials hold the real rows).
    fma keeps one [block_k, block_n] accumulator per row, in the tile's own register layout (a
    3-D [Mp, block_k, block_n] one made Triton re-layout every tile through shared memory)."""
    n, s = pl.program_id(0), pl.program_id(1)
    bK, bN = scale_block
    col0 = pl.multiple_of(n * block_n, block_n)
    cols = pl.ds(col0, block_n)
    first = s * k_steps
    # per-column scales with one scale row multiply the sum once, after the loop
    columns_after = bN == 1 and s_ref.shape[0] == 1
    Mp = x_ref.shape[0]

    def load(i):
        """Step i's (x, e4m3 tile, scale); steps past the range re-read the last one (the
        prefetch's tail: loaded, never used). fma: x is a tuple of the real rows [bk]."""
        i = jnp.minimum(i, k_steps - 1)
        k0 = pl.multiple_of((first + i) * block_k, block_k)
        ks = pl.ds(k0, block_k)
        if mode == "fma":
            x = tuple(x_ref[m, ks].astype(jnp.float32) for m in range(rows))   # [bk] each
        else:
            real = lax.broadcasted_iota(jnp.int32, (Mp, block_k), 0) < rows
            x = plgpu.load(x_ref.at[:, ks], mask=real, other=0)           # [Mp, bk]
        w = w_ref[ks, cols]                                               # [bk, bn] e4m3
        if bN == 1:
            scale = s_ref[k0 // bK, cols]                                 # [bn] per column
        else:
            scale = s_ref[k0 // bK, col0 // bN]                           # one per tile
        return x, w, scale

    def accumulate(acc, x, w, scale):
        if mode == "fma":
            wf = w.astype(jnp.float32)                                    # e4m3 -> f32, exact
            if bN == 1 and not columns_after:
                wf = wf * scale[None, :]
            if bN != 1:                                                   # fold the block's scale
                x = tuple(xm * scale for xm in x)
            return tuple(a + xm[:, None] * wf for a, xm in zip(acc, x))   # rows x [bk, bn]
        precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None   # not tf32
        part = plgpu.dot(x, w.astype(x.dtype), precision=precision)       # f32 [Mp, bn]
        if bN != 1:
            return acc + part * scale
        return acc + (part if columns_after else part * scale[None, :])

    def step(i, carry):
        acc, ahead = carry
        x, w, scale = ahead[0]
        ahead = ahead[1:] + (load(i + prefetch),)                         # issued before the math
        return accumulate(acc, x, w, scale), ahead

    if mode == "fma":
        acc = tuple(jnp.zeros((block_k, block_n), jnp.float32) for _ in range(rows))
    else:
        acc = jnp.zeros((Mp, block_n), jnp.float32)
    if prefetch == 0:
        acc = lax.fori_loop(jnp.int32(0), jnp.int32(k_steps),
                            lambda i, acc: accumulate(acc, *load(i)), acc)
    else:
        ahead = tuple(load(jnp.int32(j)) for j in range(prefetch))
        acc, _ = lax.fori_loop(jnp.int32(0), jnp.int32(k_steps), step, (acc, ahead))
    after = s_ref[0, cols] if columns_after else None                    # [bn]
    if mode == "fma":
        for m in range(rows):
            row = acc[m].sum(axis=0)                                      # [bn]
            row = row * after if after is not None else row
            o_ref[m, :] = row.astype(o_ref.dtype)
    else:
        acc = acc * after[None, :] if after is not None else acc
        real = lax.broadcasted_iota(jnp.int32, (Mp, block_n), 0) < rows
        plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=real)


def stream_call(x: jax.Array, values: jax.Array, scale: jax.Array, *,
                scale_block: tuple[int, int], mode: str, block_k: int, block_n: int,
                splits: int, prefetch: int, num_warps: int, num_stages: int,
                interpret: bool, out_dtype=jnp.float32) -> jax.Array:
    """partials [splits, M, N] out_dtype of x [M, K] (dot: in the dot's dtype). With one
    split and out_dtype x's, the one partial is the product: the call is the whole matmul."""
    M, K = x.shape
    Mp = stream_rows(M, mode)
    N = values.shape[1]
    k_steps = K // block_k // splits
    kernel = functools.partial(fp8_stream_kernel, rows=M, block_k=block_k, block_n=block_n,
                               k_steps=k_steps, scale_block=scale_block, mode=mode,
                               prefetch=prefetch)
    return pl.pallas_call(
        kernel,
        grid=(N // block_n, splits),
        in_specs=[pl.BlockSpec((Mp, K), lambda n, s: (0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, Mp, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, M, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_stream_matmul",
    )(x, values, scale)
