"""The FP8 weight-only matmul kernel (pallas_kernels/fp8_matmul, interpreted on the CPU) and the
choice between it and XLA's dequantize-then-GEMM (mtpjax/model/fp8_matmul.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model.fp8_matmul import (ACTIVATIONS_ENV, ENV, fp8_activations_choice,
                                     fp8_matmul_choice, forced_fp8_activations,
                                     forced_fp8_matmul)
from mtpjax.model.fp8_weight import quantize
from mtpjax.model.linear import linear
from pallas_kernels.fp8_matmul import (MAX_ROWS, fp8_weight_matmul, kernel_takes,
                                       quantize_activations)
from pallas_kernels.fp8_matmul.activations import GROUP, dequantize_activations


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


# activations="fp8": x quantized to e4m3 per (row, 128 columns), e4m3 x e4m3 dots

@pytest.mark.parametrize("seed", [0, 1, 2])
def test_activation_quantization_error_per_element(seed):
    """Each element within 2^-4 of itself (3 mantissa bits, round to nearest) plus 2^-10 of its
    group's scale (e4m3 subnormals), magnitudes across eight decades; scales are amax / 448."""
    kx, km = jax.random.split(jax.random.PRNGKey(seed))
    mag = 10.0 ** jax.random.uniform(km, (6, 512), minval=-6, maxval=2)
    x = mag * jax.random.normal(kx, (6, 512))
    x = x.at[2, :GROUP].set(0.0)                              # an all-zero group
    q, scale = quantize_activations(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (6, 512 // GROUP)
    amax = np.max(np.abs(np.asarray(x).reshape(6, -1, GROUP)), axis=-1)
    np.testing.assert_allclose(np.asarray(scale), np.where(amax > 0, amax / 448, 1.0),
                               rtol=1e-6)
    back, x = np.asarray(dequantize_activations(q, scale)), np.asarray(x)
    per_col = np.repeat(np.asarray(scale), GROUP, axis=1)
    assert np.all(np.isfinite(back)) and np.all(back[2, :GROUP] == 0)
    assert np.all(np.abs(back - x) <= 2 ** -4 * np.abs(x) + 2 ** -10 * per_col)


def _fp8_act_case(seed):
    """Random shape and layout: M in 1..MAX_ROWS, K a multiple of 128, block scales, one per
    output channel, or per channel and 128 rows (scaled inside the K loop)."""
    rng = np.random.default_rng(seed)
    M = int(rng.integers(1, MAX_ROWS + 1))
    K = 128 * int(rng.integers(1, 5))
    N = 64 * int(rng.integers(1, 5))
    block = [(128, 128), (128, 64), (64, 64), (K, 1), (128, 1)][seed % 5]
    N = N if N % block[1] == 0 else 128
    return _case(seed, M, K, N, block)


@pytest.mark.parametrize("seed", range(6))
def test_fp8_activations_match_the_same_math_in_jnp(seed):
    """The kernel computes exactly (quantized x) @ W in float32: against that math in jnp the
    only differences are the bf16 output's rounding (2^-9) and float32 summation order."""
    x, w, _ = _fp8_act_case(seed)
    y = fp8_weight_matmul(x, w.values, w.scale, block=w.block, activations="fp8",
                          interpret=True)
    assert y.shape == (x.shape[0], w.shape[1]) and y.dtype == x.dtype
    same = np.asarray(dequantize_activations(*quantize_activations(x))
                      @ w.dequantize(jnp.float32))
    err = np.abs(np.asarray(y, np.float32) - same)
    assert np.all(err <= 2 ** -8 * np.abs(same) + 1e-4 * np.max(np.abs(same)))


@pytest.mark.parametrize("seed", range(6))
def test_fp8_activations_error_against_the_dequantized_reference(seed):
    """Against float32 x @ dequantized W. Each x element moves by |dx| <= 2^-4 |x| (e4m3's 3
    mantissa bits; subnormals add <= 2^-10 of the group scale), so per output
        |y - ref| <= 2^-4 (|x| @ |W|) + 2^-10 (scale @ |W|) + 2^-8 |ref| (bf16 output),
    and, the weights being random with zero mean and independent of the rounding, the error's
    energy is at most 2^-8 of the output's: rms(y - ref) <= 2^-4 rms(ref). Rounding errors
    spread over the half-ulp average that down over K to ~2^-4 / sqrt(3) (~0.036) and below;
    a wrong group scale or a dropped block scale is off by tens of percent."""
    x, w, ref = _fp8_act_case(seed)
    y = np.asarray(fp8_weight_matmul(x, w.values, w.scale, block=w.block, activations="fp8",
                                     interpret=True), np.float32)
    ref, wabs = np.asarray(ref), np.abs(np.asarray(w.dequantize(jnp.float32)))
    _, scale = quantize_activations(x)
    bound = (2 ** -4 * np.abs(np.asarray(x, np.float32)) @ wabs
             + 2 ** -10 * np.repeat(np.asarray(scale), GROUP, axis=1) @ wabs
             + 2 ** -8 * np.abs(ref) + 1e-5 * np.max(np.abs(ref)))
    assert np.all(np.abs(y - ref) <= bound)
    rms = np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref ** 2))
    assert rms <= 2 ** -4 / np.sqrt(3), rms


@pytest.mark.parametrize("x_scale", [1e-7, 1e7])
def test_fp8_activations_scale_each_row_on_its_own(x_scale):
    """Scales are per (row, group): rows of very different size in one batch, far outside
    e4m3's and f16's range, each come out within the rounding of its own magnitude."""
    x, w, _ = _case(7, 4, 256, 128, (128, 128), x_scale=x_scale)
    x = x.at[1].multiply(1e-4)
    ref = np.asarray(x.astype(jnp.float32) @ w.dequantize(jnp.float32))
    y = np.asarray(fp8_weight_matmul(x, w.values, w.scale, block=w.block, activations="fp8",
                                     interpret=True), np.float32)
    assert np.all(np.isfinite(y))
    for r in range(4):
        rms = np.sqrt(np.mean((y[r] - ref[r]) ** 2) / np.mean(ref[r] ** 2))
        assert rms <= 2 ** -4 / np.sqrt(3), (r, rms)


def test_fp8_activations_take_whole_groups_and_deep_dots():
    assert kernel_takes(1, 4096, 14336, (128, 128), activations="fp8")
    assert kernel_takes(MAX_ROWS, 14336, 4096, (14336, 1), activations="fp8")
    assert kernel_takes(2, 256, 128, (64, 64), activations="fp8")
    assert not kernel_takes(2, 256 + 64, 128, (64, 64), activations="fp8")   # partial group
    assert kernel_takes(2, 256, 128, (16, 16 * 8), activations="bf16")
    assert not kernel_takes(2, 256, 128, (16, 16 * 8), activations="fp8")    # 16-row dots
    x, w, _ = _case(0, 2, 256, 128, (128, 128))
    with pytest.raises(ValueError, match="activations must be one of"):
        fp8_weight_matmul(x, w.values, w.scale, block=w.block, activations="int8")
    x, w, _ = _case(0, 2, 320, 128, (64, 128))
    with pytest.raises(ValueError, match="K=320"):
        fp8_weight_matmul(x, w.values, w.scale, block=w.block, activations="fp8")
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_activations(x)


def test_activations_choice_follows_the_env_where_the_kernel_takes_it(monkeypatch):
    _, w, _ = _case(0, 1, 256, 128, (128, 128))
    _, w_odd, _ = _case(0, 1, 320, 128, (64, 128))
    assert fp8_activations_choice(2, w) == "bf16"                     # the default
    with forced_fp8_activations("fp8"):
        assert fp8_activations_choice(2, w) == "fp8"
        assert fp8_activations_choice(2, w_odd) == "bf16"            # K not in groups of 128
    monkeypatch.setenv(ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="int4"):
        fp8_activations_choice(2, w)


@pytest.mark.parametrize("seed", [0, 1])
def test_linear_with_fp8_activations_uses_them(seed):
    """MTPJAX_FP8_ACTIVATIONS=fp8 reaches the kernel through `linear`: the result is the
    quantized-x math (not the bf16 mode's, which is closer to the reference)."""
    x, w, _ = _case(seed, 3, 256, 128, (128, 128))
    with forced_fp8_matmul("kernel"), forced_fp8_activations("fp8"):
        y = np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w), np.float32)
    with forced_fp8_matmul("kernel"), forced_fp8_activations("bf16"):
        y16 = np.asarray(jax.jit(lambda x, w: linear(x, w))(x, w), np.float32)
    same = np.asarray(dequantize_activations(*quantize_activations(x))
                      @ w.dequantize(jnp.float32))
    scale = np.max(np.abs(same))
    np.testing.assert_allclose(y, same, atol=2 ** -7 * scale)
    assert np.max(np.abs(y16 - same)) > 2 ** -6 * scale           # the modes really differ


@pytest.mark.parametrize("block,M,K,N", [((128, 128), 1, 4096, 14336),
                                         ((14336, 1), 128, 14336, 4096)])
def test_fp8_activations_lower_to_an_e4m3_dot_for_cuda(block, M, K, N):
    """Lowered for CUDA (no GPU needed), the kernel's Triton module passes MLIR's verifier and
    its dots take e4m3 on both sides: nothing is widened before the dot."""
    from jax import export
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower = registration.lowering.lower_jaxpr_to_triton_module
    modules = []

    def lower_and_keep(*a, **k):
        result = lower(*a, **k)
        result.module.operation.verify()
        modules.append(str(result.module))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = lower_and_keep
    try:
        S = jax.ShapeDtypeStruct
        fn = lambda x, v, s: fp8_weight_matmul(x, v, s, block=block, activations="fp8")
        export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            S((M, K), jnp.bfloat16), S((K, N), jnp.float8_e4m3fn),
            S((-(-K // block[0]), -(-N // block[1])), jnp.float32))
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    dots = [line for m in modules for line in m.splitlines() if "tt.dot" in line]
    assert dots, "no Triton dot was lowered"
    for line in dots:
        operands = line.split(":")[-1]
        assert operands.count("xf8E4M3FN>") == 2 and "-> tensor<" in operands, line
