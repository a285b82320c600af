"""`linear(x, w)`: the model's projections (`x @ w`), never as a one-row product.

XLA:GPU rewrites a dot whose lhs is a single row ([1, E] x [E, N]) into an elementwise multiply
and a reduction, and then merges sibling multiplies that share x (the k and v projections, MLA's
q and kv_a) into one multi-output fusion that *writes* weight-sized products before reducing
them. Read from the optimized HLO of `generate`'s batch-1 loop (docs/benchmarks.md): the k/v
projections of each layer became `(bf16[4096,1024], bf16[4096,1024]) multiply` + reduce, and
16 layers of q/k/v projections took 0.93 ms instead of 0.48 ms. Computing one row as two (the
second zero, dropped) keeps every projection a GEMM fusion that reads each weight once. The
engine's batches are padded to >= 8 tokens and never hit this; `generate` at batch 1 and every
batch-1 draft pass did.

FP8 weights (`Fp8Weight`) take the FP8 kernel for decode-sized batches on one GPU
(model/fp8_matmul.py: it reads each FP8 byte once). Otherwise they are dequantized in the
step (convert, times the broadcast block scale, dot), tied to x so that XLA cannot hoist the
widened weight out of a loop (`dequantize_in_step`); those products are exactly those of the
dequantized reference model.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtpjax.model.fp8_matmul import fp8_kernel_matmul
from mtpjax.model.fp8_weight import dequantize_in_step, is_fp8


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., E] @ w [E, N] -> [..., N]; a single row is computed as two rows (see above).
    w may be an Fp8Weight (the FP8 kernel, or dequantized in the step: see above)."""
    if is_fp8(w):
        y = fp8_kernel_matmul(x, w)
        if y is not None:
            return y
    w, x = dequantize_in_step(w, x)
    if math.prod(x.shape[:-1]) != 1:
        return x @ w
    rows = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
    return (rows @ w)[:1].reshape(*x.shape[:-1], w.shape[-1])
