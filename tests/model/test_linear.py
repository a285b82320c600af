"""`linear` never hands XLA a one-row projection (model/linear.py says why), and equals x @ w."""

import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.model.linear import linear

gen = importlib.import_module("mtpjax.generate")
CFG = mtpjax.ModelConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_layers=1)
# a stablehlo.dot_general of a one-row lhs [1, E] with a 2-D rhs (a weight)
ONE_ROW_DOT = re.compile(r"stablehlo\.dot_general.*: \(tensor<1x\d+x[bf]\w*>, tensor<\d+x\d+x[bf]\w*>\)")


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (3,), (2, 5)])
def test_linear_equals_matmul(seed, lead):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (*lead, 24), jnp.float32)
    w = jax.random.normal(kw, (24, 40), jnp.float32)
    y = linear(x, w)
    assert y.shape == (*lead, 40)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=1e-5, atol=1e-5)


def test_one_row_is_computed_as_two():
    text = jax.jit(linear).lower(jnp.ones((1, 24)), jnp.ones((24, 40))).as_text()
    assert "tensor<2x24xf32>" in text and not ONE_ROW_DOT.search(text)


def lowered_loop(monkeypatch, params, spec) -> str:
    """StableHLO of generate's on-device loop for one prompt (batch 1)."""
    fn, seen = gen._loop, {}

    def spy(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return fn(*args, **kwargs)

    monkeypatch.setattr(gen, "_loop", spy)
    mtpjax.generate(params, CFG, [[1, 2, 3]], max_new_tokens=3, spec=spec)
    monkeypatch.undo()
    return fn.lower(*seen["args"], **seen["kwargs"]).as_text()


@pytest.mark.parametrize("spec", [None, mtpjax.SpecConfig(num_speculative_tokens=2)],
                         ids=["plain", "mtp"])
def test_batch1_generate_has_no_one_row_projection(monkeypatch, spec):
    """At batch 1 plain, every projection of generate's step has one row; the draft passes
    have one row at batch 1 with speculation. None may reach XLA as a [1, E] dot."""
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    text = lowered_loop(monkeypatch, params, spec)
    assert text.count("stablehlo.dot_general") >= 7 * CFG.num_layers
    assert ONE_ROW_DOT.findall(text) == []


ONE_ROW_PAD = re.compile(r"stablehlo\.pad .*: \(tensor<1x\d+x")


@pytest.mark.parametrize("spec", [None, mtpjax.SpecConfig(num_speculative_tokens=2)],
                         ids=["plain", "mtp"])
def test_batch1_generate_needs_no_row_padding(monkeypatch, spec):
    """generate runs one request as two rows (the second a padding request), so no projection
    of its loop (target or draft pass) has one row for `linear` to pad: no pad kernels."""
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    text = lowered_loop(monkeypatch, params, spec)
    assert ONE_ROW_PAD.findall(text) == []
