"""Parity with Hugging Face transformers (CPU, float32): logits and greedy generate."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mtpjax  # noqa: E402
from mtpjax.checkpoint import from_hf_state_dict  # noqa: E402

BASE = dict(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=256)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama_tied_llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama_yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
}


def build(name, seed):
    cfg_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, cfg_cls)(**BASE, **extra)
    model = getattr(transformers, model_cls)(hf_cfg).eval().float()
    with torch.no_grad():   # move norms and biases off their init so a missed one shows
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
    cfg = mtpjax.ModelConfig.from_hf(hf_cfg.to_dict(), num_mtp_layers=0)
    params = from_hf_state_dict(cfg, model.state_dict())
    return model, cfg, params


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_transformers(name, seed):
    model, cfg, params = build(name, seed)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, BASE["vocab_size"], size=(2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(mtpjax.forward(params, cfg, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama_tied_llama3"])
def test_greedy_generate_matches_transformers(name):
    model, cfg, params = build(name, 7)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, BASE["vocab_size"], size=n).tolist() for n in (5, 12, 1)]
    ours = mtpjax.generate(params, cfg, prompts, max_new_tokens=12, page_size=4)
    for p, o in zip(prompts, ours.tokens):
        with torch.no_grad():
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        assert o == out[0, len(p):].tolist()
