"""The Mosaic-GPU FP8 weight-only matmul (pallas_kernels/fp8_matmul/mosaic.py): it lowers for
CUDA on this CPU machine (Pallas -> Mosaic GPU -> NVVM runs in Python: shape, layout and wgmma
errors surface here), it equals x @ dequantize(W) interpreted on the CPU (the "x64"
orientation: JAX's GPU interpreter cannot take the transposed wgmma operands of "wt") and
compiled on a Hopper GPU (both orientations; skipped elsewhere), and it names bad operands."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model.fp8_weight import quantize
from pallas_kernels._hopper import on_hopper
from pallas_kernels.fp8_matmul.mosaic import fp8_weight_matmul_mosaic, mosaic_takes

S = jax.ShapeDtypeStruct


def _block(kind: str, K: int) -> tuple[int, int]:
    return (128, 128) if kind == "block" else (K, 1)


def _case(seed, M, K, N, kind):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (M, K), jnp.float32).astype(jnp.bfloat16)
    w = quantize(0.05 * jax.random.normal(kw, (K, N), jnp.float32), _block(kind, K))
    return x, w, np.asarray(x.astype(jnp.float32) @ w.dequantize(jnp.float32))


def _max_rel_err(x, w, ref, **kw) -> float:
    """max |y - ref| / max |ref|, after a call on NaN x: an output element the kernel leaves
    unwritten keeps that call's NaN (the freed buffer is reused) and fails the check."""
    call = jax.jit(lambda x, v, s: fp8_weight_matmul_mosaic(x, v, s, block=w.block, **kw))
    jax.block_until_ready(call(jnp.full_like(x, jnp.nan), w.values, w.scale))
    y = np.asarray(call(x, w.values, w.scale).astype(jnp.float32))
    assert y.shape == ref.shape
    assert np.all(np.isfinite(y)), "unwritten or non-finite outputs"
    return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))


# wgmma_n: wgmma's N, the padded rows in "wt" (x^T is the B operand), the column tile in "x64"
@pytest.mark.parametrize("M,K,N,kind,kw,wgmma_n", [
    (1, 4096, 14336, "block", {}, 8),                       # 8B MLP up, 1 token
    (32, 14336, 4096, "channel", {}, 32),                   # 8B MLP down, per column
    (8, 4096, 6144, "block", dict(orientation="x64", block_k=64, stages=3), 128),
    (5, 1024, 384, "channel", dict(block_n=64, splits=2), 8),   # ragged rows, 64 columns
    (16, 4096, 14336, "block", dict(compute_warpgroups=2), 16),   # widening over 2 WGs
])
def test_lowers_for_cuda_to_tma_and_wgmma(M, K, N, kind, kw, wgmma_n):
    scale = S((K // 128, N // 128) if kind == "block" else (1, N), jnp.float32)
    call = jax.jit(lambda x, v, s: fp8_weight_matmul_mosaic(x, v, s, block=_block(kind, K),
                                                             **kw))
    text = call.trace(S((M, K), jnp.bfloat16), S((K, N), jnp.float8_e4m3fn), scale).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    # the weight arrives by TMA, widens with the paired e4m3 -> f16 conversion, and the
    # products run on wgmma in bf16
    assert "cp.async.bulk.tensor" in text
    assert "cvt.rn.f16x2.e4m3x2" in text
    assert f"wgmma.mma_async.sync.aligned.m64n{wgmma_n}k16.f32.bf16.bf16" in text


@pytest.mark.parametrize("seed,M,K,N,kind,kw", [
    (0, 3, 1024, 256, "block", dict(stages=2)),             # split K (4 splits), 3 rows
    (1, 8, 512, 384, "channel", dict(splits=2)),            # per column, 3 column blocks
    (2, 1, 512, 256, "block", dict(block_k=64, stages=3)),  # 64-row steps: 2 per scale row
])
def test_interpreted_x64_equals_dequantized_reference(seed, M, K, N, kind, kw):
    x, w, ref = _case(seed, M, K, N, kind)
    assert _max_rel_err(x, w, ref, orientation="x64", interpret=True, **kw) < 1e-2


@pytest.mark.skipif(not on_hopper(), reason="compiled Mosaic GPU kernels need a Hopper GPU")
@pytest.mark.parametrize("kw", [{}, dict(orientation="x64"), dict(compute_warpgroups=2)])
@pytest.mark.parametrize("kind", ["block", "channel"])
@pytest.mark.parametrize("M,K,N", [(1, 256, 384), (8, 1024, 512), (32, 4096, 1408)])
def test_compiled_equals_dequantized_reference(M, K, N, kind, kw):
    for seed in range(3):
        x, w, ref = _case(seed, M, K, N, kind)
        assert _max_rel_err(x, w, ref, **kw) < 1e-2


def test_takes_and_names_bad_operands():
    assert mosaic_takes(32, 4096, 14336, (128, 128))
    assert mosaic_takes(1, 4096, 14336, (4096, 1))
    assert not mosaic_takes(33, 4096, 14336, (128, 128))         # past wgmma's rows
    assert not mosaic_takes(1, 4096, 200, (128, 128))            # N not in whole tiles
    assert not mosaic_takes(1, 4096, 256, (64, 64))              # another block
    x = jnp.zeros((4, 256), jnp.bfloat16)
    v = jnp.zeros((256, 256), jnp.float8_e4m3fn)
    s = jnp.ones((2, 2), jnp.float32)
    with pytest.raises(ValueError, match="1..32 rows"):
        fp8_weight_matmul_mosaic(jnp.zeros((33, 256), jnp.bfloat16), v, s, block=(128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_weight_matmul_mosaic(x, v.astype(jnp.bfloat16), s, block=(128, 128))
    with pytest.raises(ValueError, match=r"scale must be \[2, 2\]"):
        fp8_weight_matmul_mosaic(x, v, jnp.ones((1, 2), jnp.float32), block=(128, 128))
    with pytest.raises(ValueError, match="stages must be >= 2"):
        fp8_weight_matmul_mosaic(x, v, s, block=(128, 128), stages=1)
    with pytest.raises(ValueError, match="splits=3 must divide"):
        fp8_weight_matmul_mosaic(x, v, s, block=(128, 128), splits=3)
    with pytest.raises(ValueError, match="orientation"):
        fp8_weight_matmul_mosaic(x, v, s, block=(128, 128), orientation="nt")
    with pytest.raises(ValueError, match="shared memory"):
        fp8_weight_matmul_mosaic(x, v, s, block=(128, 128), stages=20)
    with pytest.raises(ValueError, match="compute_warpgroups"):
        fp8_weight_matmul_mosaic(x, v, s, block=(128, 128), compute_warpgroups=2, block_k=64)
