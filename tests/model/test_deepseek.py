"""DeepSeek-V3 family (MLA + MoE + DeepSeek MTP layout) against transformers' DeepseekV3ForCausalLM.

Tiny float32 checkpoints are written by transformers' save_pretrained (on-disk layout: one tensor
per expert), plus random MTP modules named as DeepSeek stores them (`model.layers.{L + k}`).
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

DS_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24,
               qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=8, n_group=4, topk_group=2,
               num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
               norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=7, tie_word_embeddings=False)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)
VARIANTS = {
    "v3": {},
    "no_q_lora": dict(q_lora_rank=None),
    "yarn": dict(rope_parameters=YARN),
}


def _hf_model(variant: str, seed: int):
    torch.manual_seed(seed)
    hf_cfg = transformers.DeepseekV3Config(**{**DS_BASE, **VARIANTS[variant]})
    hf_cfg._attn_implementation = "eager"
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():                 # off the init: sharper logits, biased routing
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def write_deepseek(path, variant: str, seed: int, num_mtp_layers: int = 1):
    """save_pretrained + random DeepSeek-named MTP modules (names from our key table, which is
    what is tested elsewhere: here it only spares listing ~30 names). Returns the torch model."""
    from safetensors.torch import load_file, save_file
    model = _hf_model(variant, seed)
    model.save_pretrained(str(path))
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["num_nextn_predict_layers"] = num_mtp_layers
    (path / "config.json").write_text(json.dumps(cfg_json))
    if num_mtp_layers:
        table = key_table(ModelConfig.from_hf(cfg_json))
        g = torch.Generator().manual_seed(500 + seed)
        tensors = load_file(str(path / "model.safetensors"))
        for name, slot in table.slots.items():
            if slot.path[0] != "mtp":
                continue
            shape = table.hf_shape(name)
            if name.endswith("norm.weight"):
                tensors[name] = 1.0 + 0.3 * torch.randn(shape, generator=g)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = 0.2 * torch.randn(shape, generator=g)
            else:
                tensors[name] = 0.3 * torch.randn(shape, generator=g)
        for k in range(num_mtp_layers):
            pre = f"model.layers.{DS_BASE['num_hidden_layers'] + k}"
            tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return model


def _prompts(seed: int, n: int = 3):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, DS_BASE["vocab_size"], int(t)).tolist() for t in rng.integers(4, 14, n)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for variant in VARIANTS:
        for seed in (0, 1):
            path = tmp_path_factory.mktemp(f"ds_{variant}_{seed}")
            out[variant, seed] = (path, write_deepseek(path, variant, seed))
    return out


# ---------------------------------------------------------------- config


def test_from_hf_reads_the_deepseek_fields(checkpoints):
    path, _ = checkpoints["yarn", 0]
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.attention_kind, cfg.ffn_kind, cfg.num_mtp_layers) == ("mla", "moe", 1)
    assert cfg.layer_kinds() == (("mla", "dense"), ("mla", "moe"), ("mla", "moe"))
    assert cfg.mtp_layer_kind() == ("mla", "moe")
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.head_dim, cfg.rope_interleave) == (16, 8, 8, True)
    assert (cfg.topk_method, cfg.scoring_func, cfg.n_group, cfg.topk_group) == ("noaux_tc", "sigmoid", 4, 2)
    assert cfg.rope_scaling.rope_type == "yarn" and cfg.rope_scaling.mscale_all_dim == 0.8


@pytest.mark.parametrize("field,value,match", [
    ("topk_method", "bogus", "topk_method"),
    ("scoring_func", "tanh", "scoring_func"),
    ("n_group", 3, "n_group"),
    ("topk_group", 9, "topk_group"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("moe_layer_freq", 2, "moe_layer_freq"),
    ("attention_bias", True, "attention_bias"),
    ("num_key_value_heads", 2, "num_key_value_heads"),
    ("kv_lora_rank", 0, "kv_lora_rank"),
])
def test_from_hf_names_an_unsupported_field(field, value, match):
    d = {**DS_BASE, "model_type": "deepseek_v3", field: value}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(d)


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
    """The routing under test is not the trivial one: the bias and the group limit each change
    which experts tokens get (so parity above covers both)."""
    from mtpjax.model.moe import route
    path, _ = checkpoints["v3", 0]
    ck = load_hf(str(path), jnp.float32)
    p = ck.params["layers"][1]
    x = jax.random.normal(jax.random.PRNGKey(0), (256, DS_BASE["hidden_size"]))
    ids, _ = route(p, x, ck.cfg)
    no_bias, _ = route({**p, "router_bias": jnp.zeros_like(p["router_bias"])}, x, ck.cfg)
    no_limit, _ = route(p, x, dataclasses.replace(ck.cfg, topk_group=ck.cfg.n_group))
    as_sets = lambda a: {tuple(sorted(r)) for r in np.asarray(a).tolist()}  # noqa: E731
    differs = lambda a, b: any(set(r) != set(s) for r, s in zip(np.asarray(a).tolist(),  # noqa: E731
                                                                   np.asarray(b).tolist()))
    assert differs(ids, no_bias) and differs(ids, no_limit)
    assert len(as_sets(ids)) > 4


def test_greedy_generate_and_engine_match_transformers(checkpoints):
    path, model = checkpoints["yarn", 0]
    ck = load_hf(str(path), jnp.float32)
    prompts = _prompts(7, 3)
    want = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.as_tensor([p]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    got = mtpjax.generate(ck.params, ck.cfg, prompts, max_new_tokens=10).tokens
    assert got == want
    llm = mtpjax.LLM(ck.params, ck.cfg, SpecConfig(num_speculative_tokens=2), num_pages=64,
                     page_size=4, max_num_seqs=4, max_num_batched_tokens=16, warmup=False)
    eng = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10))]
    assert eng == want


def _torch_rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_module_matches_an_independent_implementation(checkpoints):
    """DeepSeek's MTP formula written out in torch with transformers' own decoder layer (MLA +
    MoE): e = enorm(embed(x)) (zero at position 0), u = eh_proj([e, hnorm(h)]), y = layer(u),
    logits = head(shared_head.norm(y)), and y handed on."""
    from safetensors.torch import load_file
    path, model = checkpoints["v3", 1]
    ck = load_hf(str(path), jnp.float32)
    cfg, L = ck.cfg, DS_BASE["num_hidden_layers"]
    sd = load_file(str(path / "model.safetensors"))
    pre = f"model.layers.{L}."
    mod = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3DecoderLayer(
        model.config, layer_idx=L).eval()
    X = DS_BASE["n_routed_experts"]
    block = {k: v for k, v in mod.items() if not k.startswith(("enorm", "hnorm", "eh_proj",
                                                                "shared_head", "embed_tokens"))
             and ".experts." not in k}
    block["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([mod[f"mlp.experts.{e}.gate_proj.weight"], mod[f"mlp.experts.{e}.up_proj.weight"]])
         for e in range(X)])
    block["mlp.experts.down_proj"] = torch.stack(
        [mod[f"mlp.experts.{e}.down_proj.weight"] for e in range(X)])
    missing, unexpected = layer.load_state_dict(block, strict=False)
    assert not unexpected and set(missing) <= set(), (missing, unexpected)

    rng = np.random.default_rng(3)
    B, T = 2, 9
    tokens = rng.integers(0, DS_BASE["vocab_size"], (B, T))
    hidden = rng.normal(size=(B, T, DS_BASE["hidden_size"])).astype(np.float32)
    h_next, logits = mtpjax.mtp_forward(ck.params, cfg, 0, jnp.asarray(hidden), jnp.asarray(tokens))

    with torch.no_grad():
        tok = torch.as_tensor(tokens)
        pos = torch.arange(T)[None].expand(B, T)
        emb = sd["model.embed_tokens.weight"][tok]
        emb = torch.where((pos == 0)[..., None], torch.zeros_like(emb), emb)
        e = _torch_rmsnorm(emb, mod["enorm.weight"])
        h = _torch_rmsnorm(torch.as_tensor(hidden), mod["hnorm.weight"])
        u = torch.cat([e, h], -1) @ mod["eh_proj.weight"].T
        rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(
            model.config)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=rotary(u, pos))
        want_logits = _torch_rmsnorm(y, mod["shared_head.norm.weight"]) @ mod["shared_head.head.weight"].T
    np.testing.assert_allclose(np.asarray(h_next), y.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want_logits.numpy(), atol=1e-4, rtol=1e-4)


def test_export_round_trip_and_transformers_reads_it(checkpoints, tmp_path):
    path, model = checkpoints["no_q_lora", 0]
    ck = load_hf(str(path), jnp.float32)
    export_hf(str(tmp_path / "out"), ck.params, ck.cfg, assets=ck.assets)
    back = load_hf(str(tmp_path / "out"), jnp.float32)
    assert back.cfg == ck.cfg
    for a, b in zip(jax.tree.leaves(ck.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval().float()
    ids = torch.as_tensor([_prompts(2, 1)[0]])
    with torch.no_grad():
        np.testing.assert_allclose(hf(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-5)


# ---------------------------------------------------------------- speculative == plain (random MLA + MoE)


def ds_config(**overrides) -> ModelConfig:
    base = ModelConfig(model_type="deepseek_v3", vocab_size=96, hidden_size=32,
                       intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                       attention_kind="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                       qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True, ffn_kind="moe",
                       n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       moe_intermediate_size=16, first_k_dense_replace=1, n_group=4,
                       topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                       num_mtp_layers=2)
    return dataclasses.replace(base, **overrides)


def _ds_params(cfg, seed):
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
    # a non-zero correction bias, so the routing exercised is the biased one
    return jax.tree_util.tree_map_with_path(
        lambda path, a: (0.2 * jax.random.normal(jax.random.PRNGKey(seed + 7), a.shape)
                         if "router_bias" in jax.tree_util.keystr(path) else a), params)


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_equals_plain_generate(seed):
    cfg = ds_config()
    params = _ds_params(cfg, seed)
    prompts = _prompts(seed + 20, 3)
    ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=12).tokens
    for method, K in (("chain", 3), ("multi_layer", 2)):     # (chain K=1: test_tiny_model etc.)
        spec = SpecConfig(num_speculative_tokens=K, method=method)
        assert mtpjax.generate(params, cfg, prompts, max_new_tokens=12, spec=spec).tokens == ref, \
            (method, K)


def test_engine_speculative_equals_plain_under_preemption_prefix_hits_and_chunking():
    """Seed 003's hazards on MLA: chunked prefill rows mixed with verify rows in one ragged step
    (token budget 8), prefix-cache hits (shared prompt heads), preemption (few pages)."""
    cfg = ds_config()
    params = _ds_params(cfg, 3)
    head = _prompts(40, 1)[0] + [5, 6, 7, 8, 9]
    prompts = [head + p for p in _prompts(41, 4)] + _prompts(42, 2)
    ref = mtpjax.generate(params, cfg, prompts, max_new_tokens=14).tokens
    for method, K in (("chain", 2), ("multi_layer", 2)):
        llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=K, method=method),
                         num_pages=22, page_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                         enable_prefix_caching=True, warmup=False)
        for _ in range(2):                 # the second pass starts from prefix-cache hits
            out = llm.generate(prompts, SamplingParams(max_tokens=14))
            assert [o.token_ids for o in out] == ref, method
        assert llm.num_preemptions > 0 and llm.block_manager.num_cached_blocks > 0


def test_rejection_sampling_is_lossless_on_mla():
    """First two sampled tokens under chain K=2 drafts follow the target's exact joint law."""
    from tests.speculative.test_accept import chi2_pvalue
    V = 8
    cfg = ds_config(vocab_size=V, num_mtp_layers=1)
    params = _ds_params(cfg, 5)
    prompt, n = [1, 2, 3], 1500
    sp = SamplingParams(temperature=1.0)
    out = mtpjax.generate(params, cfg, [prompt] * n, max_new_tokens=2,
                          spec=SpecConfig(num_speculative_tokens=2), sampling=sp, seed=11)
    toks = np.asarray(out.tokens)
    seqs = np.concatenate([np.tile(prompt, (V, 1)), np.arange(V)[:, None]], 1)
    logits = np.asarray(mtpjax.forward(params, cfg, jnp.asarray(seqs)), np.float64)
    p1 = jax.nn.softmax(logits[0, 2])
    p2 = jax.nn.softmax(logits[:, 3], axis=-1)
    joint = np.asarray(p1)[:, None] * np.asarray(p2)
    counts = np.bincount(toks[:, 0] * V + toks[:, 1], minlength=V * V)
    assert chi2_pvalue(counts, joint.reshape(-1)) > 1e-3


# ---------------------------------------------------------------- memory


def test_latent_cache_holds_one_vector_per_token_per_layer():
    cfg = ds_config()
    cache = mtpjax.cache.init_cache(cfg, num_pages=5, page_size=4)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for pages in (*cache.target, *cache.mtp):
        leaves = jax.tree.leaves(pages)
        assert sum(a.size for a in leaves) == 5 * 4 * width     # no per-head copies, no V
        assert pages.latent.shape == (5, 4, width)


def _max_intermediate_size(jaxpr) -> int:
    best = 0
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            best = max(best, int(np.prod(v.aval.shape)) if hasattr(v.aval, "shape") else 0)
        for value in eqn.params.values():          # sub-jaxprs (cond/scan/pjit bodies)
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    best = max(best, _max_intermediate_size(sub))
    return best


def test_moe_never_materializes_tokens_by_experts_activations():
    from mtpjax.model.kinds import ffn_kind
    cfg = ds_config(n_routed_experts=32, num_experts_per_tok=2, n_group=4, topk_group=2,
                    moe_intermediate_size=24)
    p = _ds_params(cfg, 0)["layers"][1]
    N, X = 64, cfg.n_routed_experts
    x = jax.random.normal(jax.random.PRNGKey(1), (N, cfg.hidden_size))
    jaxpr = jax.make_jaxpr(lambda p, x: ffn_kind("moe")(p, x, cfg, jnp.ones(N, bool)))(p, x)
    limit = N * X * min(cfg.hidden_size, cfg.moe_intermediate_size)
    assert _max_intermediate_size(jaxpr.jaxpr) < limit
    # and it computes the same as the dense every-expert formula
    from mtpjax.model.moe import route
    ids, w = route(p, x, cfg)
    full = jnp.einsum("ne,xei->nxi", x, p["w_gate"])
    act = jax.nn.silu(full) * jnp.einsum("ne,xei->nxi", x, p["w_up"])
    each = jnp.einsum("nxi,xie->nxe", act, p["w_down"])                  # [N, X, E]
    gate = jnp.zeros((N, X)).at[jnp.arange(N)[:, None], ids].add(w)
    shared = (jax.nn.silu(x @ p["shared_gate"]) * (x @ p["shared_up"])) @ p["shared_down"]
    want = jnp.einsum("nx,nxe->ne", gate, each) + shared
    got = ffn_kind("moe")(p, x, cfg, jnp.ones(N, bool))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    # padding tokens are routed nowhere: their rows get only the shared experts
    valid = jnp.arange(N) % 3 != 0
    masked = ffn_kind("moe")(p, x, cfg, valid)
    np.testing.assert_allclose(np.asarray(masked)[np.asarray(valid)], np.asarray(got)[np.asarray(valid)],
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(masked)[~np.asarray(valid)],
                               np.asarray(shared)[~np.asarray(valid)], atol=1e-5)


def test_moe_layer_combines_expert_rows_without_float_scatter_add():
    """A float scatter-add lowers to atomics on the GPU, whose order (and so rounding) changes
    from run to run: the expert rows go back to token order by a gather instead. Only the
    integer group sizes may be a scatter-add."""
    from mtpjax.model.kinds import ffn_kind
    from tests.model.test_deterministic_steps import float_scatter_adds
    cfg = ds_config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    p = _ds_params(cfg, 0)["layers"][1]
    x = jnp.ones((16, cfg.hidden_size))
    text = jax.jit(lambda p, x: ffn_kind("moe")(p, x, cfg, jnp.ones(16, bool))).lower(p, x).as_text()
    assert '"stablehlo.scatter"' in text, \
        "the group sizes' scatter-add should be found (else this test checks nothing)"
    float_adds = float_scatter_adds(text)
    assert not float_adds, float_adds[0][:400]


def test_explicit_pallas_names_an_unsupported_latent_shape():
    """The compiled MLA kernel needs rope dim >= 16 (Triton's dot); an explicit pallas backend on
    this config's rope 8 says so (the kernel itself is tested in test_mla_paged_attention.py and
    test_mla_pallas_e2e.py)."""
    cfg = ds_config(num_mtp_layers=1)
    params = _ds_params(cfg, 0)
    with pytest.raises(ValueError, match="MLA rope dim 8"):
        mtpjax.generate(params, cfg, [[1, 2, 3]], max_new_tokens=2, attention_impl="pallas")


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_logits_match_transformers(tmp_path, topk_method):
    """V2: softmax routing (no correction bias, weights never normalized), rope on interleaved
    pairs by complex multiplication in transformers."""
    torch.manual_seed(4)
    v2 = {k: v for k, v in DS_BASE.items() if k not in ("norm_topk_prob",)}
    hf_cfg = transformers.DeepseekV2Config(**{**v2, "topk_method": topk_method,
                                              "routed_scaling_factor": 1.5})
    hf_cfg._attn_implementation = "eager"
    model = transformers.DeepseekV2ForCausalLM(hf_cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(4.0)
    model.save_pretrained(str(tmp_path))
    ck = load_hf(str(tmp_path), jnp.float32)
    assert (ck.cfg.scoring_func, ck.cfg.topk_method, ck.cfg.num_mtp_layers) == \
        ("softmax", topk_method, 0)
    ids = np.asarray([p + [3] * (14 - len(p)) for p in _prompts(9, 2)])
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(mtpjax.forward(ck.params, ck.cfg, jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_orbax_round_trip_keeps_the_deepseek_tree(tmp_path):
    from mtpjax.checkpoint import restore, save
    cfg = ds_config()
    params = _ds_params(cfg, 2)
    save(str(tmp_path / "ck"), params, cfg)
    back = restore(str(tmp_path / "ck"))
    assert back.cfg == cfg
    assert jax.tree.structure(back.params) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
