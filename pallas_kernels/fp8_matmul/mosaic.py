"""y = x @ W for an FP8 weight W = values * scale at decode sizes, in Mosaic GPU (Hopper):
the weight tiles stream through shared memory by TMA, several stages deep.

    x       [M, K]  bf16, M <= MAX_ROWS
    values  [K, N]  float8_e4m3fn
    scale   [K / 128, N / 128] float32 (block (128, 128)) or [1, N] (block (K, 1): per column)
    y       [M, N]  bf16

Why Mosaic GPU: the Triton kernels of this package read the e4m3 bytes at 2.2-3x their byte
floor on an H200, and a Triton probe that only loads them stays at 1.5x (docs/fp8.md). Here
the loads are TMA bulk copies completing on mbarriers (`plgpu.emit_pipeline`), so the copy
engine, not the threads, moves the weight.

CTA (n, s) owns output columns [n * block_n, (n + 1) * block_n) and the s-th of `splits` equal
K ranges (split-K fills the SMs when N / block_n is small). Per block_k-row step:

    e4m3 tile [block_k, block_n] --TMA--> SMEM --registers: widen, x block scale--> bf16 SMEM
    then one wgmma per step, in one of two orientations (`orientation`):
      "wt": acc[block_n, Mp] += W^T x^T: the widened tile (read transposed) is wgmma's
            64-row A operand and the Mp = 8..32 rows of x are its N dimension (x's tile
            [Mp, block_k] by TMA); the kernel writes y^T partials.
      "x64": acc[64, block_n] += x64 @ W: x padded to wgmma's 64 rows is A, the widened tile B.
            Wastes the padding rows' loads from L2 and their MMA work; the fallback.
    compute_warpgroups=2 ("wt" only): two compute warpgroups each widen half of every tile's
    K rows into their own accumulator while a third issues the TMA copies
    (`emit_pipeline_warp_specialized`): twice the threads on the widening.

Numerics: the 128 x 128 block scale multiplies the widened tile before it is rounded to bf16,
which is exactly the dequantized reference's weight (`Fp8Weight.dequantize()`), so the products
equal the reference's up to float32 accumulation order. Per-column scales multiply the float32
sums after the K loop (outside the kernel, fused with the split-K sum).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._device import HOPPER_SMEM_BYTES, num_sms
from pallas_kernels._hopper import interpret_params
from pallas_kernels.fp8_matmul.operands import check_operands

MAX_ROWS = 32                     # decode batches; wgmma's N dimension in orientation "wt"
ORIENTATIONS = ("wt", "x64")
SCALE_BLOCK = 128                 # the block scales' side (DeepSeek-V3's)


def mosaic_rows(M: int, orientation: str) -> int:
    """Rows x is padded to: a multiple of 8 (wgmma's N granule) in "wt", 64 in "x64"."""
    return max(8, -(-M // 8) * 8) if orientation == "wt" else 64


def mosaic_takes(M: int, K: int, N: int, block: tuple[int, int]) -> bool:
    """Whether the Mosaic kernel runs x [M, K] @ W [K, N] with scale block `block`."""
    bK, bN = block
    # block scales: all of a column's K / 128 scales in one TMA box (<= 256 rows)
    scales_ok = ((bK, bN) == (SCALE_BLOCK, SCALE_BLOCK) and K <= SCALE_BLOCK * 256
                 or (bK, bN) == (K, 1))
    return 1 <= M <= MAX_ROWS and K % 128 == 0 and N % 128 == 0 and scales_ok


def mosaic_splits(n_cols: int, k_steps: int) -> int:
    """K splits: the fewest giving >= ~90% of the SMs one CTA each, each split >= 4 steps."""
    target = num_sms() - num_sms() // 10
    s = 1
    while n_cols * s < target and k_steps % (s * 2) == 0 and k_steps // (s * 2) >= 4:
        s *= 2
    return s


def _transforms(minor_bytes: int, itemsize: int) -> tuple:
    """Tiling + swizzle for a tile whose rows are `minor_bytes` long (the widest swizzle)."""
    swizzle = plgpu.find_swizzle(minor_bytes * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel(x_gmem, w_gmem, s_gmem, o_gmem, *, block_k: int, block_n: int, k_steps: int,
            rows: int, stages: int, block_scales: bool, orientation: str, interpret: bool,
            probe: str | None = None):
    """CTA (n, s) writes o_gmem[s] (float32) at its columns: the partial over its K range,
    [block_n, rows] of y^T in "wt", [64, block_n] of y in "x64". s_gmem [K / 128, NB]: the
    block scales, NB = N / 128 rounded up to 4 (block_scales; unused otherwise): the CTA
    copies the 4 columns around its own (a TMA row is >= 16 bytes). probe (benchmarks;
    output 0): "loads" runs the pipeline's loads alone, no widening or products (the load
    path's ceiling); "launch" not even those (the cost of a call that does nothing)."""
    n, s = lax.axis_index("n"), lax.axis_index("s")
    k_first = s * k_steps                                        # first step of this split
    bk_per_scale = SCALE_BLOCK // block_k
    w_transforms = _transforms(block_n, 1)
    wide_transforms = _transforms(block_n * 2, 2)
    x_transforms = _transforms(block_k * 2, 2)
    acc_shape = (block_n, rows) if orientation == "wt" else (64, block_n)
    cols = pl.ds(n * block_n, block_n)

    def scoped(wide_smem, s_smem, o_smem, s_loaded):
        pl.run_scoped(functools.partial(with_acc, wide_smem, s_smem, o_smem, s_loaded),
                      plgpu.ACC(acc_shape, jnp.float32))

    def with_acc(wide_smem, s_smem, o_smem, s_loaded, acc_ref):
        if block_scales:                        # waited for in the first step
            plgpu.copy_gmem_to_smem(s_gmem.at[:, pl.ds(lax.div(n, 4) * 4, 4)], s_smem,
                                    s_loaded)
        else:                                   # nothing to load: observe the barrier anyway
            plgpu.barrier_arrive(s_loaded)
            plgpu.barrier_wait(s_loaded)

        def step(idx, x_smem, w_smem):
            (i,) = idx
            if probe:
                return
            # 8 contiguous columns a thread: 8-byte loads of e4m3, 16-byte stores of bf16
            w = w_smem[...]
            if not interpret:                   # the interpreter has no register layouts
                w = plgpu.layout_cast(w, plgpu.Layout.WGMMA_UPCAST_4X)
            w = w.astype(jnp.float32)                            # [block_k, block_n], exact
            if block_scales:
                @pl.when(i == 0)
                def _():
                    plgpu.barrier_wait(s_loaded)

                w = w * s_smem[(k_first + i) // bk_per_scale, lax.rem(n, 4)]
            # two widened buffers: step i - 1's wgmma may still read the other one
            wide = wide_smem.at[lax.rem(i, 2)]
            wide[...] = w.astype(jnp.bfloat16)
            plgpu.commit_smem()                                  # visible to the wgmma
            if orientation == "wt":
                plgpu.wgmma(acc_ref, plgpu.transpose_ref(wide, (1, 0)),
                            plgpu.transpose_ref(x_smem, (1, 0)))
            else:
                plgpu.wgmma(acc_ref, x_smem, wide)
            plgpu.wgmma_wait(1)             # step i - 1's is done: its buffers are free

        ks = pl.ds(k_first * block_k, k_steps * block_k)
        pipeline = plgpu.emit_pipeline(
            step,
            grid=(k_steps,),
            in_specs=[
                # x's slot stays until the next step, whose wgmma_wait(1) retires this one's
                plgpu.BlockSpec((rows, block_k), lambda i: (0, i), transforms=x_transforms,
                                delay_release=1),
                plgpu.BlockSpec((block_k, block_n), lambda i: (i, 0), transforms=w_transforms),
            ],
            max_concurrent_steps=stages,
        )
        if probe != "launch":
            pipeline(x_gmem.at[pl.ds(0, rows), ks], w_gmem.at[ks, cols])
        plgpu.wgmma_wait(0)
        if probe and block_scales:
            plgpu.barrier_wait(s_loaded)
        o_smem[...] = acc_ref[...]
        plgpu.commit_smem()
        if orientation == "wt":
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, cols])
        else:
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[s, :, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped,
                  plgpu.SMEM((2, block_k, block_n), jnp.bfloat16, transforms=wide_transforms),
                  plgpu.SMEM((s_gmem.shape[0], 4), jnp.float32),
                  plgpu.SMEM(acc_shape, jnp.float32),
                  plgpu.Barrier(num_arrivals=1))


def _kernel_two_warpgroups(x_gmem, w_gmem, s_gmem, o_gmem, *, block_k: int, k_steps: int,
                           rows: int, stages: int, block_scales: bool):
    """_kernel's "wt" orientation with the widening spread over two compute warpgroups and
    the TMA copies issued by a third (`emit_pipeline_warp_specialized`): compute warpgroup g
    widens K rows [g * block_k / 2, (g + 1) * block_k / 2) of each [block_k, 128] tile and
    keeps its own accumulator [128, rows], written to o_gmem[2 s + g] (XLA sums them)."""
    n, s = lax.axis_index("n"), lax.axis_index("s")
    half = block_k // 2
    k_first = s * k_steps
    bk_per_scale = SCALE_BLOCK // block_k
    cols = pl.ds(n * 128, 128)
    ks = pl.ds(k_first * block_k, k_steps * block_k)

    def scoped(wide_smem, s_smem, o_smem, s_loaded):
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _():
            if block_scales:
                plgpu.copy_gmem_to_smem(s_gmem.at[:, pl.ds(lax.div(n, 4) * 4, 4)], s_smem,
                                        s_loaded)
            else:
                plgpu.barrier_arrive(s_loaded)

        def compute_context(eval_pipeline):
            plgpu.barrier_wait(s_loaded)

            def with_acc(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                out = o_smem.at[wg]
                out[...] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out, o_gmem.at[2 * s + wg, cols])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(with_acc, plgpu.ACC((128, rows), jnp.float32))

        def step(idx, x_smem, w_smem, acc_ref):
            (i,) = idx
            mine = pl.ds(wg * half, half)
            w = plgpu.layout_cast(w_smem.at[mine][...], plgpu.Layout.WGMMA_UPCAST_4X)
            w = w.astype(jnp.float32)                            # [half, 128], exact
            if block_scales:
                w = w * s_smem[(k_first + i) // bk_per_scale, lax.rem(n, 4)]
            wide = wide_smem.at[wg]
            wide[...] = w.astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, plgpu.transpose_ref(wide, (1, 0)),
                        plgpu.transpose_ref(x_smem.at[:, mine], (1, 0)))
            plgpu.wgmma_wait(0)
            return acc_ref

        plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_steps,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((rows, block_k), lambda i: (0, i),
                                transforms=_transforms(block_k * 2, 2)),
                plgpu.BlockSpec((block_k, 128), lambda i: (i, 0),
                                transforms=_transforms(128, 1)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=compute_context,
        )(x_gmem.at[pl.ds(0, rows), ks], w_gmem.at[ks, cols])

    pl.run_scoped(scoped,
                  plgpu.SMEM((2, half, 128), jnp.bfloat16, transforms=_transforms(256, 2)),
                  plgpu.SMEM((s_gmem.shape[0], 4), jnp.float32),
                  plgpu.SMEM((2, 128, rows), jnp.float32),
                  plgpu.Barrier(num_arrivals=1),
                  collective_axes="wg")


def mosaic_operands(x: jax.Array, scale: jax.Array, *, block_scales: bool,
                    orientation: str) -> tuple[jax.Array, jax.Array]:
    """The kernel's x and scale operands: x [M, K] padded to [rows + 8, K] bf16, always a
    buffer of its own (Mosaic calls reject an operand XLA hands over as an unaligned slice of
    a larger array; the kernel reads the first `rows` rows); the block scales with their
    columns padded to a multiple of 4 (as they are for N a multiple of 512), or a dummy."""
    M = x.shape[0]
    xp = jnp.pad(x.astype(jnp.bfloat16), ((0, mosaic_rows(M, orientation) + 8 - M), (0, 0)))
    if not block_scales:
        return xp, jnp.ones((1, 4), jnp.float32)
    s_in = scale.astype(jnp.float32)
    pad = -s_in.shape[1] % 4
    return xp, (jnp.pad(s_in, ((0, 0), (0, pad)), constant_values=1.0) if pad else s_in)


@functools.partial(jax.jit, static_argnames=("rows", "block_scales", "block_n", "block_k",
                                             "splits", "stages", "orientation", "interpret",
                                             "probe", "compute_warpgroups"))
def mosaic_partials(xp: jax.Array, values: jax.Array, s_in: jax.Array, *, rows: int,
                    block_scales: bool, block_n: int, block_k: int, splits: int, stages: int,
                    orientation: str, compute_warpgroups: int = 1, interpret: bool = False,
                    probe: str | None = None) -> jax.Array:
    """The kernel alone on `mosaic_operands`' outputs: float32 partials [splits, N, rows]
    (y^T, "wt") or [splits, 64, N] ("x64"), per-column scales not applied; [2 splits, N,
    rows] with two compute warpgroups (`_kernel_two_warpgroups`). probe (benchmarks: the
    partials are not the product): "loads", only the TMA pipeline's loads run; "launch",
    nothing but the call."""
    if probe not in (None, "loads", "launch"):
        raise ValueError(f"probe must be None, 'loads' or 'launch', got {probe!r}")
    K, N = values.shape
    k_total = K // block_k
    if compute_warpgroups == 2:
        kernel = functools.partial(_kernel_two_warpgroups, block_k=block_k,
                                   k_steps=k_total // splits, rows=rows, stages=stages,
                                   block_scales=block_scales)
        return plgpu.kernel(
            kernel,
            out_type=jax.ShapeDtypeStruct((2 * splits, N, rows), jnp.float32),
            grid=(N // block_n, splits), grid_names=("n", "s"),
            num_threads=3, thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
            interpret=interpret_params() if interpret else None,
        )(xp, values, s_in)
    out_shape = (splits, N, rows) if orientation == "wt" else (splits, 64, N)
    kernel = functools.partial(_kernel, block_k=block_k, block_n=block_n,
                               k_steps=k_total // splits, rows=rows, stages=stages,
                               block_scales=block_scales, orientation=orientation,
                               interpret=interpret, probe=probe)
    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(N // block_n, splits), grid_names=("n", "s"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params() if interpret else None,
    )(xp, values, s_in)


def smem_bytes(rows: int, K: int, block_n: int, block_k: int, stages: int, orientation: str,
               compute_warpgroups: int = 1) -> int:
    """Shared memory of one CTA: the TMA stages (x's rows and the e4m3 tile), the two bf16
    widened tiles, the float32 output stage, the scale column block (and 1 KB for the
    barriers)."""
    x_rows = rows if orientation == "wt" else 64
    ring = stages * (x_rows * block_k * 2 + block_k * block_n)
    out = (block_n * rows if orientation == "wt" else 64 * block_n) * 4 * compute_warpgroups
    wide = (2 * block_k * block_n * 2 if compute_warpgroups == 1 else block_k * block_n * 2)
    return ring + wide + out + (K // SCALE_BLOCK) * 16 + 1024


def mosaic_config(M: int, K: int, N: int, block: tuple[int, int], *, block_n: int = 128,
                  block_k: int = 128, splits: int | None = None, stages: int = 4,
                  orientation: str = "wt", compute_warpgroups: int = 1) -> dict:
    """The checked static arguments of `mosaic_partials` for x [M, K] @ W [K, N]."""
    if orientation not in ORIENTATIONS:
        raise ValueError(f"orientation must be one of {ORIENTATIONS}, got {orientation!r}")
    if not mosaic_takes(M, K, N, block):
        raise ValueError(f"fp8_weight_matmul_mosaic takes 1..{MAX_ROWS} rows, K and N multiples "
                         f"of 128 (K <= {SCALE_BLOCK * 256} with block scales) and block "
                         f"(128, 128) or (K, 1); got M={M}, K={K}, N={N}, block {block}")
    block_scales = block != (K, 1)
    if block_n not in (64, 128) or block_k not in (64, 128) or (block_scales and block_n != 128):
        raise ValueError(f"block_n must be 64 or 128 (128 with block scales) and block_k 64 or "
                         f"128; got block_n={block_n}, block_k={block_k}")
    if stages < 2:
        raise ValueError(f"stages must be >= 2 (x's stage is held one step longer), got "
                         f"{stages}")
    if compute_warpgroups not in (1, 2) or (compute_warpgroups == 2 and (
            orientation, block_n, block_k) != ("wt", 128, 128)):
        raise ValueError(f"compute_warpgroups must be 1, or 2 with orientation 'wt' and 128 x "
                         f"128 tiles; got {compute_warpgroups} ({orientation!r}, block_n="
                         f"{block_n}, block_k={block_k})")
    k_total = K // block_k
    splits = splits or mosaic_splits(N // block_n, k_total)
    if k_total % splits:
        raise ValueError(f"splits={splits} must divide the {k_total} K steps")
    rows = mosaic_rows(M, orientation)
    need = smem_bytes(rows, K, block_n, block_k, stages, orientation, compute_warpgroups)
    if need > HOPPER_SMEM_BYTES:
        raise ValueError(f"stages={stages} with block_k={block_k}, block_n={block_n} and "
                         f"{rows} rows needs {need} B of shared memory, over the "
                         f"{HOPPER_SMEM_BYTES} B a CTA may use: fewer stages")
    return dict(rows=rows, block_scales=block_scales, block_n=block_n,
                block_k=block_k, splits=splits, stages=stages, orientation=orientation,
                compute_warpgroups=compute_warpgroups)


@functools.partial(jax.jit, static_argnames=("block", "block_n", "block_k", "splits", "stages",
                                             "orientation", "compute_warpgroups", "interpret"))
def fp8_weight_matmul_mosaic(x: jax.Array, values: jax.Array, scale: jax.Array, *,
                             block: tuple[int, int], block_n: int = 128, block_k: int = 128,
                             splits: int | None = None, stages: int = 4,
                             orientation: str = "wt", compute_warpgroups: int = 1,
                             interpret: bool = False) -> jax.Array:
    """x [M, K] bf16 @ (values [K, N] e4m3 * scale) -> [M, N] bf16 (module docstring).
    block: (128, 128) block scales or (K, 1) per column. block_n 64 or 128 (block scales:
    128); block_k 64 or 128; splits divides K / block_k (None: `mosaic_splits`); stages: TMA
    stages in flight (>= 2); compute_warpgroups 2: the widening split over two warpgroups
    and the copies issued by a third ("wt", 128 x 128 tiles); interpret: JAX's GPU
    interpreter (CPU tests). ValueError for operands it cannot take (`mosaic_takes`)."""
    check_operands(x, values)
    M, K = x.shape
    N = values.shape[1]
    block = tuple(block)
    config = mosaic_config(M, K, N, block, block_n=block_n, block_k=block_k, splits=splits,
                           stages=stages, orientation=orientation,
                           compute_warpgroups=compute_warpgroups)
    block_scales = config["block_scales"]
    expected = (K // SCALE_BLOCK, N // SCALE_BLOCK) if block_scales else (1, N)
    if scale.shape != expected:
        raise ValueError(f"scale must be {list(expected)} for block {block}, got "
                         f"{tuple(scale.shape)}")
    xp, s_in = mosaic_operands(x, scale, block_scales=block_scales, orientation=orientation)
    partials = mosaic_partials(xp, values, s_in, interpret=interpret, **config)
    y = partials.sum(0)                                        # [N, rows] or [64, N]
    y = y[:, :M].T if orientation == "wt" else y[:M]           # [M, N]
    if not block_scales:
        y = y * scale[0].astype(jnp.float32)[None, :]
    return y.astype(jnp.bfloat16)
