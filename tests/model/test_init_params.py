"""Random params: a leaf too large to draw whole is drawn slice by slice with the same law."""
import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax.model.params as params_mod


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sliced_draw_keeps_the_law(monkeypatch, seed):
    monkeypatch.setattr(params_mod, "_WHOLE_DRAW_MAX", 500)
    shape = (3, 4, 40, 30)                 # 14400 elements: drawn per slice, twice nested
    x = np.asarray(params_mod._normal(jax.random.PRNGKey(seed), shape, 0.02, jnp.bfloat16)
                   .astype(jnp.float32))
    assert x.shape == shape
    # every slice is its own draw, none repeats another
    flat = x.reshape(12, -1)
    assert len({row.tobytes() for row in flat}) == 12
    # normal(0, 0.02): mean and std within 5 standard errors, per first-axis slice too
    n = x.size
    assert abs(x.mean()) < 5 * 0.02 / np.sqrt(n)
    assert abs(x.std() - 0.02) < 5 * 0.02 / np.sqrt(2 * n)
    for s in x:
        assert abs(s.std() - 0.02) < 5 * 0.02 / np.sqrt(2 * s.size)


def test_small_leaves_are_drawn_whole():
    key = jax.random.PRNGKey(3)
    got = params_mod._normal(key, (8, 16), 0.02, jnp.float32)
    want = 0.02 * jax.random.normal(key, (8, 16), jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _avals(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield v.aval
        for sub in jax_core.jaxprs_in_params(eqn.params):
            yield from _avals(sub)


def test_no_float32_temporary_of_a_large_leaf(monkeypatch):
    """The point of slicing: no float32 array of the whole leaf (30 GB at DeepSeek-V3's
    stacked experts) exists while it is drawn."""
    monkeypatch.setattr(params_mod, "_WHOLE_DRAW_MAX", 500)
    shape = (6, 40, 30)
    jaxpr = jax.make_jaxpr(lambda k: params_mod._normal(k, shape, 0.02, jnp.bfloat16))(
        jax.random.PRNGKey(0))
    big = [a for a in _avals(jaxpr.jaxpr) if getattr(a, "size", 0) >= np.prod(shape)]
    assert big and all(a.dtype == jnp.bfloat16 for a in big), big
