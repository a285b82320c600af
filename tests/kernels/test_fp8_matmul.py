"""The FP8 weight-only matmul kernel (pallas_kernels/fp8_matmul, interpreted on the CPU) and the
choice between it and XLA's dequantize-then-GEMM (mtpjax/model/fp8_matmul.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model.fp8_matmul import ENV, fp8_matmul_choice, forced_fp8_matmul
from mtpjax.model.fp8_weight import quantize
from mtpjax.model.linear import linear
from pallas_kernels.fp8_matmul import MAX_ROWS, fp8_weight_matmul, kernel_takes


def _case(seed, M, K, N, block, x_scale=1.0, x_dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = (x_scale * jax.random.normal(kx, (M, K), jnp.float32)).astype(x_dtype)
    w = quantize(0.05 * jax.random.normal(kw, (K, N), jnp.float32), block)
    return x, w, x.astype(jnp.float32) @ w.dequantize(jnp.float32)


@pytest.mark.parametrize("seed,M,K,N,block,kw", [
    (0, 1, 512, 256, (128, 128), {}),                           # split K, one tile's scale
    (1, 5, 256, 192, (128, 64), {}),                            # 64-column programs
    (2, 33, 384, 128, (384, 1), {}),                            # per-output-channel scales
    (3, 128, 256, 128, (64, 128), dict(compute="bfloat16")),    # 64-row dots, bf16 widening
    (4, 17, 512, 128, (128, 128), dict(block_k=256, splits=2)),  # two dots per step
])
def test_kernel_equals_float32_math_within_output_rounding(seed, M, K, N, block, kw):
    x, w, ref = _case(seed, M, K, N, block)
    y = fp8_weight_matmul(x, w.values, w.scale, block=w.block, interpret=True, **kw)
    assert y.shape == (M, N) and y.dtype == x.dtype
    # the only rounding is the bf16 output's (2^-9 relative) and the float32 sums
    err = np.abs(np.asarray(y, np.float32) - np.asarray(ref))
    assert np.all(err <= 2 ** -8 * np.abs(np.asarray(ref)) + 1e-3 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_float32_inputs_are_exact(seed):
    x, w, ref = _case(seed, 3, 256, 128, (128, 128), x_dtype=jnp.float32)
    y = fp8_weight_matmul(x, w.values, w.scale, block=w.block, interpret=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_scale", [1e-7, 3e4, 1e7])
def test_f16_widening_keeps_bf16_range(x_scale):
    """x goes to f16 scaled per row by a power of two: rows far outside f16's range (tiny or
    > 65504) come out as accurately as rows of ordinary size, with no inf or zero rows."""
    x, w, ref = _case(7, 4, 256, 128, (128, 128), x_scale=x_scale)
    x = x.at[1].multiply(1e-3)                   # rows of different magnitude in one batch
    ref = x.astype(jnp.float32) @ w.dequantize(jnp.float32)
    y = np.asarray(fp8_weight_matmul(x, w.values, w.scale, block=w.block, interpret=True),
                   np.float32)
    assert np.all(np.isfinite(y))
    for r in range(4):
        scale = float(jnp.max(jnp.abs(ref[r])))
        assert np.max(np.abs(y[r] - np.asarray(ref[r]))) <= 5e-3 * scale, r


def test_bad_operands_name_the_value():
    x, w, _ = _case(0, 2, 256, 128, (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_matmul(x, w.values.astype(jnp.bfloat16), w.scale, block=w.block)
    with pytest.raises(ValueError, match=r"scale must be \[2, 1\]"):
        fp8_weight_matmul(x, w.values, w.scale[:1], block=w.block)
    with pytest.raises(ValueError, match="rows"):
        big = jnp.zeros((MAX_ROWS + 1, 256), jnp.bfloat16)
        fp8_weight_matmul(big, w.values, w.scale, block=w.block)
    with pytest.raises(ValueError, match="compute"):
        fp8_weight_matmul(x, w.values, w.scale, block=w.block, compute="float8")
    with pytest.raises(ValueError, match="splits=3"):
        fp8_weight_matmul(x, w.values, w.scale, block=w.block, splits=3, interpret=True)


def test_kernel_takes_decode_batches_in_whole_tiles():
    assert kernel_takes(1, 4096, 14336, (128, 128))
    assert kernel_takes(MAX_ROWS, 14336, 4096, (14336, 1))
    assert not kernel_takes(MAX_ROWS + 1, 4096, 4096, (128, 128))     # prefill: XLA
    assert not kernel_takes(1, 4096, 4096 + 32, (128, 128))           # partial column tile
    assert not kernel_takes(1, 4096 + 8, 4096, (128, 128))            # partial row tile
    assert not kernel_takes(1, 256, 256, (16, 16))                    # blocks below a dot


def test_choice_auto_is_xla_off_the_gpu_and_env_forces(monkeypatch):
    _, w, _ = _case(0, 1, 256, 128, (128, 128))
    assert fp8_matmul_choice(2, w) == ("kernel" if jax.default_backend() == "gpu"
                                       and jax.device_count() == 1 else "xla")
    with forced_fp8_matmul("kernel"):
        assert fp8_matmul_choice(2, w) == "kernel"
        assert fp8_matmul_choice(MAX_ROWS + 1, w) == "xla"          # never past its rows
    monkeypatch.setenv(ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        fp8_matmul_choice(2, w)


@pytest.mark.parametrize("seed,lead", [(0, (1,)), (1, (2, 3)), (2, (1, 1))])
def test_linear_takes_the_kernel_and_matches_the_dequantized_path(seed, lead):
    x, w, _ = _case(seed, int(np.prod(lead)), 256, 128, (128, 128))
    x = x.reshape(*lead, 256)
    # a fresh function per path: jit caches traces by function, and the path is read at trace
    with forced_fp8_matmul("xla"):
        ref = jax.jit(lambda x, w: linear(x, w))(x, w)
    with forced_fp8_matmul("kernel"):
        y = jax.jit(lambda x, w: linear(x, w))(x, w)
    assert y.shape == ref.shape == (*lead, 128)
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               atol=2 ** -7 * scale)


def _wide_weights(jaxpr, shape) -> list:
    """Values of `shape` in a dtype other than FP8 anywhere in the jaxpr, outside kernels."""
    found = []
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            if tuple(v.aval.shape) == shape and v.aval.dtype != jnp.float8_e4m3fn:
                found.append(f"{eqn.primitive} -> {v.aval}")
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)          # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    found += _wide_weights(sub, shape)
    return found


def test_kernel_path_never_widens_the_weight():
    """The kernel reads FP8 bytes: no [K, N] array of a wider dtype in the traced program
    outside the kernel (the dequantize-then-GEMM path makes one; this guard fails if a
    refactor falls back to it)."""
    x, w, _ = _case(0, 1, 256, 384, (128, 128))
    with forced_fp8_matmul("xla"):          # fresh functions: traces are cached per function
        assert _wide_weights(jax.make_jaxpr(lambda x, w: linear(x, w))(x, w).jaxpr,
                             (256, 384)), "the check must see the XLA path's widened weight"
    with forced_fp8_matmul("kernel"):
        assert _wide_weights(jax.make_jaxpr(lambda x, w: linear(x, w))(x, w).jaxpr,
                             (256, 384)) == []
