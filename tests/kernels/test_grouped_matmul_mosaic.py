"""The Mosaic-GPU grouped matmul (pallas_kernels/grouped_matmul/kernel_mgpu.py) behind
grouped_swiglu(kernel="mosaic"): == three float32 ragged_dots on bf16 inputs, interpreted on
CPU (MTPJAX_KERNELS_ON_DEVICE=1 runs the compiled kernel on a GPU); the default choice; its
ValueErrors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import grouped_swiglu
from pallas_kernels.grouped_matmul import routed_ffn
from pallas_kernels.grouped_matmul import kernel_mgpu
from pallas_kernels.grouped_matmul.kernel_mgpu import grouped_matmul_mgpu
from tests.kernel_oracle import interpret_mode
from tests.kernels.test_kernels_grouped_matmul import swiglu_case, swiglu_reference


# Interpreted Mosaic kernels are slow on the CPU (5-10 s a case): one seed a case, four
# seeds over the cases.
@pytest.mark.parametrize("seed,M,E,I,G,empty,gu,down,stages,persistent", [
    # 3 tiles of live rows over 3 groups (one empty), 2 gate/up column blocks, K = 192 in
    # 3 steps through a 2-slot ring (slots reused), the down projection 192 columns wide
    (0, 300, 192, 128, 4, 1, (64, None, None, None), None, 2, False),
    # the defaults (128 gate/up columns, 4 stages); rows past the groups (sum < M)
    (2, 200, 128, 128, 2, 0, None, None, None, False),
    # a persistent grid of 4 CTAs over 7 tiles x 2 gate/up columns (and 7 x 1 down)
    (3, 300, 128, 128, 4, 1, (64, None, None, None), None, 2, 4),
])
def test_mosaic_swiglu_equals_three_ragged_dots(seed, M, E, I, G, empty, gu, down, stages,
                                                persistent):
    x, wg, wu, wd, sizes = swiglu_case(seed, M, E, I, G, jnp.bfloat16, 0.9, empty)
    got = grouped_swiglu(x, wg, wu, wd, sizes, gate_up_blocks=gu, down_blocks=down,
                         num_stages=stages, kernel="mosaic", persistent=persistent,
                         interpret=interpret_mode())
    want = np.asarray(swiglu_reference(x, wg, wu, wd, sizes))
    assert got.shape == (M, E) and got.dtype == jnp.bfloat16
    got = np.asarray(got, np.float32)
    # bf16 hidden rows between the two kernels: errors of bf16 rounding, relative to the
    # output's scale
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=2e-2)
    total = int(np.asarray(sizes).sum())
    assert np.all(got[total:] == 0)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("num_ctas,groups,band_tiles,tile_rows", [
    (None, [2, -1, 0, 2], None, None),
    # runs of one expert's tiles, cut into bands of 2 (the items of a band: its tiles
    # fastest); tails of 40, 64 and 65 live rows (wg 1 idles at 40 and 64)
    (3, [1, 1, 1, -1, 0, 0, 2], 2, [128, 128, 40, 0, 128, 64, 65]),
    (None, [1, 0, 0, 2], None, [1, 128, 64, 100]),
])
def test_mosaic_kernel_reads_each_tiles_own_expert(num_ctas, groups, band_tiles, tile_rows):
    """Tiles name their expert in any order, empty tiles (-1) in between: each live row of a
    tile is its row times its expert's weights (one weight, no activation). num_ctas 3: a
    persistent grid, 14 (tile, column) items over 3 CTAs, the 2-slot ring's slots and
    barrier phases running on across each CTA's items (2 K blocks each, empty items none)."""
    ks = jax.random.split(jax.random.key(3), 2)
    xp = jax.random.normal(ks[0], (len(groups) * 128, 128), jnp.float32).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(ks[1], (3, 128, 128), jnp.float32)).astype(jnp.bfloat16)
    out = np.asarray(grouped_matmul_mgpu(xp, (w,), jnp.asarray(groups, jnp.int32), block_n=64,
                                         num_stages=2, num_ctas=num_ctas,
                                         band_tiles=band_tiles,
                                         tile_rows=None if tile_rows is None
                                         else jnp.asarray(tile_rows, jnp.int32),
                                         interpret=interpret_mode()), np.float32)
    live = [128] * len(groups) if tile_rows is None else tile_rows
    f = lambda a: np.asarray(a, np.float32)                                   # noqa: E731
    for t, g in enumerate(groups):
        if g >= 0:
            rows = slice(t * 128, t * 128 + live[t])
            np.testing.assert_allclose(out[rows], f(xp[rows]) @ f(w[g]), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("band_tiles", [1, 3, kernel_mgpu.BAND_TILES])
def test_band_order_runs_one_experts_tiles_side_by_side(seed, band_tiles):
    """The work items' order (`tile_bands`, `band_item`) on random tile layouts: every (tile,
    column block) item exactly once; a band lies in one run of a group's tiles and holds at
    most band_tiles of them; its items are consecutive, tiles fastest, so one expert's tiles
    read a weight block at nearly the same time (what keeps the weights' DRAM reads to one
    per block; docs/kernels.md). band_tiles 1 is the column-blocks-fastest order."""
    # The default must keep bands: column blocks fastest (1) read the V3 slice's weights
    # from DRAM ~1.4x over (docs/kernels.md, "Band order").
    assert kernel_mgpu.BAND_TILES >= 4
    rng = np.random.default_rng(seed)
    runs = rng.integers(1, 12, 9)
    groups = np.concatenate([np.full(n, g) for g, n in zip(rng.permutation(9) - 1, runs)])
    num_cols = int(rng.integers(1, 6))
    start, size = (np.asarray(a) for a in kernel_mgpu.tile_bands(jnp.asarray(groups, jnp.int32),
                                                                 band_tiles))
    n = len(groups)
    t = np.arange(n)
    assert np.all((start <= t) & (t < start + size) & (size >= 1) & (size <= band_tiles))
    assert np.all(groups[start] == groups) and np.all(groups[start + size - 1] == groups)
    # bands are maximal: a band shorter than band_tiles ends its run
    ends = start + size
    assert np.all((size == band_tiles) | (ends == n) | (groups[np.minimum(ends, n - 1)] != groups))
    w = jnp.arange(n * num_cols, dtype=jnp.int32)
    tile, col = (np.asarray(a) for a in kernel_mgpu.band_item(
        w, num_cols, lambda b: (jnp.asarray(start)[b], jnp.asarray(size)[b])))
    assert sorted(zip(tile.tolist(), col.tolist())) == [(a, c) for a in range(n)
                                                        for c in range(num_cols)]
    for s in np.unique(start):                  # a band's items: consecutive, tiles fastest
        items = np.flatnonzero(tile == s)[0] + np.arange(size[s] * num_cols)
        assert tile[items].tolist() == [s + i % size[s] for i in range(size[s] * num_cols)]
        assert col[items].tolist() == [i // size[s] for i in range(size[s] * num_cols)]


def test_default_kernel_is_mosaic_only_at_large_prefill_sizes_on_hopper(monkeypatch):
    x = jax.ShapeDtypeStruct((256 * 8, 128), jnp.bfloat16)         # 256 rows per expert
    w = jax.ShapeDtypeStruct((8, 128, 256), jnp.bfloat16)
    small = jax.ShapeDtypeStruct((63 * 8, 128), jnp.bfloat16)      # decode sizes
    prefill = jax.ShapeDtypeStruct((255 * 8, 128), jnp.bfloat16)   # prefill, below 256

    class Hopper:
        platform, compute_capability = "gpu", "9.0"

    monkeypatch.delenv(routed_ffn.KERNEL_ENV, raising=False)
    monkeypatch.setattr(jax, "devices", lambda: [Hopper()])
    assert routed_ffn.default_kernel(x, w, interpret=False) == "mosaic"
    assert routed_ffn.default_kernel(small, w, interpret=False) == "triton"
    assert routed_ffn.default_kernel(prefill, w, interpret=False) == "triton"
    assert routed_ffn.default_kernel(x, w, interpret=True) == "triton"
    f32 = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    assert routed_ffn.default_kernel(f32, w, interpret=False) == "triton"
    assert routed_ffn.default_kernel(x, jax.ShapeDtypeStruct((8, 128, 96), jnp.bfloat16),
                                     interpret=False) == "triton"          # I % 64 != 0
    Hopper.compute_capability = "8.0"
    assert routed_ffn.default_kernel(x, w, interpret=False) == "triton"
    monkeypatch.setenv(routed_ffn.KERNEL_ENV, "mosaic")
    assert routed_ffn.default_kernel(x, w, interpret=True) == "mosaic"
    assert routed_ffn.default_kernel(small, w, interpret=True) == "triton"  # decode sizes
    assert routed_ffn.default_kernel(prefill, w, interpret=True) == "mosaic"
    monkeypatch.setenv(routed_ffn.KERNEL_ENV, "cuda")
    with pytest.raises(ValueError, match="MTPJAX_MOE_KERNEL must be one of .* got 'cuda'"):
        routed_ffn.default_kernel(x, w, interpret=False)


def test_mosaic_bad_inputs_name_the_value():
    x, wg, wu, wd, sizes = swiglu_case(0, 256, 64, 64, 2, jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel must be one of .* got 'cuda'"):
        grouped_swiglu(x, wg, wu, wd, sizes, kernel="cuda", interpret=True)
    with pytest.raises(ValueError, match="kernel='mosaic' takes bfloat16 .* float32"):
        f = lambda a: a.astype(jnp.float32)                                  # noqa: E731
        grouped_swiglu(f(x), f(wg), f(wu), f(wd), sizes, kernel="mosaic", interpret=True)
    with pytest.raises(ValueError, match="kernel='mosaic' runs 128-row tiles, got block_m=64"):
        grouped_swiglu(x, wg, wu, wd, sizes, block_m=64, kernel="mosaic", interpret=True)
    with pytest.raises(ValueError, match="persistent and band_tiles are options of "
                                         "kernel='mosaic', got persistent=True"):
        grouped_swiglu(x, wg, wu, wd, sizes, kernel="triton", persistent=True, interpret=True)
    with pytest.raises(ValueError, match="got persistent=False, band_tiles=2"):
        grouped_swiglu(x, wg, wu, wd, sizes, kernel="triton", band_tiles=2, interpret=True)
    with pytest.raises(ValueError, match="num_ctas must be None or >= 1, got 0"):
        grouped_matmul_mgpu(x, (wg,), jnp.zeros((2,), jnp.int32), block_n=64, num_ctas=0,
                            interpret=True)
    groups = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="block_n a multiple of 64, <= 256, dividing N=64; "
                                         "got block_n=128"):
        grouped_matmul_mgpu(x, (wg,), groups, block_n=128, interpret=True)
    with pytest.raises(ValueError, match="num_stages=4 with block_n=256 needs 394240 B of "
                                         "shared memory \\(persistent\\)"):
        grouped_matmul_mgpu(jnp.zeros((256, 512), jnp.bfloat16),
                            (jnp.zeros((2, 512, 256), jnp.bfloat16),) * 2,
                            jnp.zeros((2,), jnp.int32), activation=jax.nn.silu, block_n=256,
                            num_stages=4, num_ctas=132, interpret=True)
    with pytest.raises(ValueError, match="num_stages=8 with block_n=256 needs .* B of shared"):
        grouped_matmul_mgpu(jnp.zeros((256, 512), jnp.bfloat16),
                            (jnp.zeros((2, 512, 256), jnp.bfloat16),) * 2, groups,
                            activation=jax.nn.silu, block_n=256, num_stages=8, interpret=True)
    with pytest.raises(ValueError, match="tile_rows must be int32\\[n_tiles=2\\], got \\(3,\\)"):
        grouped_matmul_mgpu(x, (wg,), groups, block_n=64, tile_rows=jnp.zeros(3, jnp.int32),
                            interpret=True)
    with pytest.raises(ValueError, match="band_tiles must be an int >= 1, got 0"):
        grouped_matmul_mgpu(x, (wg,), groups, block_n=64, band_tiles=0, interpret=True)
    with pytest.raises(ValueError, match="two weights \\(gate, up\\) need an activation"):
        grouped_matmul_mgpu(x, (wg, wu), groups, block_n=64, interpret=True)
    with pytest.raises(ValueError, match="whole 128-row tiles, one tile_group entry each, "
                                         "got tile_group \\(3,\\)"):
        grouped_matmul_mgpu(x, (wg,), jnp.zeros((3,), jnp.int32), block_n=64, interpret=True)


def test_the_moe_layer_runs_the_mosaic_kernels_at_prefill_sizes(monkeypatch):
    """The model's MoE layer with the Mosaic kernels (what a Hopper GPU takes from 256 rows per
    expert; forced here, interpreted) == the dense every-expert formula on bf16 weights, at
    128 tokens over 4 experts (64 rows each); a spy checks both kernel calls ran."""
    from mtpjax.model.grouped_matmul import forced_path
    from mtpjax.model.kinds import ffn_kind
    from mtpjax.model.moe import route
    from tests.kernel_oracle import rel_err
    from tests.model.test_deepseek import _ds_params, ds_config

    monkeypatch.setenv(routed_ffn.KERNEL_ENV, "mosaic")
    from pallas_kernels.grouped_matmul import kernel_mgpu
    calls = []
    kernel = kernel_mgpu.grouped_matmul_mgpu
    monkeypatch.setattr(kernel_mgpu, "grouped_matmul_mgpu",
                        lambda xp, w, *a, **k: calls.append(len(w)) or kernel(xp, w, *a, **k))
    cfg = ds_config(hidden_size=64, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                    topk_group=1, moe_intermediate_size=64)
    p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), _ds_params(cfg, 0)["layers"][1])
    N = 128
    x = jax.random.normal(jax.random.PRNGKey(1), (N, cfg.hidden_size)).astype(jnp.bfloat16)
    with forced_path("pallas"):
        got = ffn_kind("moe")(p, x, cfg, jnp.ones(N, bool))
    assert calls == [2, 1]                 # gate/up, then down
    f = {k: v.astype(jnp.float32) for k, v in p.items()}
    xf = x.astype(jnp.float32)
    ids, w = route(p, x, cfg.moe)
    act = jax.nn.silu(jnp.einsum("ne,xei->nxi", xf, f["w_gate"])) * jnp.einsum(
        "ne,xei->nxi", xf, f["w_up"])
    each = jnp.einsum("nxi,xie->nxe", act, f["w_down"])                    # [N, X, E]
    gate = jnp.zeros((N, cfg.moe.n_routed_experts)).at[jnp.arange(N)[:, None], ids].add(w)
    shared = (jax.nn.silu(xf @ f["shared_gate"]) * (xf @ f["shared_up"])) @ f["shared_down"]
    want = jnp.einsum("nx,nxe->ne", gate, each) + shared
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) < 2e-2
