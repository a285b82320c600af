"""The HF key table: MiMo / DeepSeek-style MTP names, and every error it must raise."""

import jax
import numpy as np
import pytest

from mtpjax.checkpoint import from_hf_state_dict
from tests.conftest import random_params, tiny_config


def export_hf(params, cfg, layout):
    """Inverse of the key table, written here independently to round-trip through it."""
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    if "lm_head" in params:
        out["lm_head.weight"] = params["lm_head"].T
    names = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight",
             "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
             "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
             "bq": "self_attn.q_proj.bias", "bk": "self_attn.k_proj.bias",
             "bv": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight",
             "k_norm": "self_attn.k_norm.weight", "w_gate": "mlp.gate_proj.weight",
             "w_up": "mlp.up_proj.weight", "w_down": "mlp.down_proj.weight"}

    def block(prefix, tree):
        for leaf, a in tree.items():
            a = np.asarray(a)
            out[f"{prefix}.{names[leaf]}"] = a.T if a.ndim == 2 else a

    for i in range(cfg.num_layers):
        block(f"model.layers.{i}", params["layers"][i])
    for k in range(cfg.num_mtp_layers):
        m = params["mtp"][k]
        if layout == "mimo":
            pre = f"model.mtp_layers.{k}"
            extra = {"token_layernorm.weight": m["enorm"], "hidden_layernorm.weight": m["hnorm"],
                     "input_proj.weight": m["eh_proj"].T, "final_layernorm.weight": m["out_norm"]}
        else:
            pre = f"model.layers.{cfg.num_layers + k}"
            extra = {"enorm.weight": m["enorm"], "hnorm.weight": m["hnorm"],
                     "eh_proj.weight": m["eh_proj"].T, "shared_head.norm.weight": m["out_norm"],
                     "embed_tokens.weight": params["embed"]}
        for n, a in extra.items():
            out[f"{pre}.{n}"] = a
        block(pre, m["block"])
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("layout", ["mimo", "deepseek"])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip(layout, seed):
    cfg = tiny_config(model_type="qwen2", qkv_bias=True, num_mtp_layers=2)
    params = random_params(cfg, seed)
    got = from_hf_state_dict(cfg, export_hf(params, cfg, layout), mtp_layout=layout)
    jax.tree.map(np.testing.assert_array_equal, got, params)


def test_mimo_family_defaults_to_mimo_layout():
    cfg = tiny_config(model_type="mimo", qkv_bias=True, num_mtp_layers=2,
                      mtp_concat_order="hidden_embed", mtp_normed_hidden_to_next=True)
    params = random_params(cfg, 3)
    got = from_hf_state_dict(cfg, export_hf(params, cfg, "mimo"))
    jax.tree.map(np.testing.assert_array_equal, got, params)


def _tensors():
    cfg = tiny_config(num_mtp_layers=1)
    params = random_params(cfg)
    return cfg, export_hf(params, cfg, "deepseek")


def test_unmapped_tensor():
    cfg, t = _tensors()
    t["model.layers.0.self_attn.mystery.weight"] = np.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected tensors:\n    model\.layers\.0\.self_attn\.mystery"):
        from_hf_state_dict(cfg, t)


def test_extra_layer_is_unmapped():
    cfg, t = _tensors()
    t["model.layers.9.input_layernorm.weight"] = np.zeros(cfg.hidden_size)
    with pytest.raises(ValueError, match=r"unexpected tensors:\n    model\.layers\.9\.input"):
        from_hf_state_dict(cfg, t)


def test_missing_tensor():
    cfg, t = _tensors()
    del t["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensors:\n    model\.layers\.1\.mlp\.up_proj\.weight \(-> layers/w_up\[1\]\)"):
        from_hf_state_dict(cfg, t)


def test_other_mtp_layout_is_unexpected():
    cfg, t = _tensors()
    t["model.mtp_layers.0.token_layernorm.weight"] = t["model.layers.2.enorm.weight"]
    with pytest.raises(ValueError, match=r"(?s)deepseek MTP layout.*unexpected tensors:\n    "
                                         r"model\.mtp_layers\.0\.token_layernorm"):
        from_hf_state_dict(cfg, t)


def test_deepseek_shared_copies_must_equal_the_shared_weights():
    cfg, t = _tensors()
    t["model.layers.2.shared_head.head.weight"] = t["lm_head.weight"].copy()
    from_hf_state_dict(cfg, t)
    t["model.layers.2.shared_head.head.weight"][3, 4] += 1
    with pytest.raises(ValueError, match=r"model\.layers\.2\.shared_head\.head\.weight differs "
                                         r"from the lm_head"):
        from_hf_state_dict(cfg, t)


def test_wrong_shape():
    cfg, t = _tensors()
    t["model.layers.0.self_attn.q_proj.weight"] = np.zeros((5, cfg.hidden_size))
    with pytest.raises(ValueError, match=r"wrong shape:\n    model\.layers\.0\.self_attn\.q_proj\.weight: "
                                         r"shape \[5, 32\], expected \[32, 32\] \(-> layers/wq\[0\]\)"):
        from_hf_state_dict(cfg, t)


def test_tied_head_must_equal_embedding():
    cfg = tiny_config(tie_word_embeddings=True, num_mtp_layers=0)
    params = random_params(cfg)
    t = export_hf(params, cfg, "deepseek")
    t["lm_head.weight"] = t["model.embed_tokens.weight"]
    from_hf_state_dict(cfg, t)
    t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1
    with pytest.raises(ValueError, match="differs"):
        from_hf_state_dict(cfg, t)
