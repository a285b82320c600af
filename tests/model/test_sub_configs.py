"""ModelConfig's sub-configs: MLAConfig (attention kind "mla") and MoEConfig (FFN kind "moe",
its routing a routing kind of model/moe_routing.py)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import MLAConfig, ModelConfig, MoEConfig
from mtpjax.checkpoint.hf_export import hf_config_dict
from mtpjax.model import moe_routing
from mtpjax.models.deepseek import DEEPSEEK_ROUTING, routing_from_deepseek
from tests.conftest import tiny_config

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, n_group=4,
           topk_group=2)
DS = dict(model_type="deepseek_v3", num_heads=4, num_kv_heads=4, num_layers=2)


def test_dicts_become_sub_configs_and_round_trip_through_json():
    cfg = ModelConfig(**DS, attention_kind="mla", mla=MLA, ffn_kind="moe", moe=MOE)
    assert cfg.mla == MLAConfig(**MLA) and cfg.moe == MoEConfig(**MOE)
    assert cfg.head_dim == MLA["qk_rope_head_dim"]
    # frozen and hashable: a config is a static jit argument
    assert hash(cfg) == hash(ModelConfig(**DS, attention_kind="mla", mla=MLAConfig(**MLA),
                                         ffn_kind="moe", moe=MoEConfig(**MOE)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.moe.n_group = 2
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["mla"]["kv_lora_rank"] == 16 and d["moe"]["routing"] == "sigmoid_group_limited_bias"
    assert ModelConfig.from_dict(d) == cfg
    assert "kv_lora_rank" not in d and "scoring_func" not in d


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_kind="mla"), r"attention_kind 'mla' needs mla="),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe"), r"ffn_kind 'moe' needs moe="),
    (dict(mla=MLA), r"mla is set but attention_kind is 'gqa'"),
    (dict(attention_kind="mla", mla=MLA, moe=MOE), r"moe is set but ffn_kind is 'dense'"),
    (dict(attention_kind="mla", mla={**MLA, "kv_rank": 3}), r"unknown mla keys: \['kv_rank'\]"),
    (dict(attention_kind="mla", mla="big"), r"mla must be a MLAConfig, a dict of its fields"),
    (dict(attention_kind="mla", mla={**MLA, "v_head_dim": 0}), r"v_head_dim must be a positive"),
    (dict(attention_kind="mla", mla={**MLA, "q_lora_rank": -2}), r"q_lora_rank must be a pos"),
    (dict(attention_kind="mla", mla={**MLA, "rope_interleave": "yes"}), r"rope_interleave must"),
    (dict(attention_kind="mla", mla=MLA, head_dim=16), r"head_dim is its qk_rope_head_dim \(8\)"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe", moe={**MOE, "routing": "tanh_top1"}),
     r"MoE routing 'tanh_top1' is not registered; known: \['sigmoid_group_limited_bias'"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe", moe={**MOE, "n_group": 3}),
     r"n_group 3 does not divide n_routed_experts 8"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe", moe={**MOE, "topk_group": 1,
                                                              "num_experts_per_tok": 3}),
     r"topk_group 1 groups of 2 experts cannot hold num_experts_per_tok 3"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe",
          moe={**MOE, "routing": "softmax_greedy", "norm_topk_prob": True}),
     r"norm_topk_prob=True with routing 'softmax_greedy'"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe", moe={**MOE, "first_k_dense_replace": 3}),
     r"first_k_dense_replace must be an int in \[0, num_layers=2\], got 3"),
    (dict(attention_kind="mla", mla=MLA, ffn_kind="moe", moe={**MOE, "n_shared_experts": -1}),
     r"n_shared_experts must be an int >= 0, got -1"),
])
def test_bad_sub_configs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**DS, **kwargs})


def test_a_greedy_routing_needs_no_group_room():
    """The group-capacity check belongs to the rules that limit groups."""
    moe = MoEConfig(**{**MOE, "topk_group": 1, "num_experts_per_tok": 3,
                       "routing": "softmax_greedy"})
    assert moe.num_experts_per_tok == 3


def test_replace_through_a_sub_config_revalidates():
    cfg = ModelConfig(**DS, attention_kind="mla", mla=MLA, ffn_kind="moe", moe=MOE)
    wider = dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, qk_rope_head_dim=16),
                                head_dim=16)
    assert wider.head_dim == 16 and wider.mla.qk_rope_head_dim == 16
    with pytest.raises(ValueError, match="does not divide"):
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, n_routed_experts=6))
    dense = dataclasses.replace(cfg, ffn_kind="dense", moe=None)
    assert dense.layer_kinds() == (("mla", "dense"), ("mla", "dense"))


def test_deepseek_pairs_map_to_routing_kinds_and_back():
    for (scoring_func, topk_method), routing in DEEPSEEK_ROUTING.items():
        assert routing in moe_routing.ROUTING_RULES
        assert routing_from_deepseek(scoring_func, topk_method) == routing
        base = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 4, **MLA, **MOE, "scoring_func": scoring_func,
                "topk_method": topk_method}
        cfg = ModelConfig.from_hf(base)
        assert cfg.moe.routing == routing
        d = hf_config_dict(cfg)
        assert (d["scoring_func"], d["topk_method"]) == (scoring_func, topk_method)
    with pytest.raises(ValueError, match=r"scoring_func 'sigmoid' with topk_method 'greedy' "
                                         r"names no MoE routing"):
        routing_from_deepseek("sigmoid", "greedy")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_registered_routing_kind_is_a_valid_moe_routing(seed, monkeypatch):
    """A routing kind registered from outside (here: softmax scores, top-k by the scores plus a
    learnt bias, no group limit) is accepted by MoEConfig, creates its own params and routes
    by its own rule; a DeepSeek config.json cannot spell it."""
    name = "softmax_bias_test"
    monkeypatch.setitem(moe_routing.ROUTING_RULES, name, moe_routing.RoutingRule(
        name, lambda logits: jax.nn.softmax(logits, axis=-1), True, None))
    moe = MoEConfig(**{**MOE, "routing": name})
    cfg = tiny_config(ffn_kind="moe", moe=moe)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
    p = params["layers"][0]
    assert p["router_bias"].shape == (MOE["n_routed_experts"],)
    p = {**p, "router_bias": jax.random.normal(jax.random.PRNGKey(seed + 10), (8,))}
    x = jax.random.normal(jax.random.PRNGKey(seed + 20), (32, cfg.hidden_size))
    ids, w = moe_routing.route(p, x, moe)
    scores = np.asarray(jax.nn.softmax(x @ p["router"], axis=-1))
    want = np.argsort(-(scores + np.asarray(p["router_bias"])), axis=-1)[:, :2]
    assert [set(r) for r in np.asarray(ids).tolist()] == [set(r) for r in want.tolist()]
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(scores, np.asarray(ids), -1),
                               rtol=1e-5)
    deepseek = ModelConfig(**DS, attention_kind="mla", mla=MLA, ffn_kind="moe", moe=moe)
    with pytest.raises(ValueError, match=f"MoE routing {name!r} has no DeepSeek config.json"):
        hf_config_dict(deepseek)


def test_export_names_the_sub_config_field_config_json_cannot_hold():
    """DeepSeek-V2's config.json has no rope_interleave (V2 always interleaves): a V2 config
    without it cannot be written, and the error names the sub-config's field."""
    from mtpjax.checkpoint.errors import CheckpointError
    cfg = ModelConfig(**{**DS, "model_type": "deepseek_v2"}, attention_kind="mla",
                      mla={**MLA, "rope_interleave": False})
    with pytest.raises(CheckpointError, match=r"read back with different \['mla.rope_interleave'\]"):
        hf_config_dict(cfg)
    assert ModelConfig.from_hf(hf_config_dict(dataclasses.replace(
        cfg, mla=dataclasses.replace(cfg.mla, rope_interleave=True)))).mla.rope_interleave
