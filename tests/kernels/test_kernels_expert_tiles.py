"""`expert_tile_swiglu` (one tile per touched expert, no sort; interpret mode here, compiled on a
GPU with MTPJAX_KERNELS_ON_DEVICE=1) against a
per-pair float32 reference, its layout's invariants, its errors, and the MoE layer on it."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul.expert_tiles import (TILE_ROWS, expert_tile_layout,
                                                        expert_tile_swiglu)
from tests.kernel_oracle import interpret_mode


def case(seed, N, k, G, E, I, dtype=jnp.float32, none_frac=0.2):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(G, k, replace=False) for _ in range(N)]).astype(np.int32)
    none = rng.random((N, k)) < none_frac
    ids = np.where(none, rng.choice([-1, G, G + 5], (N, k)), ids).astype(np.int32)
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    w = lambda key, s: (0.3 * jax.random.normal(key, s)).astype(dtype)     # noqa: E731
    return (w(ks[0], (N, E)), ids, w(ks[1], (G, E, I)), w(ks[2], (G, E, I)), w(ks[3], (G, I, E)))


def reference(x, ids, wg, wu, wd, activation=jax.nn.silu):
    f = lambda a: np.asarray(a, np.float64)                                 # noqa: E731
    x, wg, wu, wd = f(x), f(wg), f(wu), f(wd)
    G = wg.shape[0]
    out = np.zeros(ids.shape + (x.shape[1],))
    for n, j in np.ndindex(ids.shape):
        e = ids[n, j]
        if 0 <= e < G:
            g, u = x[n] @ wg[e], x[n] @ wu[e]
            out[n, j] = np.asarray(activation(jnp.asarray(g)), np.float64) * u @ wd[e]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("N,k,G,gu,down", [
    (1, 2, 8, None, None),              # one token: the static layout
    (1, 3, 8, (16, 32, 2, None), (16, 16, 2, None)),     # ... with split-K on both kernels
    (1, 4, 4, None, None),              # one token touching every expert
    (5, 3, 6, None, None),              # more pairs than experts: tiles = G, shared tiles
    (16, 2, 4, None, None),             # the 16-row limit, every tile full
    (4, 2, 8, (16, 32, 2, None), (16, 16, 2, None)),     # split-K on both kernels
])
def test_equals_per_pair_reference(seed, N, k, G, gu, down):
    x, ids, wg, wu, wd = case(seed, N, k, G, 64, 32)
    got = expert_tile_swiglu(x, jnp.asarray(ids), wg, wu, wd, gate_up_blocks=gu,
                             down_blocks=down, interpret=interpret_mode())
    assert got.shape == (N, k, 64) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), reference(x, ids, wg, wu, wd), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_and_gelu(seed):
    x, ids, wg, wu, wd = case(seed, 3, 2, 8, 64, 32, jnp.bfloat16)
    got = expert_tile_swiglu(x, jnp.asarray(ids), wg, wu, wd, activation=jax.nn.gelu,
                             interpret=interpret_mode())
    want = reference(x, ids, wg, wu, wd, jax.nn.gelu)
    np.testing.assert_allclose(np.asarray(got), want, rtol=4e-2, atol=4e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layout_gives_each_pair_its_own_row_in_its_experts_tile(seed):
    rng = np.random.default_rng(seed)
    N, k, G = 12, 4, 10
    ids = np.stack([rng.choice(G, k, replace=False) for _ in range(N)])
    ids = np.where(rng.random((N, k)) < 0.25, -1, ids).reshape(-1).astype(np.int32)
    slot, tile_group, source = map(np.asarray, expert_tile_layout(jnp.asarray(ids), G))
    n_tiles = min(ids.size, G)
    assert tile_group.shape == (n_tiles,) and source.shape == (n_tiles * TILE_ROWS,)
    real = ids >= 0
    assert np.all(slot[~real] == n_tiles * TILE_ROWS)
    assert len(set(slot[real])) == real.sum()                     # one row per pair
    # source inverts slot: each pair's row names that pair, every other row names none
    np.testing.assert_array_equal(source[slot[real]], np.flatnonzero(real))
    assert np.sum(source >= 0) == real.sum()
    np.testing.assert_array_equal(tile_group[slot[real] // TILE_ROWS], ids[real])
    used = tile_group[tile_group >= 0]
    assert sorted(used) == sorted(set(ids[real]))                 # one tile per touched expert
    assert np.all(tile_group[len(used):] == -1)                   # used tiles come first


def test_bad_inputs_name_the_value():
    x, ids, wg, wu, wd = case(0, 17, 2, 8, 32, 32)
    with pytest.raises(ValueError, match="at most 16 tokens, got 17"):
        expert_tile_swiglu(x, jnp.asarray(ids), wg, wu, wd, interpret=True)
    x, ids, wg, wu, wd = case(0, 2, 2, 8, 32, 32)
    with pytest.raises(ValueError, match="ids must be integers, got float32"):
        expert_tile_swiglu(x, jnp.asarray(ids, jnp.float32), wg, wu, wd, interpret=True)
    with pytest.raises(ValueError, match="w_down must be \\[experts=8, I=32, E=32\\]"):
        expert_tile_swiglu(x, jnp.asarray(ids), wg, wu, wd[:, :16], interpret=True)
    with pytest.raises(ValueError, match="same N"):
        expert_tile_swiglu(x[:1], jnp.asarray(ids), wg, wu, wd, interpret=True)


def test_lowers_to_triton_for_cuda():
    from jax import export
    args = (jax.ShapeDtypeStruct((8, 256), jnp.bfloat16), jax.ShapeDtypeStruct((8, 6), jnp.int32),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 128, 256), jnp.bfloat16))
    exp = export.export(jax.jit(expert_tile_swiglu), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exp.mlir_module()
    assert 'name = "expert_tiles_gate_up' in text and 'name = "expert_tiles_down' in text
    assert "stablehlo.sort" not in text                           # the point of the layout
    assert "stablehlo.scatter" not in text     # each scatter: a fill and a scatter kernel


def test_one_token_layout_is_static():
    """One token (batch-1 decode): tiles are the token's k slots, so the export holds no
    gather, no sort and no scatter around the two kernels (each is a small GPU kernel; the
    1-token V2-Lite layer once ran seven of them beside its two matmuls)."""
    from jax import export
    args = (jax.ShapeDtypeStruct((1, 256), jnp.bfloat16), jax.ShapeDtypeStruct((1, 6), jnp.int32),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 256, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((16, 128, 256), jnp.bfloat16))
    for blocks in (None, (64, 64, 2, None)):                     # with and without split-K
        f = jax.jit(lambda *a, b=blocks: expert_tile_swiglu(*a, gate_up_blocks=b, down_blocks=b))
        text = export.export(f, platforms=["cuda"], disabled_checks=[
            export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args).mlir_module()
        assert 'name = "expert_tiles_gate_up' in text and 'name = "expert_tiles_down' in text
        for op in ("gather", "sort", "scatter"):
            assert f"stablehlo.{op}" not in text, (blocks, op)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("N", [8, 1])                  # 1: the static one-token layout
def test_moe_layer_on_expert_tiles_equals_the_sorted_layout(seed, N):
    """The MoE layer at decode sizes (forced onto the Pallas path, interpreted) gives the same
    outputs through the expert tiles as through the sorted layout, padding tokens included."""
    from mtpjax.model.grouped_matmul import forced_path
    from mtpjax.model.moe import routed_experts
    k, G = 3, 8
    x, ids, wg, wu, wd = case(seed, N, k, G, 64, 32, none_frac=0.0)
    p = {"w_gate": wg, "w_up": wu, "w_down": wd}
    w = jax.random.uniform(jax.random.PRNGKey(seed), (N, k))
    # one token: valid for seed 0, a padding token for seed 1
    valid = jnp.arange(N) % 3 != 1 if N > 1 else jnp.asarray([seed == 0])
    with forced_path("pallas"):
        tiles = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu)
        text = jax.jit(lambda x: routed_experts(p, x, jnp.asarray(ids), w, valid,
                                                jax.nn.silu)).lower(x).as_text()
        sorted_ = routed_experts(p, x, jnp.asarray(ids), w, valid, jax.nn.silu,
                                 expert_tiles=False)
    assert "stablehlo.sort" not in text
    np.testing.assert_allclose(np.asarray(tiles), np.asarray(sorted_), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(tiles)[~np.asarray(valid)], 0.0)
