"""A token or two's routed experts, the whole SwiGLU FFN in one kernel (batch-1 decode):

    y[n, j] = w_down[e](activation(x[n] @ w_gate[e]) * (x[n] @ w_up[e])),  e = ids[n, j]

x [N, E] (N <= MAX_TOKENS), ids int32[N, k] (an id < 0 or >= the number of experts: routed
nowhere, its row is zero), w_gate / w_up [G, E, I], w_down [G, I, E] -> y float32[N, k, E],
each pair's output, unweighted (`expert_tile_swiglu`'s contract); `fused_moe_ffn` returns
the routing-weighted sum [N, E].

Program (p, c) owns pair p's expert and its hidden columns [c * block_n, (c + 1) * block_n):
it reads those columns of the gate and up weights (all E rows: the hidden values are
complete), applies the activation, and multiplies its block_n hidden values by the same rows
of the down weight, writing a float32 partial [E] of the expert's output. The wrapper sums
the I / block_n partials. So every weight byte is read once, by one program, and the layer
is one launch: at one DeepSeek-V2-Lite token, k x I / block_n = 6 x 22 = 132 programs (one
per H100 SM) read 104 MB in one wave, where the two-kernel form (`expert_tile_swiglu`) pays
each kernel's ramp-up and tail and the split-K sums between them (docs/kernels.md; its
measured rate is in docs/benchmarks.md).

Up to MAX_TOKENS tokens; the model takes it up to `mtpjax.model.grouped_matmul.
fused_moe_tokens()` (a batch of one decoding, or `generate`'s two rows of which the second
pads; with drafts, a verify's K+1 tokens). A padding token's pairs are routed nowhere and
cost a zero write. Each pair reads its expert on its own, so tokens that chose one expert
read it once each: beyond a few tokens `expert_tile_swiglu` (one tile per touched expert)
reads fewer bytes.

Triton's dot takes at least 16 rows, so each x block is widened in registers to 16 rows, x
then 15 zero rows (no padding kernel before the launch): their hidden values are
activation(0) x 0 = 0 and their outputs zero, and each partial is the sum of its rows (row 0
plus exact zeros) with no value slicing in the kernel.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._device import num_sms
from pallas_kernels.grouped_matmul.grouped_matmul import (SUPPORTED_DTYPES, check_ffn_weights,
                                                          largest_block)

DOT_ROWS = 16                   # Triton's smallest dot: x's one row, then zero rows
MAX_TOKENS = 8                  # the kernel's limit (the model's choice: fused_moe_tokens)
STAGE_BYTES = 64 * 1024         # gate + up weight bytes per pipeline step (bf16)


def target_programs() -> int:
    """About one program per SM, leaving at most 1/32 of them idle (128 of an H100's 132):
    the layer is one wave, so every SM must share the weight read."""
    sms = num_sms()
    return sms - sms // 32


def default_blocks(k: int, E: int, I: int) -> tuple[int, int, int]:
    """(block_n, block_k, block_e). block_n: hidden columns per program, halved from 128 until
    the k x I / block_n programs reach `target_programs()`.
    block_k: rows of E per gate/up step, as many as fit STAGE_BYTES (256 at 64 columns).
    block_e: 256 output columns per down step.

    Chosen by an H100 sweep at one V2-Lite token (kernel time alone; docs/kernels.md). A
    wide step, not a deep pipeline, keeps enough bytes in flight: with 128-row
    steps, 2 stages ran faster than 3, 4 or 5. At the V3 slice (8 of 128 experts) 128
    columns beat 64."""
    bn = largest_block(I, 128)
    target = target_programs()
    while bn > 16 and k * (I // bn) < target and I % (bn // 2) == 0:
        bn //= 2
    rows = max(16, STAGE_BYTES // (2 * 2 * bn))
    return bn, largest_block(E, min(rows, 256)), largest_block(E, 256)


def fused_ffn_kernel(x_ref, wg_ref, wu_ref, wd_ref, ids_ref, scale_ref, o_ref, *, block_n: int,
                     block_k: int, block_e: int, activation):
    """Program (j, c): o_ref [E] = the float32 partial of pair j's output over hidden block c,
    times scale_ref[j] (the routing weight, or 1); x_ref [1, E] is pair j's token."""
    G, E, _ = wg_ref.shape
    j, c = pl.program_id(0), pl.program_id(1)
    g = ids_ref[j]
    routed = (g >= 0) & (g < G)
    g = jnp.where(routed, g, 0)
    cols = pl.ds(c * block_n, block_n)
    # float32 inputs: full-precision dots (Triton would use TF32), as the f32 tests compare
    precision = lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None
    # int32 bounds on both ends: Triton's scf.for needs one type (expert_tiles' kernel.py)
    zero_i = jnp.int32(0)

    first_row = lax.broadcasted_iota(jnp.int32, (DOT_ROWS, block_k), 0) == 0

    def gate_up(i, accs):
        rows = pl.ds(i * block_k, block_k)
        x = jnp.broadcast_to(x_ref[:, rows], (DOT_ROWS, block_k))
        x = jnp.where(first_row, x, jnp.zeros((), x.dtype))            # [16, block_k]
        return (accs[0] + plgpu.dot(x, wg_ref[g, rows, cols], precision=precision),
                accs[1] + plgpu.dot(x, wu_ref[g, rows, cols], precision=precision))

    zero = jnp.zeros((DOT_ROWS, block_n), jnp.float32)
    n_k = jnp.where(routed, jnp.int32(E // block_k), zero_i)   # routed nowhere: no reads
    gate, up = lax.fori_loop(zero_i, n_k, gate_up, (zero, zero))
    h = (activation(gate) * up).astype(x_ref.dtype)                     # [16, block_n]

    def down(i, carry):
        out = pl.ds(i * block_e, block_e)
        y = plgpu.dot(h, wd_ref[g, cols, out], precision=precision)     # [16, block_e]
        o_ref[out] = jnp.sum(y, axis=0) * scale                         # row 0 + zeros
        return carry

    def zeros(i, carry):
        o_ref[pl.ds(i * block_e, block_e)] = jnp.zeros((block_e,), jnp.float32)
        return carry

    scale = scale_ref[j]
    # A pair routed nowhere writes zeros without reading a weight: the partials need no mask
    # (a select before the sum was its own small kernel on the H100), and a dynamic trip
    # count, not a branch, keeps the down loop's loads pipelined.
    n_e = jnp.where(routed, jnp.int32(E // block_e), zero_i)
    lax.fori_loop(zero_i, n_e, down, zero_i)
    lax.fori_loop(zero_i, jnp.int32(E // block_e) - n_e, zeros, zero_i)


def _routed_partials(x, ids, scale, w_gate, w_up, w_down, *, activation, block_n, block_k,
                     block_e, num_warps, num_stages, interpret):
    """The kernel's float32 partials [N * k, I / block_n, E] (zero for pairs routed nowhere),
    after checking the operands (ValueError naming the bad one)."""
    _, E, I = check_ffn_weights(w_gate, w_up, w_down)
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_TOKENS or x.shape[1] != E:
        raise ValueError(f"x must be [N, E={E}] with 1 <= N <= {MAX_TOKENS} tokens, got "
                         f"{tuple(x.shape)}")
    N = x.shape[0]
    if ids.ndim != 2 or ids.shape[0] != N or not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"ids must be integers [N={N}, k], got {ids.dtype}{list(ids.shape)}")
    if (jnp.dtype(x.dtype) not in SUPPORTED_DTYPES
            or {w.dtype for w in (w_gate, w_up, w_down)} != {x.dtype}):
        raise ValueError(f"x and the weights must all be bfloat16 or all float32, got x "
                         f"{x.dtype}, weights {w_gate.dtype} / {w_up.dtype} / {w_down.dtype}")
    k = ids.shape[1]
    if scale.shape != (N, k):
        raise ValueError(f"weights must be [N={N}, k={k}] like ids, got {tuple(scale.shape)}")
    auto = default_blocks(k, E, I)      # one token's pairs fill the GPU (the others: padding)
    block_n, block_k, block_e = (b or a for b, a in zip((block_n, block_k, block_e), auto))
    for name, b, dim, dim_name in (("block_n", block_n, I, "I"), ("block_k", block_k, E, "E"),
                                   ("block_e", block_e, E, "E")):
        if b < 16 or b & (b - 1) or dim % b:
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton's dot) dividing "
                             f"{dim_name}={dim}")
    n_cols = I // block_n
    P = N * k
    experts = ids.reshape(P).astype(jnp.int32)
    kernel = functools.partial(fused_ffn_kernel, block_n=block_n, block_k=block_k,
                               block_e=block_e, activation=activation)
    partials = pl.pallas_call(
        kernel,
        grid=(P, n_cols),
        in_specs=[pl.BlockSpec((None, 1, E), lambda j, c: (j // k, 0, 0))]
        + [pl.BlockSpec(memory_space=pl.ANY)] * 5,
        out_specs=pl.BlockSpec((None, None, E), lambda j, c: (j, c, 0)),
        out_shape=jax.ShapeDtypeStruct((P, n_cols, E), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fused_expert_ffn",
    )(x.reshape(N, 1, E), w_gate, w_up, w_down, experts, scale.reshape(P).astype(jnp.float32))
    return partials


_STATIC = ("activation", "block_n", "block_k", "block_e", "num_warps", "num_stages",
           "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_expert_ffn(x: jax.Array, ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                     w_down: jax.Array, *, activation=jax.nn.silu, block_n: int | None = None,
                     block_k: int | None = None, block_e: int | None = None,
                     num_warps: int = 4, num_stages: int = 3,
                     interpret: bool = False) -> jax.Array:
    """See the module docstring: y float32[N, k, E], each pair's output unweighted. Blocks not
    given come from `default_blocks`. ValueError for shapes, dtypes or blocks the kernel
    cannot take."""
    ones = jnp.ones(ids.shape, jnp.float32)
    partials = _routed_partials(
        x, ids, ones, w_gate, w_up, w_down, activation=activation, block_n=block_n,
        block_k=block_k, block_e=block_e, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    return partials.sum(1).reshape(ids.shape + (w_gate.shape[1],))


@functools.partial(jax.jit, static_argnames=_STATIC)
def fused_moe_ffn(x: jax.Array, ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array, *, activation=jax.nn.silu,
                  block_n: int | None = None, block_k: int | None = None,
                  block_e: int | None = None, num_warps: int = 4, num_stages: int = 3,
                  interpret: bool = False) -> jax.Array:
    """The routed experts' weighted sum: sum_j weights[n, j] * y[n, j] -> float32 [N, E]
    (weights float [N, k]). The kernel scales each partial by its pair's weight, so the
    partials' sum is the layer's output: one reduction after the launch, where the unweighted
    form's sum, weighting and sum over k were two or three small kernels. ValueError as
    `fused_expert_ffn`."""
    partials = _routed_partials(
        x, ids, weights, w_gate, w_up, w_down, activation=activation, block_n=block_n,
        block_k=block_k, block_e=block_e, num_warps=num_warps, num_stages=num_stages,
        interpret=interpret)
    N, k = ids.shape
    return partials.reshape(N, k, -1, partials.shape[-1]).sum((1, 2))
