"""The Pallas grouped-matmul kernel (pallas_kernels/grouped_matmul) == jax.lax.ragged_dot,
interpreted on CPU; and it lowers to Triton for CUDA (the lowering runs on this machine)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_matmul, grouped_swiglu, tile_layout
from pallas_kernels.grouped_matmul.routed_ffn import is_prefill, prefill_tiles


def random_case(seed, M, K, N, G, dtype, fill=1.0, empty=0):
    rng = np.random.default_rng(seed)
    total = int(M * fill)
    cuts = np.sort(rng.integers(0, total + 1, G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)
    sizes[rng.choice(G, empty, replace=False)] = 0 if empty else sizes[:0]
    sizes[-1] += total - sizes.sum()                 # keep sum(sizes) == total
    if sizes[-1] < 0:
        sizes = np.full(G, total // G, np.int32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (M, K), jnp.float32).astype(dtype)
    w = (jax.random.normal(k2, (G, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    return x, w, jnp.asarray(sizes)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("M,K,N,G,fill,empty,blocks", [
    (50, 64, 32, 5, 1.0, 1, dict(block_n=16, block_k=16)),       # an empty group
    (37, 32, 48, 4, 0.7, 0, dict(block_n=16, block_k=32)),       # rows past the groups
    (8, 64, 64, 16, 1.0, 8, dict(block_n=32, block_k=16)),       # decode: few rows, many groups
    (96, 48, 32, 3, 1.0, 0, dict(block_m=32, block_n=32, block_k=16)),   # tiles of 32 rows
])
def test_kernel_equals_ragged_dot(seed, M, K, N, G, fill, empty, blocks):
    x, w, sizes = random_case(seed, M, K, N, G, jnp.float32, fill, empty)
    got = grouped_matmul(x, w, sizes, interpret=True, **blocks)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    assert got.shape == (M, N) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    past = int(np.asarray(sizes).sum())
    assert np.all(np.asarray(got)[past:] == 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_bf16(seed):
    x, w, sizes = random_case(seed, 40, 64, 32, 4, jnp.bfloat16)
    got = grouped_matmul(x, w, sizes, interpret=True, block_n=16, block_k=32)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tile_layout_places_every_row_once_in_its_groups_tiles(seed):
    rng = np.random.default_rng(seed)
    G, M, bm = 6, 45, 16
    sizes = rng.multinomial(40, np.ones(G) / G).astype(np.int32)
    sizes[rng.integers(G)] = 0
    sizes = sizes * (sizes.sum() <= M)
    dest, tile_group, Mp = tile_layout(jnp.asarray(sizes), M, bm)
    dest, tile_group = np.asarray(dest), np.asarray(tile_group)
    real = dest < Mp
    assert real.sum() == sizes.sum() and len(set(dest[real])) == real.sum()
    group_of_row = np.repeat(np.arange(G), sizes)
    assert np.all(tile_group[dest[real] // bm] == group_of_row)
    assert (tile_group >= 0).sum() == sum(-(-s // bm) for s in sizes)


def test_bad_inputs_name_the_value():
    x, w, sizes = random_case(0, 16, 32, 32, 2, jnp.float32)
    with pytest.raises(ValueError, match="w's K"):
        grouped_matmul(x, w[:, :16], sizes, interpret=True)
    with pytest.raises(ValueError, match="sizes must be"):
        grouped_matmul(x, w, sizes[:1], interpret=True)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16.*got 48"):
        grouped_matmul(x, w, sizes, block_k=48, interpret=True)
    with pytest.raises(ValueError, match="block_n=64 must divide N=32"):
        grouped_matmul(x, w, sizes, block_n=64, interpret=True)
    with pytest.raises(ValueError, match="must both be"):
        grouped_matmul(x, w.astype(jnp.bfloat16), sizes, interpret=True)


def test_lowers_to_triton_for_cuda():
    """Lowering for CUDA runs the Pallas -> Triton lowering here (no GPU needed): a kernel op
    Triton cannot take fails this test before it reaches a GPU."""
    from jax import export
    args = (jax.ShapeDtypeStruct((256, 256), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16),
            jax.ShapeDtypeStruct((8,), jnp.int32))
    exp = export.export(jax.jit(grouped_matmul), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exp.mlir_module()
    assert "__gpu$xla.gpu.triton" in text and 'name = "grouped_matmul' in text


def test_default_blocks_fill_the_gpu_at_decode_and_stay_wide_at_prefill():
    """(block_n, num_splits): K is split before the weight tiles narrow."""
    from pallas_kernels.grouped_matmul.grouped_matmul import default_blocks, target_programs
    # V2-Lite gate/up at one token: 7 row tiles x 11 column blocks of 128 -> K split 4 ways
    assert default_blocks(6, 64, 2048, 1408, 16, 64) == (128, 4)
    assert default_blocks(24576, 64, 2048, 1408, 128, 64) == (128, 1)   # 4096 tokens
    assert default_blocks(192, 64, 2048, 1408, 16, 64) == (128, 1)      # 32 tokens: 836 programs
    # V3 slice down projection at one token: 9 tiles x 56 blocks of 128 >= 264: no split
    assert default_blocks(8, 128, 2048, 7168, 16, 64) == (128, 1)
    # K too short to split: the column blocks narrow instead
    assert default_blocks(2, 4, 64, 256, 16, 64) == (16, 1)
    for M, G, K, N in [(6, 64, 2048, 1408), (8, 128, 7168, 2048), (40, 64, 1408, 2048),
                       (3, 8, 2048, 1408)]:
        bn, splits = default_blocks(M, G, K, N, 16, 64)
        assert N % bn == 0 and K % (64 * splits) == 0 and K // (64 * splits) >= 2
        tiles = -(-M // 16) + min(G, M)
        assert tiles * (N // bn) * splits >= target_programs() or bn == 16


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_equals_ragged_dot(seed, splits):
    """Split-K partials (float32, summed by the wrapper) == ragged_dot, with empty groups and
    rows past the groups; bf16 too."""
    x, w, sizes = random_case(seed, 30, 128, 32, 6, jnp.float32, fill=0.8, empty=2)
    got = grouped_matmul(x, w, sizes, interpret=True, block_n=16, block_k=16, num_splits=splits)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[int(np.asarray(sizes).sum()):] == 0)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    got = grouped_matmul(xb, wb, sizes, interpret=True, block_n=16, block_k=32, num_splits=splits)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2,
                               atol=3e-2)


def test_default_split_k_path_equals_ragged_dot():
    """Few rows over many groups with a deep K: the defaults pick split-K."""
    from pallas_kernels.grouped_matmul.grouped_matmul import default_blocks
    x, w, sizes = random_case(3, 6, 256, 64, 16, jnp.float32, fill=1.0, empty=10)
    assert default_blocks(6, 16, 256, 64, 16, 64)[1] > 1
    got = grouped_matmul(x, w, sizes, interpret=True)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bad_num_splits_names_the_value():
    x, w, sizes = random_case(0, 16, 64, 32, 2, jnp.float32)
    with pytest.raises(ValueError, match="num_splits=3 must be >= 1 and divide K=64"):
        grouped_matmul(x, w, sizes, block_k=16, num_splits=3, interpret=True)


def swiglu_reference(x, wg, wu, wd, sizes):
    """The three-ragged_dot SwiGLU in float32."""
    hi = jax.lax.Precision.HIGHEST
    f = lambda a: a.astype(jnp.float32)                                      # noqa: E731
    h = jax.nn.silu(jax.lax.ragged_dot(f(x), f(wg), sizes, precision=hi)) \
        * jax.lax.ragged_dot(f(x), f(wu), sizes, precision=hi)
    return jax.lax.ragged_dot(h, f(wd), sizes, precision=hi)


def swiglu_case(seed, M, E, I, G, dtype, fill=1.0, empty=0):
    x, wg, sizes = random_case(seed, M, E, I, G, dtype, fill, empty)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed + 100))
    wu = (jax.random.normal(k1, (G, E, I), jnp.float32) / np.sqrt(E)).astype(dtype)
    wd = (jax.random.normal(k2, (G, I, E), jnp.float32) / np.sqrt(I)).astype(dtype)
    return x, wg, wu, wd, sizes


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("M,E,I,G,fill,empty,gu,down", [
    (50, 64, 32, 5, 1.0, 1, (16, 16, 1, None), (16, 16, 1, None)),   # an empty group
    (37, 32, 48, 4, 0.7, 0, (16, 32, 1, None), (32, 16, 1, None)),   # rows past the groups
    (8, 64, 64, 16, 1.0, 8, (32, 16, 2, None), (16, 16, 2, None)),   # decode: split-K both
    (30, 128, 32, 6, 0.8, 2, (16, 16, 4, None), (16, 16, 1, None)),  # gate/up split 4 ways
    (6, 256, 64, 16, 1.0, 10, None, None),                           # the defaults (split-K)
])
def test_grouped_swiglu_equals_three_ragged_dots(seed, M, E, I, G, fill, empty, gu, down):
    x, wg, wu, wd, sizes = swiglu_case(seed, M, E, I, G, jnp.float32, fill, empty)
    got = grouped_swiglu(x, wg, wu, wd, sizes, gate_up_blocks=gu, down_blocks=down,
                         interpret=True)
    want = swiglu_reference(x, wg, wu, wd, sizes)
    assert got.shape == (M, E) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[int(np.asarray(sizes).sum()):] == 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("columns_fastest", [False, True])
@pytest.mark.parametrize("gu,down", [((16, 16, 1, None), (16, 16, 1, None)),
                                     ((16, 16, 2, None), (16, 16, 2, None))])
def test_grouped_swiglu_in_either_grid_order(seed, columns_fastest, gu, down):
    """columns_fastest (the default) orders the grid column blocks fastest, False row tiles
    fastest; the result must not change: several row tiles, several column blocks, an empty
    group, with and without split-K."""
    x, wg, wu, wd, sizes = swiglu_case(seed, 50, 64, 64, 5, jnp.float32, 0.9, 1)
    got = grouped_swiglu(x, wg, wu, wd, sizes, block_m=16, gate_up_blocks=gu, down_blocks=down,
                         columns_fastest=columns_fastest, interpret=True)
    want = swiglu_reference(x, wg, wu, wd, sizes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[int(np.asarray(sizes).sum()):] == 0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("I", [128, 96])
def test_grouped_swiglu_prefill_tiles(seed, I):
    """At a mean of >= 64 rows per expert the defaults switch to 128-row tiles with 128 gate/up
    columns (where they divide I; else the usual columns): same result, rows of a partial
    last tile and an empty group included."""
    assert is_prefill(300, 3) and not is_prefill(190, 3)
    assert prefill_tiles(None, 128) == (128, (128, None, None, None))
    assert prefill_tiles((64, 32, None, None), 128) == (128, (64, 32, None, None))
    assert prefill_tiles(None, 96)[1][0] is None
    x, wg, wu, wd, sizes = swiglu_case(seed, 300, 32, I, 3, jnp.float32, 0.9, 1)
    got = grouped_swiglu(x, wg, wu, wd, sizes, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(
        swiglu_reference(x, wg, wu, wd, sizes)), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(got)[int(np.asarray(sizes).sum()):] == 0)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("splits", [1, 2])
def test_grouped_swiglu_bf16_and_other_activation(seed, splits):
    x, wg, wu, wd, sizes = swiglu_case(seed, 40, 64, 32, 4, jnp.bfloat16)
    got = grouped_swiglu(x, wg, wu, wd, sizes, gate_up_blocks=(16, 32, splits, None),
                         interpret=True)
    want = swiglu_reference(x, wg, wu, wd, sizes)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=3e-2,
                               atol=3e-2)
    gelu = grouped_swiglu(x.astype(jnp.float32), wg.astype(jnp.float32), wu.astype(jnp.float32),
                          wd.astype(jnp.float32), sizes, activation=jax.nn.gelu,
                          gate_up_blocks=(16, 32, splits, None), interpret=True)
    f = lambda a: a.astype(jnp.float32)                                      # noqa: E731
    hi = jax.lax.Precision.HIGHEST
    h = jax.nn.gelu(jax.lax.ragged_dot(f(x), f(wg), sizes, precision=hi)) \
        * jax.lax.ragged_dot(f(x), f(wu), sizes, precision=hi)
    np.testing.assert_allclose(np.asarray(gelu), np.asarray(
        jax.lax.ragged_dot(h, f(wd), sizes, precision=hi)), rtol=1e-5, atol=1e-5)


def test_grouped_swiglu_bad_inputs_name_the_value():
    x, wg, wu, wd, sizes = swiglu_case(0, 16, 32, 32, 2, jnp.float32)
    with pytest.raises(ValueError, match="w_gate and w_up must be .* got \\(2, 32, 32\\) and "
                                         "\\(2, 32, 16\\)"):
        grouped_swiglu(x, wg, wu[..., :16], wd, sizes, interpret=True)
    with pytest.raises(ValueError, match="w_down must be \\[experts=2, I=32, E=32\\], got "
                                         "\\(2, 16, 32\\)"):
        grouped_swiglu(x, wg, wu, wd[:, :16], sizes, interpret=True)
    with pytest.raises(ValueError, match="num_splits=3 must be >= 1 and divide K=32"):
        grouped_swiglu(x, wg, wu, wd, sizes, gate_up_blocks=(16, 16, 3, None), interpret=True)
