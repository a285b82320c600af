"""The model-family registry: every model_type is claimed by one family module, and a family
added from outside (here, from this file) is read, validated, keyed and exported through it."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import ModelConfig
from mtpjax.checkpoint import export_hf, key_table, load_hf
from mtpjax.checkpoint.hf_export import hf_config_dict
from mtpjax.models import registry
from mtpjax.models.registry import Family, family_for, register_family, supported_model_types

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, num_nextn_predict_layers=1)


def test_every_model_type_has_exactly_one_family():
    types = supported_model_types()
    assert {"llama", "qwen2", "qwen3", "mimo", "deepseek_v2", "deepseek_v3", "kimi_k2",
            "glm4_moe"} <= set(types)
    assert len(types) == len(set(types))
    for t in types:
        assert t in family_for(t).model_types
    from mtpjax.config import SUPPORTED_MODEL_TYPES
    assert SUPPORTED_MODEL_TYPES == types


@pytest.mark.parametrize("bad", ["gpt_neox", None, 3])
def test_an_unclaimed_model_type_is_named(bad):
    with pytest.raises(ValueError, match=f"model_type {bad!r} is not supported; supported:"):
        ModelConfig.from_hf({**HF, "model_type": bad})
    with pytest.raises(ValueError, match="is not supported"):
        ModelConfig(model_type=bad)


def _toy_family():
    """A Llama with its MTP modules in MiMo's layout, q/k norms said by its own key."""
    def read(config, model_type):
        return {"qk_norm": bool(config.get("toy_qk_norm", False))}

    def write(cfg, d):
        d["toy_qk_norm"] = cfg.qk_norm

    def check(cfg):
        if not cfg.qk_norm:
            raise ValueError("a toy model has qk_norm")
    return Family("toy", {"toy": "ToyForCausalLM"}, "mimo", read, write, check)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    registry._load_builtin()
    return register_family(_toy_family())


def test_a_family_from_one_module_reads_keys_and_exports(toy, tmp_path):
    cfg = ModelConfig.from_hf({**HF, "model_type": "toy", "toy_qk_norm": True})
    assert (cfg.model_type, cfg.qk_norm, cfg.num_mtp_layers) == ("toy", True, 1)
    with pytest.raises(ValueError, match="a toy model has qk_norm"):
        ModelConfig.from_hf({**HF, "model_type": "toy"})
    names = set(key_table(cfg).slots)
    assert "model.mtp_layers.0.token_layernorm.weight" in names          # its MTP layout
    assert "model.layers.0.self_attn.q_norm.weight" in names
    d = hf_config_dict(cfg)
    assert d["architectures"] == ["ToyForCausalLM"] and d["toy_qk_norm"] is True
    for seed in (0, 1):
        params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed))
        out = tmp_path / f"toy{seed}"
        export_hf(str(out), params, cfg)
        assert json.loads((out / "config.json").read_text())["model_type"] == "toy"
        back = load_hf(str(out), jnp.float32)
        assert back.cfg == cfg
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_model_type_cannot_be_claimed_twice(toy):
    clash = Family("other", {"llama": "X"}, "deepseek", lambda c, t: {}, lambda c, d: None)
    with pytest.raises(ValueError, match="model_type 'llama' is already claimed by family 'llama'"):
        register_family(clash)
