"""MoE grouped matmul: the exact tiled path equals `jax.lax.ragged_dot` (random group sizes,
empty groups, rows past the groups, several tiles), and the model's MoE layer gives the same
output through either path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.model import grouped_matmul as gm


def _case(seed, M, G, E, I, dtype):
    r = np.random.default_rng(seed)
    used = int(r.integers(0, M + 1))                       # rows past `used` belong to no group
    cuts = np.sort(r.integers(0, used + 1, G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [used]])).astype(np.int32)
    sizes[r.random(G) < 0.3] = 0                           # empty groups
    sizes[-1] += used - sizes.sum()                        # keep sum(sizes) == used
    x = jnp.asarray(r.standard_normal((M, E)), dtype)
    w = jnp.asarray(r.standard_normal((G, E, I)) / np.sqrt(E), dtype)
    return x, w, jnp.asarray(sizes)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("tile", [None, 4, 16])
def test_tiled_equals_ragged_dot(seed, tile):
    x, w, sizes = _case(seed, M=int(37 + 11 * seed), G=5 + seed, E=12, I=9, dtype=jnp.float32)
    want = jax.lax.ragged_dot(x, w, sizes)
    got = jax.jit(gm.tiled_grouped_matmul, static_argnums=3)(x, w, sizes, tile)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.asarray(got)[int(sizes.sum()):].any()   # rows past the groups: zero


def test_tiled_bf16_and_tile_choice():
    x, w, sizes = _case(7, M=64, G=4, E=16, I=8, dtype=jnp.bfloat16)
    got = gm.tiled_grouped_matmul(x, w, sizes)
    want = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.05, rtol=0.02)
    assert [gm.tile_rows(M, 64) for M in (6, 1536, 24576, 10 ** 6)] == [16, 32, 256, 256]


def test_choice_env_and_moe_layer_through_both_paths(monkeypatch):
    from tests.model.test_deepseek import _ds_params, ds_config
    from mtpjax.model.kinds import ffn_kind
    one_gpu = jax.default_backend() == "gpu" and jax.device_count() == 1
    for rows, groups in ((10 ** 6, 8), (15, 8), (1, 64)):
        assert gm.matmul_choice(rows, groups) == ("pallas" if one_gpu else "ragged")
    # on one GPU the kernel at every size: ragged_dot there reads every expert's weights
    with monkeypatch.context() as m:
        m.setattr(jax, "default_backend", lambda: "gpu")
        m.setattr(jax, "device_count", lambda: 1)
        assert {gm.matmul_choice(r, 64) for r in (1, 6, 127, 10 ** 5)} == {"pallas"}
        m.setattr(jax, "device_count", lambda: 2)
        assert gm.matmul_choice(6, 64) == "ragged"
        assert gm.matmul_choice(6, 64, per_device=True) == "pallas"
    monkeypatch.setenv(gm.ENV, "fast")
    with pytest.raises(ValueError, match="MTPJAX_MOE_MATMUL='fast': expected auto, ragged, tiled or pallas"):
        gm.matmul_choice(8, 8)
    cfg = ds_config(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2)
    p = _ds_params(cfg, 0)["layers"][1]
    x = jax.random.normal(jax.random.PRNGKey(2), (40, cfg.hidden_size))
    valid = jnp.arange(40) < 33                            # padding tokens are routed nowhere
    outs = {}
    for path in ("ragged", "tiled", "pallas"):            # pallas: the kernel, interpreted
        monkeypatch.setenv(gm.ENV, path)
        outs[path] = ffn_kind("moe")(p, x, cfg, valid)     # eager: the choice is read now
    np.testing.assert_allclose(outs["tiled"], outs["ragged"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(outs["pallas"], outs["ragged"], atol=1e-5, rtol=1e-5)
