import dataclasses

import pytest

from mtpjax import ModelConfig, SamplingParams, SpecConfig
from tests.conftest import tiny_config


def test_from_hf_families():
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=5e5)
    llama = ModelConfig.from_hf(dict(base, model_type="llama", tie_word_embeddings=True))
    assert (llama.qkv_bias, llama.qk_norm, llama.tie_word_embeddings) == (False, False, True)
    assert llama.head_dim == 16 and llama.num_mtp_layers == 0
    qwen2 = ModelConfig.from_hf(dict(base, model_type="qwen2"))
    assert qwen2.qkv_bias and not qwen2.qk_norm
    qwen3 = ModelConfig.from_hf(dict(base, model_type="qwen3", head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    mimo = ModelConfig.from_hf(dict(base, model_type="mimo", num_nextn_predict_layers=1))
    assert mimo.num_mtp_layers == 1 and mimo.mtp_concat_order == "hidden_embed"
    assert mimo.mtp_normed_hidden_to_next and mimo.qkv_bias
    scaled = ModelConfig.from_hf(dict(base, model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert scaled.rope_scaling.rope_type == "llama3" and scaled.rope_scaling.factor == 8.0


@pytest.mark.parametrize("bad, match", [
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported; supported"),
    (dict(model_type="llama", num_attention_heads=3), "hidden_size 64 is not divisible"),
    (dict(model_type="llama", num_key_value_heads=3), "multiple of num_kv_heads 3"),
    (dict(model_type="llama", rope_scaling={"type": "dynamic", "factor": 2.0}), "'dynamic'"),
    (dict(model_type="llama", rope_scaling={"type": "longrope", "factor": 2.0}), "'longrope'"),
    (dict(model_type="qwen2", use_sliding_window=True), "sliding"),
    (dict(model_type="llama", hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_from_hf_errors(bad, match):
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(dict(base, **bad))


def test_model_config_replace_revalidates():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="num_layers"):
        dataclasses.replace(cfg, num_layers=0)
    with pytest.raises(ValueError, match="mtp_concat_order"):
        dataclasses.replace(cfg, mtp_concat_order="sideways")


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(stop_token_ids=(3, -2)), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
])
def test_sampling_params_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_spec_config_errors():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="method 'tree'"):
        SpecConfig(method="tree")
    with pytest.raises(ValueError, match="num_mtp_layers"):
        SpecConfig(num_speculative_tokens=2, method="multi_layer").check_model(tiny_config())
    with pytest.raises(ValueError, match="think_start_token_id"):
        SpecConfig(acceptance="relaxed")
