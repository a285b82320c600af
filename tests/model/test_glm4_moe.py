"""GLM-4.5 (model_type "glm4_moe") against transformers' Glm4MoeForCausalLM: partial rotary,
optional q/k norm, q/k/v biases, sigmoid + correction-bias group-limited MoE with a shared
expert, MTP modules in DeepSeek's layout.

The checkpoints and the parity checks are tests/model/hf_parity.py's; here are the family's
config and its own checks (config fields, partial rotary, the export's config.json).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.model import hf_parity  # noqa: E402  (needs torch and transformers)

GLM_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                partial_rotary_factor=0.5, attention_bias=True, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rms_norm_eps=1e-5, max_position_embeddings=256, num_nextn_predict_layers=1,
                bos_token_id=1, eos_token_id=7, tie_word_embeddings=False)
VARIANTS = {"qk_norm": dict(use_qk_norm=True), "no_qk_norm": dict(use_qk_norm=False)}
GLM = hf_parity.HFFamily("Glm4Moe", "glm4_moe", GLM_BASE, VARIANTS)


def _prompts(seed: int, n: int = 3):
    return hf_parity.prompts(GLM, seed, n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_parity.Checkpoints(GLM, tmp_path_factory, "glm")


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_from_hf_reads_the_glm_fields(checkpoints, variant):
    path, _ = checkpoints[variant, 0]
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.model_type, cfg.attention_kind, cfg.ffn_kind) == ("glm4_moe", "gqa", "moe")
    assert cfg.layer_kinds() == (("gqa", "dense"), ("gqa", "moe"), ("gqa", "moe"))
    assert cfg.mtp_layer_kind() == ("gqa", "moe") and cfg.num_mtp_layers == 1
    assert (cfg.head_dim, cfg.rotary_dim, cfg.qkv_bias) == (16, 8, True)
    assert cfg.qk_norm == (variant == "qk_norm")
    assert (cfg.moe.routing, cfg.moe.n_group, cfg.moe.topk_group, cfg.moe.n_shared_experts) == \
        ("sigmoid_group_limited_bias", 2, 1, 1)


@pytest.mark.parametrize("field,value,match", [
    ("partial_rotary_factor", 1.5, "partial_rotary_factor"),
    ("partial_rotary_factor", 0.1, "rotary dims"),          # 16 * 0.1 -> 1 dim: odd
    ("n_group", 3, "n_group"),
    ("mlp_bias", True, "mlp_bias"),
    ("partial_rotary_factor", "half", "partial_rotary_factor"),
])
def test_from_hf_names_a_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**GLM_BASE, "model_type": "glm4_moe", field: value})


def test_the_family_refuses_what_glm_cannot_hold():
    cfg = ModelConfig.from_hf({**GLM_BASE, "model_type": "glm4_moe"})
    with pytest.raises(ValueError, match="routes by 'sigmoid_group_limited_bias'"):
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, routing="softmax_greedy",
                                                         norm_topk_prob=False))
    with pytest.raises(ValueError, match="attention_kind 'gqa'"):
        ModelConfig(model_type="glm4_moe", attention_kind="mla", num_heads=4, num_kv_heads=4,
                    mla=dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                             v_head_dim=8))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partial_rotary_turns_only_the_leading_dims(seed):
    """The trailing head_dim - rotary_dim dims pass through; the leading ones equal a full
    rotary embedding of head size rotary_dim (rotate_half within them)."""
    from mtpjax.model.layers import apply_rope
    cfg = ModelConfig(model_type="glm4_moe", head_dim=16, partial_rotary_factor=0.5)
    full = dataclasses.replace(cfg, head_dim=8, partial_rotary_factor=1.0)
    x = jax.random.normal(jax.random.PRNGKey(seed), (2, 5, 3, 16))
    pos = jnp.broadcast_to(jnp.arange(5) * (seed + 3), (2, 5))
    got = apply_rope(x, pos, cfg)
    np.testing.assert_array_equal(np.asarray(got[..., 8:]), np.asarray(x[..., 8:]))
    want = apply_rope(x[..., :8], pos, full)
    np.testing.assert_allclose(np.asarray(got[..., :8]), np.asarray(want), atol=1e-6)
    assert not np.allclose(np.asarray(got[:, 1:, :, :8]), np.asarray(x[:, 1:, :, :8]))


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("seed", hf_parity.SEEDS)
def test_logits_match_transformers(checkpoints, variant, seed):
    hf_parity.check_logits(GLM, *checkpoints[variant, seed], seed)


def test_correction_bias_and_group_limit_change_the_experts(checkpoints):
    """The routing exercised by the parity above is not the trivial one."""
    path, _ = checkpoints["qk_norm", 0]
    x = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (256, GLM_BASE["hidden_size"]))
    by_bias, by_limit, _ = hf_parity.routing_differs(path, x)
    assert by_bias and by_limit


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generate_and_engine_spec_match_transformers(checkpoints, variant):
    hf_parity.check_greedy_generate_and_engine(GLM, *checkpoints[variant, 1])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_module_matches_transformers_decoder_layer(checkpoints, variant):
    """The MTP module written out in torch around transformers' own Glm4MoeDecoderLayer (GQA
    with partial rotary + MoE); hf_parity.check_mtp_module."""
    hf_parity.check_mtp_module(GLM, *checkpoints[variant, 0])


def test_export_round_trip_and_transformers_reads_it(checkpoints, tmp_path):
    path, model = checkpoints["qk_norm", 1]
    back = hf_parity.check_export_round_trip(GLM, path, model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert "scoring_func" not in written and written["partial_rotary_factor"] == 0.5
    ids = torch.as_tensor([_prompts(2, 1)[0]])
    back_logits = mtpjax.forward(back.params, back.cfg, jnp.asarray(ids.numpy()))
    np.testing.assert_allclose(np.asarray(back_logits), model(ids).logits.detach().numpy(),
                               atol=1e-4, rtol=1e-4)
