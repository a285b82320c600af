"""y = x @ W for an FP8 weight W = values * scale, reading each FP8 byte once:

    x       [M, K]  bf16 (or float32)
    values  [K, N]  float8_e4m3fn
    scale   [ceil(K / bK), ceil(N / bN)] float32, block (bK, bN): 128 x 128 (DeepSeek-V3), or
            (K, 1): one scale per output column
    y       [M, N]  x.dtype

XLA does not fuse the dequantization into its GEMM: it writes the widened weight back to memory
and the GEMM reads it again, so an FP8 model ran slower than bf16 (docs/benchmarks.md, FP8).
Here program (n, s) owns output columns [n * block_n, (n + 1) * block_n) and the s-th of
`splits` equal ranges of K. It walks its range in block_k-row steps: loads x's rows [Mp, bk] and
the FP8 tile [bk, bn], widens the tile in registers (e4m3 -> bf16 is exact), one dot with float32
accumulation, times the tile's scale (a K step lies inside one scale row: block_k divides bK).
Partials [splits, Mp, N] float32 are summed by the caller's XLA reduction, which also drops the
padding rows and casts. Split-K exists because a decode batch's matmul has few column blocks
(4096 / 128 = 32 programs for an 8B o_proj): the splits fill the SMs.

Rows: Triton's dot takes >= 16 rows, so x is padded to Mp = a multiple of 16 (at most MAX_ROWS;
larger batches are compute-bound and take XLA's dequantize-then-GEMM, `kernel_takes`).

Numerics: products are x * float(values) summed in float32, then scaled per tile; the
dequantize-first reference rounds values * scale to bf16 before the dot, so the two differ by
that rounding (relative ~2^-9 per weight, averaging out over K).

activations="fp8": x is quantized to e4m3 per (row, 128 K-columns) with a float32 scale
(`activations.py`, DeepSeek-V3's activation recipe) and each dot takes BOTH operands as e4m3
straight from their loads, float32 accumulation: no widening in the kernel, so Triton is free
to feed its MMA from the loaded tiles. Each K step's partial is multiplied by
x_scale[m, group] x the weight block's scale (a step lies inside one group and one scale row);
per-column weight scales multiply the sum after the K loop. This adds x's rounding, at most
2^-4 of each element (3 mantissa bits), which averages down over K.
Pallas' Triton lowering emits such a dot as `tt.dot` f8E4M3FN x f8E4M3FN -> f32 with
maxNumImpreciseAcc = 0; Triton takes Hopper's wgmma only for result blocks of >= 64 rows and,
for FP8 with a float32 result, only with maxNumImpreciseAcc >= 32, so this dot runs as mma.sync
(MMAv2) on an H100 / H200, as the f16 dot does at decode rows.

variant="stream" (weight-only) runs stream.py's decode GEMV on the same operands instead: its
tiles go to registers with 16-byte loads and are prefetched through the K loop, where this
kernel's e4m3 tile is staged in shared memory and read back one byte at a time into the dot
(stream.py says what each compiles to).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._device import num_sms
from pallas_kernels.fp8_matmul.activations import GROUP, quantize_activations
from pallas_kernels.fp8_matmul.operands import check_operands
from pallas_kernels.fp8_matmul.stream import (MODES as STREAM_MODES, stream_block_k,
                                              stream_call, stream_mode, stream_rows,
                                              stream_splits)

MAX_ROWS = 128                   # decode batches: a verify of 32 requests x (K + 1) tokens
ACTIVATIONS = ("bf16", "fp8")    # x as given (widened f16 / bf16 dot), or e4m3 per group
VARIANTS = ("tiles", "stream")   # this module's kernel, or stream.py's decode GEMV


def _rows(M: int) -> int:
    return max(16, -(-M // 16) * 16) if M <= 16 else 1 << (M - 1).bit_length()


def kernel_takes(M: int, K: int, N: int, block: tuple[int, int],
                 activations: str = "bf16") -> bool:
    """Whether the kernel runs x [M, K] @ W [K, N] with scale block `block` (else XLA).
    activations="fp8" also needs K in whole activation groups and dots of >= 32 K-rows (an
    e4m3 MMA's depth)."""
    bK, bN = block
    sub = _block_k(K, bK)
    if not (1 <= M <= MAX_ROWS and sub is not None and _block_n(N, bN) is not None):
        return False
    return activations != "fp8" or (K % GROUP == 0 and sub >= 32)


def _block_k(K: int, bK: int) -> int | None:
    """Rows per step: the largest of 128 / 64 / 32 / 16 dividing K and the scale block bK."""
    for b in (128, 64, 32, 16):
        if K % b == 0 and bK % b == 0:
            return b
    return None


def _block_n(N: int, bN: int) -> int | None:
    """Columns per program: 128 or 64 dividing N, inside one scale column block (bN a multiple
    of it) or per-column scales (bN == 1)."""
    for b in (128, 64):
        if N % b == 0 and (bN == 1 or bN % b == 0):
            return b
    return None


def _splits(n_cols: int, k_steps: int, Mp: int) -> int:
    """K splits: the fewest with n_cols x splits programs >= ~90% of the SMs (one wave), each
    split >= 4 steps, and the float32 partials (splits x Mp x N) small against the weight
    bytes. An H200 sweep at 1 and 32 tokens (`bench fp8_linear --sweep`) put the best split of
    the 8B MLP's up projection (112 column blocks) at 2 and of its down projection (32) at 4."""
    target = num_sms() - num_sms() // 10
    s = 1
    while (n_cols * s < target and k_steps % (s * 2) == 0 and k_steps // (s * 2) >= 4
           and s * 2 * Mp <= 256):
        s *= 2
    return s


def _dot_input(x: jax.Array, compute: str) -> tuple[jax.Array, jax.Array | None]:
    """x for a widened dot in `compute`, and the per-row factor to divide the output by."""
    if compute != "float16" or x.dtype == jnp.float32:
        return x, None
    # e4m3 -> f16 is one conversion per two values, -> bf16 three (via f16 and f32): the
    # widening bounds the kernel's rate. x goes to f16 scaled per row by a power of two that
    # puts its largest |x| in [2^14, 2^15): exact for every bf16 value down to 2^-10 of the
    # row's largest, and no overflow; the output is scaled back per row.
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
    exponent = jnp.where(amax > 0, jnp.floor(jnp.log2(jnp.maximum(amax, 1e-30))), 0.0)
    row_scale = jnp.exp2(14.0 - exponent)                                      # [M, 1]
    return (x.astype(jnp.float32) * row_scale).astype(jnp.float16), row_scale


def _stream(x, values, scale, *, block, block_n, block_k, splits, num_warps, num_stages,
            compute, mode, prefetch, interpret):
    """fp8_weight_matmul's variant="stream" (stream.py), operands already checked."""
    M, K = x.shape
    N = values.shape[1]
    bK, bN = block
    mode = mode or stream_mode(M)
    if mode not in STREAM_MODES:
        raise ValueError(f"mode must be one of {STREAM_MODES} (or None), got {mode!r}")
    if prefetch not in (0, 1, 2):
        raise ValueError(f"prefetch must be 0, 1 or 2 steps, got {prefetch}")
    Mp = stream_rows(M, mode)
    sub = _block_k(K, bK)
    bn = block_n or _block_n(N, bN)
    bk = block_k or stream_block_k(sub, Mp, bn, mode)
    if (bk & (bk - 1) or sub % bk or (mode == "dot" and bk < 16) or N % bn or bn & (bn - 1)
            or (bN != 1 and bN % bn)):
        raise ValueError(f"stream: block_k={bk} must be a power of two dividing {sub} (>= 16 "
                         f"for a dot), block_n={bn} a power of two dividing N={N} and the "
                         f"scale block {bN}")
    splits = splits or stream_splits(N // bn, K // bk, M, K, num_sms())
    if (K // bk) % splits:
        raise ValueError(f"splits={splits} must divide the {K // bk} K steps")
    # fma widens x in the kernel; a dot takes x as it is or (f16) scaled per row
    x_in, row_scale = (x, None) if mode == "fma" else _dot_input(x, compute)
    # one split with nothing to undo per row: the kernel writes the output itself
    direct = splits == 1 and row_scale is None
    partials = stream_call(x_in, values, scale.astype(jnp.float32), scale_block=(bK, bN),
                           mode=mode, block_k=bk, block_n=bn, splits=splits,
                           prefetch=prefetch, num_warps=num_warps, num_stages=num_stages,
                           interpret=interpret, out_dtype=x.dtype if direct else jnp.float32)
    if direct:
        return partials[0]
    y = partials.sum(0) if splits > 1 else partials[0]
    return (y / row_scale if row_scale is not None else y).astype(x.dtype)


def fp8_matmul_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k: int, block_n: int, sub_k: int,
                      k_steps: int, scale_block: tuple[int, int]):
    """Program (n, s): o_ref [Mp, block_n] = float32 partial over the s-th K range, in steps of
    block_k rows, each step sub_k-row dots (a dot lies inside one scale row)."""
    n, s = pl.program_id(0), pl.program_id(1)
    bK, bN = scale_block
    cols = pl.ds(n * block_n, block_n)
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    first = s * k_steps

    def step(i, acc):
        for j in range(block_k // sub_k):
            k0 = (first + i) * block_k + j * sub_k
            x = x_ref[:, pl.ds(k0, sub_k)]                              # [Mp, sub_k]
            w = w_ref[pl.ds(k0, sub_k), cols].astype(x.dtype)           # [sub_k, bn], exact
            part = plgpu.dot(x, w, precision=precision)                 # float32 [Mp, bn]
            if bN == 1:
                scale = s_ref[k0 // bK, cols][None, :]                   # per column
            else:
                scale = s_ref[k0 // bK, (n * block_n) // bN]             # one per tile
            acc = acc + part * scale
        return acc

    acc = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    o_ref[...] = lax.fori_loop(jnp.int32(0), jnp.int32(k_steps), step, acc)


def fp8_act_matmul_kernel(x_ref, xs_ref, w_ref, s_ref, o_ref, *, block_k: int, block_n: int,
                          sub_k: int, k_steps: int, scale_block: tuple[int, int]):
    """Program (n, s), activations="fp8": x_ref [Mp, K] e4m3, xs_ref [K / GROUP, Mp] float32
    (a group's row scales are one row: one load per step). o_ref [Mp, block_n] = float32
    partial over the s-th K range; each sub_k-row dot is e4m3 x e4m3 -> float32, times
    x_scale[:, group] x the block's scale. Per-column weight scales with one scale row
    multiply the sum once, after the loop."""
    n, s = pl.program_id(0), pl.program_id(1)
    bK, bN = scale_block
    cols = pl.ds(n * block_n, block_n)
    first = s * k_steps
    columns_after = bN == 1 and s_ref.shape[0] == 1

    def step(i, acc):
        for j in range(block_k // sub_k):
            k0 = (first + i) * block_k + j * sub_k
            x = x_ref[:, pl.ds(k0, sub_k)]                              # [Mp, sub_k] e4m3
            w = w_ref[pl.ds(k0, sub_k), cols]                           # [sub_k, bn] e4m3
            part = plgpu.dot(x, w)                                      # float32 [Mp, bn]
            scale = xs_ref[k0 // GROUP, :][:, None]                     # [Mp, 1]
            if bN != 1:
                scale = scale * s_ref[k0 // bK, (n * block_n) // bN]    # one per tile
            elif not columns_after:
                scale = scale * s_ref[k0 // bK, cols][None, :]          # per column
            acc = acc + part * scale
        return acc

    acc = jnp.zeros((x_ref.shape[0], block_n), jnp.float32)
    acc = lax.fori_loop(jnp.int32(0), jnp.int32(k_steps), step, acc)
    if columns_after:
        acc = acc * s_ref[0, cols][None, :]
    o_ref[...] = acc


@functools.partial(jax.jit, static_argnames=("block", "block_n", "block_k", "splits",
                                             "num_warps", "num_stages", "compute",
                                             "activations", "variant", "mode", "prefetch",
                                             "interpret"))
def fp8_weight_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *,
                      block: tuple[int, int], block_n: int | None = None,
                      block_k: int | None = None, splits: int | None = None,
                      num_warps: int | None = None, num_stages: int = 4,
                      compute: str | None = None, activations: str = "bf16",
                      variant: str = "tiles", mode: str | None = None, prefetch: int = 1,
                      interpret: bool = False) -> jax.Array:
    """x [M, K] @ (values [K, N] * scale) -> [M, N] in x.dtype (see the module docstring).
    block_n / block_k (a multiple of the dot's rows) / splits override the defaults.
    activations: "bf16" (x as given, dot in `compute`) or "fp8" (x to e4m3 per row and
    128-column group, e4m3 x e4m3 dots; `compute` unused).
    variant: "tiles" (this module's kernel) or "stream" (`stream.py`, weight-only: `mode`
    "dot" | "fma" | None for the default, `prefetch` steps loaded ahead; block_k there is any
    power of two dividing the scale-aligned step). Defaults per variant: num_warps 4 for
    tiles, 8 for stream; compute "float16" for tiles (x scaled per row into f16, the cheaper
    widening), "bfloat16" for stream (x straight into the kernel: no XLA op before it).
    ValueError for operands the kernel cannot take (`kernel_takes` says which it can)."""
    check_operands(x, values)
    M, K = x.shape
    N = values.shape[1]
    bK, bN = block
    if scale.shape != (-(-K // bK), -(-N // bN)):
        raise ValueError(f"scale must be [{-(-K // bK)}, {-(-N // bN)}] for block {block}, got "
                         f"{tuple(scale.shape)}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    if not kernel_takes(M, K, N, block):
        raise ValueError(f"fp8_weight_matmul takes 1..{MAX_ROWS} rows and K, N in whole tiles "
                         f"of the scale block; got M={M}, K={K}, N={N}, block {block}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if compute not in (None, "float16", "bfloat16"):
        raise ValueError(f"compute must be 'float16' or 'bfloat16', got {compute!r}")
    if variant == "stream":
        if activations != "bf16":
            raise ValueError('variant="stream" is weight-only: activations must be "bf16", '
                             f"got {activations!r}")
        return _stream(x, values, scale, block=block, block_n=block_n, block_k=block_k,
                       splits=splits, num_warps=8 if num_warps is None else num_warps,
                       num_stages=num_stages, compute=compute or "bfloat16", mode=mode,
                       prefetch=prefetch, interpret=interpret)
    num_warps = 4 if num_warps is None else num_warps
    compute = compute or "float16"
    Mp = _rows(M)
    sub = _block_k(K, bK)
    bk, bn = block_k or sub, block_n or _block_n(N, bN)
    if bk % sub or K % bk or N % bn or (bN != 1 and bN % bn):
        raise ValueError(f"block_k={bk} must be a multiple of {sub} dividing K={K}, block_n={bn} "
                         f"must divide N={N} and the scale block {bN}")
    n_cols = N // bn
    splits = splits or _splits(n_cols, K // bk, Mp)
    if (K // bk) % splits:
        raise ValueError(f"splits={splits} must divide the {K // bk} K steps")
    k_steps = K // bk // splits
    row_scale = None
    if activations == "fp8":
        if not kernel_takes(M, K, N, block, activations):
            raise ValueError(f'activations="fp8" needs K a multiple of {GROUP} and e4m3 dots of '
                             f">= 32 K-rows (K and the scale block's {bK} rows multiples of 32); "
                             f"got K={K}, dots of {sub}")
        x_q, x_scale = quantize_activations(x)            # [M, K] e4m3, [M, K / GROUP]
        xp = jnp.pad(x_q, ((0, Mp - M), (0, 0))) if Mp != M else x_q
        xs = jnp.pad(x_scale, ((0, Mp - M), (0, 0)), constant_values=1.0).T   # [K/GROUP, Mp]
        kernel_fn, x_inputs = fp8_act_matmul_kernel, (xp, xs)
        x_specs = [pl.BlockSpec((Mp, K), lambda n, s: (0, 0)), pl.BlockSpec(memory_space=pl.ANY)]
    else:
        x_in, row_scale = _dot_input(x, compute)
        xp = jnp.pad(x_in, ((0, Mp - M), (0, 0))) if Mp != M else x_in
        kernel_fn, x_inputs = fp8_matmul_kernel, (xp,)
        x_specs = [pl.BlockSpec((Mp, K), lambda n, s: (0, 0))]
    kernel = functools.partial(kernel_fn, block_k=bk, block_n=bn, sub_k=sub, k_steps=k_steps,
                               scale_block=(bK, bN))
    partials = pl.pallas_call(
        kernel,
        grid=(n_cols, splits),
        in_specs=x_specs + [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, Mp, bn), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, Mp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_weight_matmul",
    )(*x_inputs, values, scale.astype(jnp.float32))
    y = partials.sum(0)[:M]
    return (y / row_scale if row_scale is not None else y).astype(x.dtype)
