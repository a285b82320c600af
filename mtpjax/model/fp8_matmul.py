"""Which matmul reads an FP8 projection weight: the Pallas kernel or XLA's dequantize-then-GEMM.

XLA:GPU does not fuse the dequantization (convert, times the broadcast block scale) into its
GEMM: the widened weight is written back to memory and read again, about three times a bf16
weight's traffic, so an FP8 model decoded slower than the bf16 one (docs/benchmarks.md, FP8).
The kernel (`pallas_kernels.fp8_matmul`) reads each FP8 byte once. It takes decode-sized batches
(<= 128 rows) on one GPU: larger batches are compute-bound and XLA's path costs them little,
and under a mesh the projections are sharded, which a pallas_call would not be.

`MTPJAX_FP8_MATMUL=kernel|xla` forces a path (read when the step is traced; `kernel` is
interpreted off the GPU, for tests); `auto` (the default) picks as above.

`MTPJAX_FP8_KERNEL=tiles|stream` picks the kernel's variant for weight-only calls (read when
traced): `tiles` (the default) or `stream`, the decode GEMV that streams the weight through
registers (`pallas_kernels/fp8_matmul/stream.py`). e4m3 activations always take `tiles`.

`MTPJAX_FP8_ACTIVATIONS=bf16|fp8` picks the kernel's mode (read when traced): `bf16` (the
default) widens each e4m3 weight tile and keeps x as it is; `fp8` quantizes x to e4m3 per
(token, 128 columns), DeepSeek-V3's recipe, and dots e4m3 x e4m3 (adds x's rounding, at most
2^-4 per element; docs/fp8.md). `fp8` applies where the kernel can take it (K a multiple of
128, scale blocks of >= 32 rows), else the kernel runs `bf16`; the XLA path never quantizes x.
"""
from __future__ import annotations

import math
import os

import jax

from mtpjax.env_override import env_override
from mtpjax.model.fp8_weight import Fp8Weight

ENV = "MTPJAX_FP8_MATMUL"
CHOICES = ("auto", "kernel", "xla")
ACTIVATIONS_ENV = "MTPJAX_FP8_ACTIVATIONS"
ACTIVATIONS_CHOICES = ("bf16", "fp8")
VARIANT_ENV = "MTPJAX_FP8_KERNEL"
VARIANT_CHOICES = ("tiles", "stream")


def fp8_matmul_choice(rows: int, w: Fp8Weight) -> str:
    """"kernel" or "xla" for `rows` rows of x times the 2-D FP8 weight w (static)."""
    from pallas_kernels.fp8_matmul import kernel_takes
    forced = os.environ.get(ENV, "auto").strip().lower()
    if forced not in CHOICES:
        raise ValueError(f"{ENV}={forced!r}: expected one of {CHOICES}")
    if len(w.shape) != 2 or not kernel_takes(rows, *w.shape, w.block):
        return "xla"
    if forced != "auto":
        return forced
    return "kernel" if jax.default_backend() == "gpu" and jax.device_count() == 1 else "xla"


def fp8_activations_choice(rows: int, w: Fp8Weight) -> str:
    """The kernel's activations mode for `rows` rows times w: "fp8" when
    MTPJAX_FP8_ACTIVATIONS=fp8 and the kernel takes it for this shape, else "bf16"."""
    from pallas_kernels.fp8_matmul import kernel_takes
    mode = os.environ.get(ACTIVATIONS_ENV, "bf16").strip().lower()
    if mode not in ACTIVATIONS_CHOICES:
        raise ValueError(f"{ACTIVATIONS_ENV}={mode!r}: expected one of {ACTIVATIONS_CHOICES}")
    if mode == "fp8" and not kernel_takes(rows, *w.shape, w.block, activations="fp8"):
        return "bf16"
    return mode


def fp8_kernel_variant(activations: str) -> str:
    """The kernel's variant for a call in `activations` mode: MTPJAX_FP8_KERNEL (default
    "tiles") for weight-only calls, "tiles" for e4m3 activations (stream is weight-only)."""
    variant = os.environ.get(VARIANT_ENV, "tiles").strip().lower()
    if variant not in VARIANT_CHOICES:
        raise ValueError(f"{VARIANT_ENV}={variant!r}: expected one of {VARIANT_CHOICES}")
    return variant if activations == "bf16" else "tiles"


def fp8_kernel_matmul(x: jax.Array, w: Fp8Weight) -> jax.Array | None:
    """x [..., E] @ w by the kernel when `fp8_matmul_choice` picks it, else None (the caller
    dequantizes)."""
    rows = math.prod(x.shape[:-1])
    if fp8_matmul_choice(rows, w) != "kernel":
        return None
    from pallas_kernels.fp8_matmul import fp8_weight_matmul
    activations = fp8_activations_choice(rows, w)
    y = fp8_weight_matmul(x.reshape(rows, x.shape[-1]), w.values, w.scale, block=w.block,
                          activations=activations, variant=fp8_kernel_variant(activations),
                          interpret=jax.default_backend() != "gpu")
    return y.reshape(*x.shape[:-1], w.shape[-1])


def forced_fp8_matmul(path: str | None):
    """`MTPJAX_FP8_MATMUL=path` inside the block (None: left as it is)."""
    return env_override(ENV, path)


def forced_fp8_kernel(variant: str | None):
    """`MTPJAX_FP8_KERNEL=variant` inside the block (None: left as it is)."""
    return env_override(VARIANT_ENV, variant)


def forced_fp8_activations(mode: str | None):
    """`MTPJAX_FP8_ACTIVATIONS=mode` inside the block (None: left as it is)."""
    return env_override(ACTIVATIONS_ENV, mode)
