"""DeepSeek-V3 family (MLA + MoE + DeepSeek MTP layout) against transformers' DeepseekV3ForCausalLM.

The checkpoints and the parity checks are tests/model/hf_parity.py's; here are the family's
config and its own checks (MLA cache, MoE lowering, V2 routing, speculative == plain).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import MLAConfig, ModelConfig, MoEConfig, SamplingParams, SpecConfig
from mtpjax.checkpoint import load_hf
from tests.conftest import replace_fields

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.model import hf_parity  # noqa: E402  (needs torch and transformers)

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
DEEPSEEK = hf_parity.HFFamily("DeepseekV3", "deepseek_v3", DS_BASE, VARIANTS)


def _prompts(seed: int, n: int = 3):
    return hf_parity.prompts(DEEPSEEK, seed, n)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return hf_parity.Checkpoints(DEEPSEEK, tmp_path_factory, "ds")


# ---------------------------------------------------------------- config


def test_from_hf_reads_the_deepseek_fields(checkpoints):
    path, _ = checkpoints["yarn", 0]
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert (cfg.attention_kind, cfg.ffn_kind, cfg.num_mtp_layers) == ("mla", "moe", 1)
    assert cfg.layer_kinds() == (("mla", "dense"), ("mla", "moe"), ("mla", "moe"))
    assert cfg.mtp_layer_kind() == ("mla", "moe")
    assert (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim, cfg.head_dim,
            cfg.mla.rope_interleave) == (16, 8, 8, True)
    assert (cfg.moe.routing, cfg.moe.n_group, cfg.moe.topk_group) == \
        ("sigmoid_group_limited_bias", 4, 2)
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
@pytest.mark.parametrize("seed", hf_parity.SEEDS)
def test_logits_match_transformers(checkpoints, variant, seed):
    hf_parity.check_logits(DEEPSEEK, *checkpoints[variant, seed], seed)


def test_correction_bias_and_group_limit_change_the_experts(checkpoints):
    """The routing under test is not the trivial one: the bias and the group limit each change
    which experts tokens get (so parity above covers both)."""
    path, _ = checkpoints["v3", 0]
    x = jax.random.normal(jax.random.PRNGKey(0), (256, DS_BASE["hidden_size"]))
    by_bias, by_limit, ids = hf_parity.routing_differs(path, x)
    assert by_bias and by_limit
    assert len({tuple(sorted(r)) for r in ids.tolist()}) > 4


def test_greedy_generate_and_engine_match_transformers(checkpoints):
    hf_parity.check_greedy_generate_and_engine(DEEPSEEK, *checkpoints["yarn", 0])


def test_mtp_module_matches_an_independent_implementation(checkpoints):
    """DeepSeek's MTP formula written out in torch with transformers' own decoder layer (MLA +
    MoE); hf_parity.check_mtp_module."""
    hf_parity.check_mtp_module(DEEPSEEK, *checkpoints["v3", 1])


def test_export_round_trip_and_transformers_reads_it(checkpoints, tmp_path):
    hf_parity.check_export_round_trip(DEEPSEEK, *checkpoints["no_q_lora", 0], tmp_path / "out")


# ---------------------------------------------------------------- speculative == plain (random MLA + MoE)


def ds_config(**overrides) -> ModelConfig:
    """A tiny DeepSeek-V3 (MLA + MoE); overrides may name sub-config fields (replace_fields)."""
    base = ModelConfig(model_type="deepseek_v3", vocab_size=96, hidden_size=32,
                       intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                       attention_kind="mla",
                       mla=MLAConfig(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                                     qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True),
                       ffn_kind="moe",
                       moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2,
                                     n_shared_experts=1, moe_intermediate_size=16,
                                     first_k_dense_replace=1, n_group=4, topk_group=2,
                                     routed_scaling_factor=2.5, norm_topk_prob=True),
                       num_mtp_layers=2)
    return replace_fields(base, **overrides)


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
                         enable_prefix_caching=True, warmup=False, min_token_bucket=8,
                         max_model_len=64)    # block tables span 64 positions, not 4096
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
    width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
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
    N, X = 64, cfg.moe.n_routed_experts
    x = jax.random.normal(jax.random.PRNGKey(1), (N, cfg.hidden_size))
    jaxpr = jax.make_jaxpr(lambda p, x: ffn_kind("moe")(p, x, cfg, jnp.ones(N, bool)))(p, x)
    limit = N * X * min(cfg.hidden_size, cfg.moe.moe_intermediate_size)
    assert _max_intermediate_size(jaxpr.jaxpr) < limit
    # and it computes the same as the dense every-expert formula
    from mtpjax.model.moe import route
    ids, w = route(p, x, cfg.moe)
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
    routing = {"greedy": "softmax_greedy", "group_limited_greedy": "softmax_group_limited"}
    assert (ck.cfg.moe.routing, ck.cfg.num_mtp_layers) == (routing[topk_method], 0)
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
