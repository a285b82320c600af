"""GLM-4.5 (model_type "glm4_moe") against transformers' Glm4MoeForCausalLM: partial rotary,
optional q/k norm, q/k/v biases, sigmoid + correction-bias group-limited MoE with a shared
expert, MTP modules in DeepSeek's layout.

Tiny float32 checkpoints are written by transformers' save_pretrained, plus random MTP modules
at `model.layers.{L + k}` (transformers' model has none; vLLM reads them there).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import ModelConfig, SamplingParams, SpecConfig
from mtpjax.checkpoint import export_hf, key_table, load_hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GLM_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                partial_rotary_factor=0.5, attention_bias=True, n_shared_experts=1,
                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                rms_norm_eps=1e-5, max_position_embeddings=256, num_nextn_predict_layers=1,
                bos_token_id=1, eos_token_id=7, tie_word_embeddings=False)
VARIANTS = {"qk_norm": dict(use_qk_norm=True), "no_qk_norm": dict(use_qk_norm=False)}


def _hf_model(variant: str, seed: int):
    torch.manual_seed(seed)
    hf_cfg = transformers.Glm4MoeConfig(**{**GLM_BASE, **VARIANTS[variant]})
    hf_cfg._attn_implementation = "eager"
    model = transformers.Glm4MoeForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():                 # off the init: sharper logits, biased routing
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def write_glm(path, variant: str, seed: int):
    """save_pretrained + one random MTP module named as GLM-4.5 stores it (names from our key
    table). Returns the torch model."""
    from safetensors.torch import load_file, save_file
    model = _hf_model(variant, seed)
    model.save_pretrained(str(path))
    cfg_json = json.loads((path / "config.json").read_text())
    table = key_table(ModelConfig.from_hf(cfg_json))
    g = torch.Generator().manual_seed(500 + seed)
    tensors = load_file(str(path / "model.safetensors"))
    for name, slot in table.slots.items():
        if slot.path[0] != "mtp":
            continue
        shape = table.hf_shape(name)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.3 * torch.randn(shape, generator=g)
        else:
            tensors[name] = 0.3 * torch.randn(shape, generator=g)
    pre = f"model.layers.{GLM_BASE['num_hidden_layers']}"
    tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return model


def _prompts(seed: int, n: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, GLM_BASE["vocab_size"], int(t)).tolist()
            for t in rng.integers(4, 14, n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for variant in VARIANTS:
        for seed in (0, 1):
            path = tmp_path_factory.mktemp(f"glm_{variant}_{seed}")
            out[variant, seed] = (path, write_glm(path, variant, seed))
    return out


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
    assert (cfg.moe_routing, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == \
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
        dataclasses.replace(cfg, scoring_func="softmax", topk_method="greedy",
                            norm_topk_prob=False)
    with pytest.raises(ValueError, match="attention_kind 'gqa'"):
        ModelConfig(model_type="glm4_moe", attention_kind="mla", num_heads=4, num_kv_heads=4,
                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


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
@pytest.mark.parametrize("seed", [0, 1])
def test_logits_match_transformers(checkpoints, variant, seed):
    path, model = checkpoints[variant, seed]
    ck = load_hf(str(path), jnp.float32)
    ids = np.asarray([p + [3] * (14 - len(p)) for p in _prompts(seed, 2)])
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(mtpjax.forward(ck.params, ck.cfg, jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_correction_bias_and_group_limit_change_the_experts(checkpoints):
    """The routing exercised by the parity above is not the trivial one."""
    from mtpjax.model.moe import route
    path, _ = checkpoints["qk_norm", 0]
    ck = load_hf(str(path), jnp.float32)
    p = ck.params["layers"][1]
    x = 4.0 * jax.random.normal(jax.random.PRNGKey(0), (256, GLM_BASE["hidden_size"]))
    ids, _ = route(p, x, ck.cfg)
    no_bias, _ = route({**p, "router_bias": jnp.zeros_like(p["router_bias"])}, x, ck.cfg)
    no_limit, _ = route(p, x, dataclasses.replace(ck.cfg, topk_group=ck.cfg.n_group))
    def differs(a, b):
        return any(set(r) != set(s) for r, s in zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
    assert differs(ids, no_bias) and differs(ids, no_limit)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generate_and_engine_spec_match_transformers(checkpoints, variant):
    path, model = checkpoints[variant, 1]
    ck = load_hf(str(path), jnp.float32)
    prompts = _prompts(7, 3)
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.as_tensor([p]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert mtpjax.generate(ck.params, ck.cfg, prompts, max_new_tokens=10).tokens == want
    llm = mtpjax.LLM(ck.params, ck.cfg, SpecConfig(num_speculative_tokens=2), num_pages=64,
                     page_size=4, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    assert [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))] == want


def _torch_rmsnorm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mtp_module_matches_transformers_decoder_layer(checkpoints, variant):
    """The MTP module written out in torch around transformers' own Glm4MoeDecoderLayer (GQA
    with partial rotary + MoE): e = enorm(embed(x)) (zero at position 0), u = eh_proj([e,
    hnorm(h)]), y = layer(u), logits = head(shared_head.norm(y)), and y handed on."""
    from safetensors.torch import load_file
    mod_glm = transformers.models.glm4_moe.modeling_glm4_moe
    path, model = checkpoints[variant, 0]
    ck = load_hf(str(path), jnp.float32)
    L, X = GLM_BASE["num_hidden_layers"], GLM_BASE["n_routed_experts"]
    eps = GLM_BASE["rms_norm_eps"]
    sd = load_file(str(path / "model.safetensors"))
    pre = f"model.layers.{L}."
    mod = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
    layer = mod_glm.Glm4MoeDecoderLayer(model.config, layer_idx=L).eval()
    block = {k: v for k, v in mod.items() if not k.startswith(("enorm", "hnorm", "eh_proj",
                                                                "shared_head", "embed_tokens"))
             and ".experts." not in k}
    block["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([mod[f"mlp.experts.{e}.gate_proj.weight"],
                    mod[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(X)])
    block["mlp.experts.down_proj"] = torch.stack(
        [mod[f"mlp.experts.{e}.down_proj.weight"] for e in range(X)])
    missing, unexpected = layer.load_state_dict(block, strict=False)
    assert not unexpected and not [m for m in missing if "e_score_correction_bias" not in m], \
        (missing, unexpected)

    rng = np.random.default_rng(3)
    B, T = 2, 9
    tokens = rng.integers(0, GLM_BASE["vocab_size"], (B, T))
    hidden = rng.normal(size=(B, T, GLM_BASE["hidden_size"])).astype(np.float32)
    h_next, logits = mtpjax.mtp_forward(ck.params, ck.cfg, 0, jnp.asarray(hidden),
                                        jnp.asarray(tokens))
    with torch.no_grad():
        if "mlp.gate.e_score_correction_bias" in mod:
            layer.mlp.gate.e_score_correction_bias.copy_(mod["mlp.gate.e_score_correction_bias"])
        tok = torch.as_tensor(tokens)
        pos = torch.arange(T)[None].expand(B, T)
        emb = sd["model.embed_tokens.weight"][tok]
        emb = torch.where((pos == 0)[..., None], torch.zeros_like(emb), emb)
        e = _torch_rmsnorm(emb, mod["enorm.weight"], eps)
        h = _torch_rmsnorm(torch.as_tensor(hidden), mod["hnorm.weight"], eps)
        u = torch.cat([e, h], -1) @ mod["eh_proj.weight"].T
        rotary = mod_glm.Glm4MoeRotaryEmbedding(model.config)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=rotary(u, pos))
        want = (_torch_rmsnorm(y, mod["shared_head.norm.weight"], eps)
                @ mod["shared_head.head.weight"].T)
    np.testing.assert_allclose(np.asarray(h_next), y.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want.numpy(), atol=1e-4, rtol=1e-4)


def test_export_round_trip_and_transformers_reads_it(checkpoints, tmp_path):
    path, model = checkpoints["qk_norm", 1]
    ck = load_hf(str(path), jnp.float32)
    export_hf(str(tmp_path / "out"), ck.params, ck.cfg, assets=ck.assets)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    assert "scoring_func" not in written and written["partial_rotary_factor"] == 0.5
    back = load_hf(str(tmp_path / "out"), jnp.float32)
    assert back.cfg == ck.cfg
    for a, b in zip(jax.tree.leaves(ck.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(str(tmp_path / "out")).eval().float()
    ids = torch.as_tensor([_prompts(2, 1)[0]])
    with torch.no_grad():
        np.testing.assert_allclose(hf(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-5)
    back_logits = mtpjax.forward(back.params, back.cfg, jnp.asarray(ids.numpy()))
    np.testing.assert_allclose(np.asarray(back_logits), model(ids).logits.detach().numpy(),
                               atol=1e-4, rtol=1e-4)
