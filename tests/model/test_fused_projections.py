"""Fused q/k/v and gate/up projections (model/fused.py): same outputs, one GEMM per group."""

import dataclasses
import importlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax.model.fused import check_fusable, fuse_projections, fusion_groups, is_fused
from tests.conftest import random_params, tiny_config

gen = importlib.import_module("mtpjax.generate")
FAMILIES = {"llama": {}, "qwen2": dict(qkv_bias=True), "qwen3": dict(qk_norm=True)}
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]


def model(family, seed):
    # shapes chosen so wq/wk/wv/wqkv/w_gate/w_gate_up are all distinct
    cfg = tiny_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, num_mtp_layers=1,
                      intermediate_size=48, **FAMILIES[family])
    return cfg, random_params(cfg, seed)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_forward_equals_unfused(family, seed):
    cfg, params = model(family, seed)
    fused = fuse_projections(params, cfg)
    assert is_fused(fused) and not is_fused(params)
    layer = fused["layers"][0]
    E, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert layer["wqkv"].shape == (E, q + 2 * kv) and not {"wq", "wk", "wv"} & set(layer)
    assert layer["w_gate_up"].shape == (E, 2 * cfg.intermediate_size)
    assert ("bqkv" in layer) == cfg.qkv_bias
    assert "wqkv" in fused["mtp"][0]["block"]
    assert fuse_projections(fused, cfg)["layers"][0].keys() == layer.keys()     # idempotent
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, 7), 0, cfg.vocab_size)
    want = mtpjax.forward(params, cfg, tokens)
    got = mtpjax.forward(fused, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# plain decoding on llama, MTP on qwen2 (q/k/v biases, and the MTP block's fused weights):
# each pair of paths compiles 8 programs, so not every pair (the suite's time)
@pytest.mark.parametrize("family,k", [("llama", 0), ("qwen2", 2)])
def test_generate_and_engine_tokens_unchanged(family, k):
    cfg, params = model(family, 3)
    sampled = [mtpjax.SamplingParams(), mtpjax.SamplingParams(temperature=1.0, top_k=20, seed=4),
               mtpjax.SamplingParams()]
    s = mtpjax.SpecConfig(num_speculative_tokens=k) if k else None
    want = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=8, spec=s,
                           sampling=sampled).tokens
    got = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=8, spec=s, sampling=sampled,
                          fuse_projections=True).tokens
    assert got == want, s
    sps = [dataclasses.replace(x, max_tokens=8) for x in sampled]
    engine = {}
    for fuse in (False, True):
        # min_token_bucket = the token budget: every step runs one T = 16 program
        llm = mtpjax.LLM(params, cfg, s, num_pages=32, page_size=4, max_num_seqs=3,
                         max_num_batched_tokens=16, min_token_bucket=16, fuse_projections=fuse)
        engine[fuse] = [o.token_ids for o in llm.generate(PROMPTS, sps)]
    assert engine[True] == engine[False], s
    assert engine[True][0] == want[0] and engine[True][2] == want[2]     # greedy rows


def test_fused_loop_has_one_gemm_per_group(monkeypatch):
    """generate's compiled loop: no dot reads a k/v-shaped or gate-shaped weight any more, and
    per GQA + dense block three dots are gone (q/k/v -> 1, gate/up -> 1)."""
    cfg, params = model("llama", 0)
    fn, seen = gen._loop, {}

    def spy(*args, **kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        return fn(*args, **kwargs)

    def dots(fuse):
        monkeypatch.setattr(gen, "_loop", spy)
        mtpjax.generate(params, cfg, [[1, 2, 3]], max_new_tokens=3, fuse_projections=fuse)
        monkeypatch.undo()
        text = fn.lower(*seen["args"], **seen["kwargs"]).as_text()
        return re.findall(r"stablehlo\.dot_general.*: \(tensor<[^>]*>, tensor<([^>]*)>\)", text)

    plain, fused = dots(False), dots(True)
    E, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    assert len(plain) - len(fused) == 3 * cfg.num_layers
    assert not [d for d in fused if d.startswith(f"{E}x{kv}x")]
    assert not [d for d in fused if d.startswith(f"{E}x{cfg.intermediate_size}x")]


def test_bad_inputs():
    cfg, params = model("llama", 0)
    two = types.SimpleNamespace(size=2, shape={"data": 1, "model": 2})
    with pytest.raises(ValueError, match="needs one device; got a mesh of 2 devices"):
        check_fusable(two)
    with pytest.raises(ValueError, match="fuse_projections must be True, False, 'all' or 'qkv', "
                                         "got 'yes'"):
        mtpjax.generate(params, cfg, [[1, 2]], max_new_tokens=2, fuse_projections="yes")
    with pytest.raises(ValueError, match="fuse_projections must be True.*got 1"):
        mtpjax.LLM(params, cfg, num_pages=8, fuse_projections=1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_qkv_mode_fuses_only_qkv_and_keeps_tokens(seed):
    """fuse_projections="qkv": wqkv but separate w_gate / w_up; same forward and tokens."""
    cfg, params = model("qwen2", seed)
    fused = fuse_projections(params, cfg, fusion_groups("qkv"))
    layer = fused["layers"][0]
    assert "wqkv" in layer and "bqkv" in layer and "w_gate" in layer and "w_gate_up" not in layer
    assert fusion_groups(True) == fusion_groups("all") == ("qkv", "gate_up")
    assert fusion_groups(False) == ()
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, 7), 0, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(mtpjax.forward(fused, cfg, tokens)),
                               np.asarray(mtpjax.forward(params, cfg, tokens)),
                               rtol=1e-5, atol=1e-5)
    spec = mtpjax.SpecConfig(num_speculative_tokens=2)
    want = mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=6, spec=spec).tokens
    assert mtpjax.generate(params, cfg, PROMPTS, max_new_tokens=6, spec=spec,
                           fuse_projections="qkv").tokens == want
    llm = mtpjax.LLM(params, cfg, spec, num_pages=32, page_size=4, max_num_seqs=3,
                     max_num_batched_tokens=16, fuse_projections="qkv")
    assert "w_gate" in llm.runner.params["layers"][0]
    got = [o.token_ids for o in llm.generate(PROMPTS, mtpjax.SamplingParams(max_tokens=6))]
    assert got == want


@pytest.mark.parametrize("q_lora,seed", [(24, 0), (None, 1), (24, 2)])
def test_mla_and_shared_experts_fuse_with_the_same_outputs(q_lora, seed):
    """MLA: the query projection (q_proj, or q_a_proj under a q LoRA) and kv_a_proj read the
    same x, so they fuse into one GEMM; MoE: the shared experts' gate and up. The forward
    and the engine's MTP tokens stay those of the unfused model."""
    from tests.conftest import replace_fields, tiny_mla_moe_config
    cfg = replace_fields(tiny_mla_moe_config(50 + seed), q_lora_rank=q_lora)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.1)
    fused = fuse_projections(params, cfg)
    assert is_fused(fused) and not is_fused(params)
    m, E = cfg.mla, cfg.hidden_size
    q_width = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim) if q_lora is None \
        else q_lora
    for layer in (fused["layers"][1], fused["mtp"][0]["block"]):       # MLA + MoE blocks
        assert layer["wq_kv_a"].shape == (E, q_width + m.kv_lora_rank + m.qk_rope_head_dim)
        assert not {"wq", "wq_a", "wkv_a", "wkv_b", "shared_gate", "shared_up"} & set(layer)
        # kv_b split once into the absorbed attention's halves
        R, H = m.kv_lora_rank, cfg.num_heads
        assert layer["w_uk"].shape == (R, H, m.qk_nope_head_dim)
        assert layer["w_uv"].shape == (R, H, m.v_head_dim)
        assert layer["shared_gate_up"].shape == (E, 2 * cfg.moe.moe_intermediate_size)
    assert "w_gate_up" in fused["layers"][0]                          # the dense first layer
    assert fuse_projections(fused, cfg)["layers"][1].keys() == fused["layers"][1].keys()
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (2, 7), 0, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(mtpjax.forward(fused, cfg, tokens)),
                               np.asarray(mtpjax.forward(params, cfg, tokens)),
                               rtol=1e-5, atol=1e-5)
    if seed == 0:
        s = mtpjax.SpecConfig(num_speculative_tokens=2)
        sps = [mtpjax.SamplingParams(max_tokens=8)] * 2
        got = {fuse: [o.token_ids for o in mtpjax.LLM(
            params, cfg, s, num_pages=32, fuse_projections=fuse).generate(PROMPTS[:2], sps)]
            for fuse in (False, True)}
        assert got[True] == got[False]
