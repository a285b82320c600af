"""A Pallas-Triton kernel that only reads a weight the way the FP8 stream kernel does: the ceiling
of that load path, for `mtpjax bench fp8-linear --sweep`.

    words    [K, N / 4] uint32   the e4m3 values viewed four to a word (a bitcast, no copy)
    out      [splits, N / 4] uint32   per-column wrapping sums, so no load is dead code

Same grid as the stream kernel (program (n, s): block_n e4m3 columns, the s-th K range in
128-row steps), the same 16-byte loads of [128, block_n / 4] words carried `prefetch` steps
ahead through a fori_loop that is not unrolled, and one integer add per four bytes instead of
the matmul. If the
stream kernel runs near this probe, its math is hidden under the loads; if the probe itself is
far from the copy rate, the load path (grid, bytes in flight) is what to change.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

STEP_ROWS = 128


def _probe_kernel(steps_ref, w_ref, o_ref, *, block_w: int, prefetch: int):
    n, s = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(pl.multiple_of(n * block_w, block_w), block_w)
    # the step count comes from memory: a constant trip count gets the loop unrolled, and all
    # of a program's loads issue at once, which is not the stream kernel's load path
    k_steps = steps_ref[0]
    first = s * k_steps

    def load(i):
        i = jnp.minimum(i, k_steps - 1)
        return w_ref[pl.ds(pl.multiple_of((first + i) * STEP_ROWS, STEP_ROWS), STEP_ROWS), cols]

    def step(i, carry):
        acc, ahead = carry
        tile, ahead = ahead[0], ahead[1:] + (load(i + prefetch),)      # issued before the add
        return acc + tile, ahead

    acc = jnp.zeros((STEP_ROWS, block_w), jnp.uint32)
    ahead = tuple(load(jnp.int32(j)) for j in range(prefetch))
    acc, _ = lax.fori_loop(jnp.int32(0), k_steps, step, (acc, ahead))
    o_ref[...] = acc.sum(axis=0)


@functools.partial(jax.jit, static_argnames=("block_n", "splits", "prefetch", "num_warps",
                                             "interpret"))
def read_probe(values: jax.Array, *, block_n: int = 128, splits: int = 1, prefetch: int = 1,
               num_warps: int = 8, interpret: bool = False) -> jax.Array:
    """Reads values [K, N] (e4m3) once; [splits, N / 4] uint32 sums of its words."""
    K, N = values.shape
    if (values.dtype.itemsize != 1 or K % (STEP_ROWS * splits) or N % block_n
            or block_n % 64 or prefetch < 1):
        raise ValueError(f"read_probe takes 1-byte values [K, N] with K a multiple of "
                         f"{STEP_ROWS} x splits and N of block_n (a multiple of 64), prefetch "
                         f">= 1; got {values.dtype} {tuple(values.shape)}, block_n={block_n}, "
                         f"splits={splits}, prefetch={prefetch}")
    words = lax.bitcast_convert_type(
        lax.bitcast_convert_type(values, jnp.uint8).reshape(K, N // 4, 4), jnp.uint32)
    block_w = block_n // 4
    kernel = functools.partial(_probe_kernel, block_w=block_w, prefetch=prefetch)
    steps = jnp.full((1,), K // STEP_ROWS // splits, jnp.int32)
    return pl.pallas_call(
        kernel,
        grid=(N // block_n, splits),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, block_w), lambda n, s: (s, n)),
        out_shape=jax.ShapeDtypeStruct((splits, N // 4), jnp.uint32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="weight_read_probe",
    )(steps, words)
