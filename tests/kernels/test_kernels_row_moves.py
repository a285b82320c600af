"""`scatter_rows` / `combine_rows` (the MoE rows into the expert-tile layout and back) and
`moe_swiglu` (the routed FFN from token order and back on them): interpret mode here,
compiled on a GPU with MTPJAX_KERNELS_ON_DEVICE=1, against numpy / float64 references; and a
guard that the model's prefill MoE path moves x's rows by the kernel, not by XLA gathers."""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul.grouped_matmul import pair_layout, tile_layout, tile_live_rows
from pallas_kernels.grouped_matmul.routed_ffn import moe_swiglu
from pallas_kernels.grouped_matmul.row_moves import combine_rows, scatter_rows
from tests.kernel_oracle import interpret_mode
from tests.kernels.test_kernels_expert_tiles import case, reference


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("N,E,M,rows,dtype", [
    (13, 96, 30, 48, jnp.bfloat16),     # M not a multiple of the 8-row block; 32-col blocks
    (5, 64, 9, 9, jnp.float32),         # every output row written
    (40, 1024, 17, 64, jnp.bfloat16),   # two 512-column blocks
])
def test_scatter_writes_each_row_once_and_nothing_else(seed, N, E, M, rows, dtype):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((N, E)), dtype)
    src = rng.integers(0, N, M).astype(np.int32)
    dest = rng.permutation(rows)[:M].astype(np.int32)
    dropped = rng.random(M) < 0.2                   # dests past the layout: no write
    dest = np.where(dropped, rows + rng.integers(0, 3, M), dest).astype(np.int32)
    out = np.asarray(scatter_rows(x, jnp.asarray(src), jnp.asarray(dest), num_rows=rows,
                                  interpret=interpret_mode()), np.float32)
    assert out.shape == (rows, E)
    xs = np.asarray(x, np.float32)
    for i in np.flatnonzero(~dropped):
        np.testing.assert_array_equal(out[dest[i]], xs[src[i]])
    if interpret_mode():        # the interpreter fills what a kernel leaves unwritten with NaN
        untouched = np.setdiff1d(np.arange(rows), dest[~dropped])
        assert np.isnan(out[untouched]).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_combine_sums_the_pairs_rows_and_reads_no_other(seed):
    rng = np.random.default_rng(seed)
    mp, E, N, k = 40, 32, 11, 3
    y = rng.standard_normal((mp, E)).astype(np.float32)
    rows = rng.integers(0, mp + 5, (N, k)).astype(np.int32)       # >= mp: no row
    unread = np.setdiff1d(np.arange(mp), rows)
    y[unread] = np.nan                                            # padding rows hold anything
    w = rng.random((N, k)).astype(np.float32)
    got = combine_rows(jnp.asarray(y), jnp.asarray(rows), jnp.asarray(w))
    want = np.zeros((N, E))
    for n, j in np.ndindex(N, k):
        if rows[n, j] < mp:
            want[n] += w[n, j] * y[rows[n, j]].astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pair_layout_is_the_sorted_tile_layout(seed):
    """`pair_layout` (ranks by a triangular matmul, no sort) puts each pair where the stable
    sort by expert and `tile_layout` put it, with the same tiles and sizes; pairs routed
    nowhere (< 0 or >= G) get no row. M spans several 256-pair rank blocks. Each tile's live
    rows (`tile_live_rows`) are exactly its first rows that some pair lands in."""
    rng = np.random.default_rng(seed)
    M, G, block_m = int(rng.integers(1, 1400)), int(rng.integers(1, 40)), int(rng.choice([16, 64]))
    expert = rng.integers(-2, G + 3, M).astype(np.int32)
    dest, tile_group, Mp, sizes = pair_layout(jnp.asarray(expert), G, block_m)
    e = np.where((expert >= 0) & (expert < G), expert, G)
    want_sizes = np.bincount(e, minlength=G + 1)[:G]
    sorted_dest, want_tiles, want_mp = tile_layout(jnp.asarray(want_sizes, jnp.int32), M,
                                                   block_m)
    slot = np.empty(M, np.int64)
    slot[np.argsort(e, kind="stable")] = np.arange(M)
    assert Mp == want_mp
    np.testing.assert_array_equal(np.asarray(sizes), want_sizes)
    np.testing.assert_array_equal(np.asarray(tile_group), np.asarray(want_tiles))
    np.testing.assert_array_equal(np.asarray(dest), np.asarray(sorted_dest)[slot])
    live = np.asarray(tile_live_rows(sizes, tile_group, block_m))
    taken = np.zeros(Mp, bool)
    taken[np.asarray(dest)[np.asarray(dest) < Mp]] = True
    want_live = (np.arange(block_m) < live[:, None]).reshape(-1)
    np.testing.assert_array_equal(taken, want_live)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("N,k,G,E,I,dtype,tol", [
    (24, 3, 6, 64, 32, jnp.float32, 1e-4),      # many pairs per expert, some routed nowhere
    (9, 2, 8, 32, 64, jnp.bfloat16, 4e-2),      # an expert nobody chose
])
def test_moe_swiglu_equals_the_per_pair_reference(seed, N, k, G, E, I, dtype, tol):
    x, ids, wg, wu, wd = case(seed, N, k, G, E, I, dtype, none_frac=0.25)
    w = np.random.default_rng(seed + 7).random((N, k)).astype(np.float32)
    got = moe_swiglu(x, jnp.asarray(ids), jnp.asarray(w), wg, wu, wd, kernel="triton",
                     interpret=interpret_mode())
    assert got.shape == (N, E) and got.dtype == dtype
    want = (reference(x, ids, wg, wu, wd) * w[..., None]).sum(1)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)


def test_bad_inputs_name_the_value():
    x = jnp.zeros((4, 32), jnp.float32)
    with pytest.raises(ValueError, match="src and dest must be \\[M\\] of one shape, got "
                                         "\\(3,\\) and \\(2,\\)"):
        scatter_rows(x, jnp.zeros(3, jnp.int32), jnp.zeros(2, jnp.int32), num_rows=8,
                     interpret=True)
    wg = jnp.zeros((2, 32, 16))
    with pytest.raises(ValueError, match="ids must be an integer \\[N, k\\] and weights \\[N, k\\] "
                                         "of its shape, got ids int32\\[4, 2\\] and weights "
                                         "\\[4, 1\\]"):
        moe_swiglu(x, jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 1)), wg, wg,
                   jnp.zeros((2, 16, 32)), interpret=True)
    with pytest.raises(ValueError, match="x must be \\[N=3, E\\], got \\[4, 32\\]"):
        moe_swiglu(x, jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1)), wg, wg,
                   jnp.zeros((2, 16, 32)), interpret=True)
    with pytest.raises(ValueError, match="w_down must be \\[experts=2, I=16, E=32\\]"):
        moe_swiglu(x, jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1)), wg, wg,
                   jnp.zeros((2, 32, 16)), interpret=True)


def _eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_the_prefill_moe_layer_moves_rows_by_the_kernel(monkeypatch):
    """Forced onto the Pallas path at prefill sizes, the MoE layer scatters x's rows into the
    tile layout with `scatter_rows` (one kernel launch), holds no XLA gather of [M, E] rows
    (the sorted copy x[token], or the padded layout built by gathering it: a tenth of a
    4096-token V2-Lite layer) and no sort."""
    from mtpjax.model.grouped_matmul import forced_path
    from mtpjax.model.moe import routed_experts
    N, k, G, E, I = 48, 2, 4, 64, 32
    x, ids, wg, wu, wd = case(0, N, k, G, E, I, none_frac=0.0)
    p = {"w_gate": wg, "w_up": wu, "w_down": wd}
    with forced_path("pallas"):
        jaxpr = jax.make_jaxpr(lambda x: routed_experts(
            p, x, jnp.asarray(ids), jnp.ones((N, k)), jnp.ones(N, bool), jax.nn.silu))(x)
    names = [str(e.params.get("name", "")) for e in _eqns(jaxpr.jaxpr)
             if e.primitive.name == "pallas_call"]
    assert names.count("moe_scatter_rows") == 1, names
    row_gathers = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "gather"
                   and e.outvars[0].aval.ndim == 2 and e.outvars[0].aval.shape[1] == E]
    assert not row_gathers, [e.outvars[0].aval for e in row_gathers]
    assert not [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "sort"]
