"""The FP8 matmul's "stream" variant (pallas_kernels/fp8_matmul/stream.py): interpreted on the CPU
against the float32 math of the dequantized weight, its defaults, its errors, and what it lowers
and compiles to for an H100 / H200."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model.fp8_matmul import VARIANT_ENV, fp8_kernel_variant, forced_fp8_kernel
from mtpjax.model.fp8_weight import quantize
from mtpjax.model.linear import linear
from mtpjax.model.fp8_matmul import forced_fp8_matmul
from pallas_kernels.fp8_matmul import fp8_weight_matmul
from pallas_kernels.fp8_matmul.stream import stream_splits


def _case(seed, M, K, N, block, x_dtype=jnp.bfloat16):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(x_dtype)
    w = quantize(0.05 * jax.random.normal(kw, (K, N), jnp.float32), block)
    return x, w, x.astype(jnp.float32) @ w.dequantize(jnp.float32)


def _within_output_rounding(y, ref):
    err = np.abs(np.asarray(y, np.float32) - np.asarray(ref))
    bound = 2 ** -8 * np.abs(np.asarray(ref)) + 1e-3 * float(jnp.max(jnp.abs(ref)))
    return np.all(err <= bound), float(np.max(err - bound))


@pytest.mark.parametrize("M,K,N,block,kw", [
    (1, 512, 256, (128, 128), {}),                                  # split K, one scale a tile
    (5, 256, 192, (128, 64), {}),                                   # ragged rows, 64 columns
    (32, 384, 128, (384, 1), {}),                                   # per channel, one scale row
    (3, 256, 128, (64, 1), {}),                                     # per channel, 4 scale rows
    (17, 256, 128, (64, 128), dict(compute="float16")),             # 64-row steps, f16 dot
    (1, 384, 128, (128, 1), dict(compute="float16", splits=1)),
    (128, 256, 128, (128, 128), {}),                                # the kernel's largest batch
    (32, 512, 128, (128, 128), dict(prefetch=2, splits=2)),
    (1, 512, 128, (128, 128), dict(prefetch=0)),
    (1, 512, 256, (128, 128), dict(mode="fma")),
    (5, 256, 192, (128, 64), dict(mode="fma")),                     # 8 rows: 32-row steps
    (3, 384, 128, (384, 1), dict(mode="fma", prefetch=2)),
    (2, 256, 128, (64, 1), dict(mode="fma", block_k=16)),
    (5, 256, 128, (128, 128), dict(splits=1)),                      # writes bf16 itself
    (3, 256, 192, (64, 1), dict(mode="fma", splits=1, block_n=64)),
])
def test_stream_equals_float32_math_within_output_rounding(M, K, N, block, kw):
    for seed in range(2):
        x, w, ref = _case(seed, M, K, N, block)
        y = fp8_weight_matmul(x, w.values, w.scale, block=w.block, variant="stream",
                              interpret=True, **kw)
        assert y.shape == (M, N) and y.dtype == x.dtype
        ok, excess = _within_output_rounding(y, ref)
        assert ok, (seed, excess)


@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_stream_float32_inputs_are_exact(mode):
    for seed in range(3):
        x, w, ref = _case(seed, 3, 256, 128, (128, 128), x_dtype=jnp.float32)
        y = fp8_weight_matmul(x, w.values, w.scale, block=w.block, variant="stream", mode=mode,
                              interpret=True)
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compute", ["float16", "bfloat16"])
def test_stream_rows_of_very_different_size(compute):
    """bf16 x dots as it is; f16 x is scaled per row, like the tiles kernel's: either way tiny
    and huge rows in one batch each come out as accurately as an ordinary row."""
    x, w, _ = _case(3, 4, 256, 128, (128, 128))
    x = x * jnp.asarray([1e-7, 1.0, 3e4, 1e7], jnp.float32)[:, None].astype(x.dtype)
    ref = np.asarray(x.astype(jnp.float32) @ w.dequantize(jnp.float32))
    y = np.asarray(fp8_weight_matmul(x, w.values, w.scale, block=w.block, variant="stream",
                                     compute=compute, interpret=True), np.float32)
    assert np.all(np.isfinite(y))
    for r in range(4):
        assert np.max(np.abs(y[r] - ref[r])) <= 5e-3 * np.max(np.abs(ref[r])), r


@pytest.mark.parametrize("kw,direct", [(dict(splits=1), True),
                                       (dict(mode="fma", splits=1), True),
                                       (dict(compute="float16", splits=1), False),  # x scaled
                                       (dict(splits=2), False)])
def test_stream_with_one_split_and_bf16_x_is_the_kernel_alone(kw, direct):
    """bf16 x straight into the kernel and one split: no XLA op before or after the
    pallas_call (each is a kernel launch at decode sizes)."""
    x, w, _ = _case(0, 3, 256, 128, (128, 128))
    jaxpr = jax.make_jaxpr(lambda x, v, s: fp8_weight_matmul(
        x, v, s, block=w.block, variant="stream", interpret=True, **kw))(x, w.values, w.scale)
    eqns = jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns          # inside fp8_weight_matmul's jit
    names = [e.primitive.name for e in eqns]
    compute = [n for n in names if n not in ("pallas_call", "squeeze", "slice", "reshape",
                                             "convert_element_type")]
    assert ("reduce_sum" in names or bool(compute)) != direct, names
    if direct:      # the scale's astype(float32) is a no-op on float32 scales
        assert names.count("pallas_call") == 1 and not compute, names


def test_stream_bad_config_names_the_value():
    x, w, _ = _case(0, 2, 256, 128, (128, 128))
    call = lambda **kw: fp8_weight_matmul(x, w.values, w.scale, block=w.block,  # noqa: E731
                                          interpret=True, **kw)
    with pytest.raises(ValueError, match="'rows'"):
        call(variant="rows")
    with pytest.raises(ValueError, match="'int8'"):
        call(variant="stream", mode="int8")
    with pytest.raises(ValueError, match="prefetch must be 0, 1 or 2 steps, got 3"):
        call(variant="stream", prefetch=3)
    with pytest.raises(ValueError, match="weight-only"):
        call(variant="stream", activations="fp8")
    with pytest.raises(ValueError, match="block_k=48"):
        call(variant="stream", block_k=48)
    with pytest.raises(ValueError, match="splits=4"):
        call(variant="stream", splits=4)           # 2 steps of 128 rows


def test_stream_splits_fill_the_sms_within_the_partials_budget():
    # the 8B MLP at one token: up (112 column blocks x 32 steps), down (32 x 112)
    assert stream_splits(112, 32, 1, 4096, 132) == 4
    assert stream_splits(32, 112, 1, 14336, 132) == 16
    rng = np.random.default_rng(0)
    for _ in range(200):
        n_cols, M = int(rng.integers(1, 300)), int(rng.integers(1, 129))
        k_steps = int(rng.choice([1, 2, 3, 7, 8, 12, 32, 112]))
        K = 128 * k_steps
        s = stream_splits(n_cols, k_steps, M, K, 132)
        assert k_steps % s == 0
        if s > 1:   # each split >= 2 steps, partials' traffic <= 1/8 of the weight
            assert k_steps // s >= 2 and 64 * s * M <= K
            assert n_cols * (s // 2) < 2 * 132          # no more splits than it needed


def test_linear_takes_the_variant_the_env_names(monkeypatch):
    x, w, ref = _case(4, 3, 256, 128, (128, 128))
    with forced_fp8_matmul("kernel"):
        tiles = np.asarray(jax.jit(linear)(x, w), np.float32)
        with forced_fp8_kernel("stream"):
            assert fp8_kernel_variant("bf16") == "stream"
            assert fp8_kernel_variant("fp8") == "tiles"
            stream = np.asarray(jax.jit(linear)(x, w), np.float32)
    for y in (tiles, stream):
        assert _within_output_rounding(y, ref)[0]
    monkeypatch.setenv(VARIANT_ENV, "fast")
    with pytest.raises(ValueError, match="fast"):
        fp8_kernel_variant("bf16")


def _ttir(M, K, N, **kw):
    from pallas_kernels._triton_inspect import triton_modules
    S = jax.ShapeDtypeStruct
    fn = lambda x, v, s: fp8_weight_matmul(x, v, s, block=(128, 128), variant="stream",  # noqa
                                           **kw)
    [ttir] = triton_modules(fn, S((M, K), jnp.bfloat16), S((K, N), jnp.float8_e4m3fn),
                            S((K // 128, N // 128), jnp.float32))
    return ttir


@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_stream_lowers_for_cuda_with_the_tile_carried_through_the_loop(mode):
    """Lowered for CUDA (no GPU needed): one e4m3 [128, 128] tile load before the K loop and
    one inside it (the prefetch), the loop carries the tile, and only dot mode has a dot."""
    ttir = _ttir(1, 4096, 14336, mode=mode)
    tile = "tensor<128x128x!tt.ptr<f8E4M3FN>>"
    loop = ttir[ttir.index("scf.for"):]
    assert ttir.count(f"tt.load") >= 2 and loop.count(tile) >= 1
    assert "tensor<128x128xf8E4M3FN>" in loop.splitlines()[0]        # a loop-carried tile
    assert ("tt.dot" in ttir) == (mode == "dot")


@pytest.mark.parametrize("mode", ["dot", "fma"])
def test_stream_compiles_to_16_byte_loads_and_no_byte_reads(mode):
    """Through the `triton` package's sm_90a compiler: the loop loads the weight with 16-byte
    global loads straight to registers (no cp.async staging), and never reads shared memory
    one byte at a time (what the tiles kernel's B operand does)."""
    pytest.importorskip("triton")
    from pallas_kernels._triton_inspect import compile_for_sm90, loop_opcodes, sass
    compiled = compile_for_sm90(_ttir(1, 4096, 14336, mode=mode), num_warps=8, num_stages=1)
    ops = loop_opcodes(sass(compiled["cubin"]))
    # 128 x 128 bytes over 256 threads: 4 loads of 16 bytes each (dot: + x's f16 chunk)
    assert ops.get("LDG.E.128", 0) >= 4, ops
    assert not any(op.startswith(("LDGSTS", "LDS.U8", "LDS.S8")) for op in ops), ops
    assert any(op.startswith("HMMA") for op in ops) == (mode == "dot"), ops
    if mode == "fma":
        assert not any(op.startswith(("BAR", "LDS", "STS")) for op in ops), ops
