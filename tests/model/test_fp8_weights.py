"""FP8 weights kept FP8 (`Fp8Weight`, `quantize_fp8`, `memory_plan`; docs/fp8.md).

Accuracy is stated against the dequantized reference (`dequantize_params`): the same model with
every FP8 weight replaced by the bf16 array it stands for. The FP8 model dequantizes each weight
inside the step (convert, times the broadcast scale, cast) and then runs the same dot, so its
products are the reference's: on CPU logits agree bit for bit, and the tolerance asserted (one
bf16 ulp of the largest logit) only leaves room for a backend that fuses the dequantization
into the GEMM and accumulates in another order. Greedy tokens are therefore equal.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import Fp8Weight, dequantize_params, memory_plan, quantize_fp8
from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import FP8_MAX, partition_specs, quantize
from mtpjax.model.linear import linear
from mtpjax.model.quantize import PROJECTIONS
from tests.conftest import tiny_config
from tests.model.test_deepseek import _ds_params, ds_config

BLOCK = (16, 16)


def _bf16(params):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)


def _dense():
    cfg = tiny_config()
    return cfg, _bf16(mtpjax.init_params(cfg, jax.random.PRNGKey(3), std=0.3))


def _deepseek(num_mtp_layers=2):
    cfg = ds_config(num_mtp_layers=num_mtp_layers)
    return cfg, _bf16(_ds_params(cfg, 4))


# ---- one weight ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("shape,block", [((40, 72), (16, 16)), ((3, 37, 50), (8, 32)),
                                         ((256, 130), (128, 128)), ((33, 20), "channel")])
def test_quantize_error_is_bounded_per_element(seed, shape, block):
    rng = np.random.default_rng(seed)
    # magnitudes over several decades, so blocks hold both large and tiny elements
    w = (rng.standard_normal(shape) * np.exp(rng.uniform(-4, 2, shape))).astype(np.float32)
    b = (shape[-2], 1) if block == "channel" else block
    q = quantize(w, b)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.dtype == jnp.float32
    assert q.scale.shape == (*shape[:-2], -(-shape[-2] // b[0]), -(-shape[-1] // b[1]))
    assert q.shape == shape and q.block == b and q.dtype == jnp.float32
    s = np.asarray(q.expanded_scale())
    err = np.abs(np.asarray(q.dequantize(jnp.float32)) - w)
    # e4m3: 3 mantissa bits, so a relative error <= 2^-4 for normal scaled values; below e4m3's
    # smallest normal (2^-6 of the scale) the spacing is 2^-9 of the scale: error <= 2^-10 s
    assert (err <= np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * s)).all()
    # every block's largest element maps to e4m3's largest value, exactly representable
    assert np.abs(np.asarray(q.values, np.float32)).max() == FP8_MAX


def test_an_all_zero_block_quantizes_to_zero():
    w = np.zeros((32, 32), np.float32)
    w[:16, :16] = 1.5
    q = quantize(w, (16, 16))
    np.testing.assert_allclose(np.asarray(q.scale), [[1.5 / FP8_MAX, 1], [1, 1]], rtol=1e-6)
    got = np.asarray(q.dequantize(jnp.float32))
    assert (got[16:] == 0).all() and (got[:, 16:] == 0).all()
    np.testing.assert_allclose(got[:16, :16], 1.5, rtol=2.0 ** -20)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("rows", [1, 5])
def test_linear_on_fp8_equals_linear_on_the_dequantized_weight(seed, rows):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(k1, (rows, 48), jnp.bfloat16)
    q = quantize(jax.random.normal(k2, (48, 72), jnp.bfloat16), (16, 16))
    assert q.dtype == jnp.bfloat16
    got = jax.jit(linear)(x, q)
    want = jax.jit(linear)(x, q.dequantize())
    assert got.dtype == want.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_the_weight_is_a_pytree_that_jit_passes_through():
    q = quantize(jnp.ones((32, 16)), (16, 16))
    leaves, treedef = jax.tree.flatten(q)
    assert [leaf.dtype for leaf in leaves] == [jnp.float8_e4m3fn, jnp.float32]
    back = jax.jit(lambda w: w)(q)
    assert isinstance(back, Fp8Weight) and back.block == (16, 16)
    assert jax.tree.unflatten(treedef, leaves).block == (16, 16)


# ---- the param tree ------------------------------------------------------------------------------

def test_quantize_fp8_picks_the_projections_only():
    cfg, params = _deepseek(1)
    q = quantize_fp8(params, BLOCK)
    from mtpjax.model.params import tree_items
    kinds = {p[-1]: isinstance(x, Fp8Weight) for p, x in tree_items(q)}
    assert kinds["embed"] is False and kinds["lm_head"] is False and kinds["router"] is False
    assert not any(kinds[n] for n in kinds if "norm" in n or n == "router_bias")
    assert all(kinds[n] for n in kinds if n in PROJECTIONS)
    assert {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w_gate", "w_up", "w_down", "shared_gate",
            "eh_proj"} <= {n for n, k in kinds.items() if k}
    assert isinstance(quantize_fp8(params, BLOCK, lm_head=True)["lm_head"], Fp8Weight)
    only = quantize_fp8(params, BLOCK, include=["wo"])
    assert isinstance(only["layers"][0]["wo"], Fp8Weight)
    assert not isinstance(only["layers"][0]["wq_a"], Fp8Weight)
    stacked = q["layers"][1]["w_gate"]                     # experts [X, E, I]
    assert stacked.shape == (8, 32, 16) and stacked.scale.shape == (8, 2, 1)
    channel = quantize_fp8(params, "channel")["layers"][1]["w_gate"]
    assert channel.block == (32, 1) and channel.scale.shape == (8, 1, 16)


@pytest.mark.parametrize("kwargs,says", [
    (dict(include=["embed"]), "['embed'] cannot be quantized"),
    (dict(include=["router", "wo"]), "['router'] cannot be quantized"),
    (dict(block=(16, 0)), "FP8 block (16, 0): expected two positive ints"),
    (dict(block="rows"), "FP8 block 'rows'"),
])
def test_quantize_fp8_names_bad_arguments(kwargs, says):
    _, params = _dense()
    with pytest.raises(ValueError, match=None) as e:
        quantize_fp8(params, **{"block": BLOCK, **kwargs})
    assert says in str(e.value)


def _close_to_reference(params, cfg, q, seed):
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 9)),
                         jnp.int32)
    got = np.asarray(mtpjax.forward(q, cfg, tokens), np.float32)
    ref = np.asarray(mtpjax.forward(dequantize_params(q), cfg, tokens), np.float32)
    assert np.isfinite(got).all()
    # same products as the reference (module docstring): one bf16 ulp of the largest logit
    np.testing.assert_allclose(got, ref, rtol=0, atol=2.0 ** -8 * np.abs(ref).max())
    # and the quantization itself is small: the logits stay correlated with the unquantized
    # model's (these random models, std 0.3, amplify it: 0.91 - 0.99 measured; a misplaced or
    # transposed scale block leaves next to no correlation)
    orig = np.asarray(mtpjax.forward(params, cfg, tokens), np.float32)
    assert np.corrcoef(got.ravel(), orig.ravel())[0, 1] > 0.85


@pytest.mark.parametrize("model,block", [("dense", "channel"), ("deepseek", BLOCK)])
def test_fp8_model_logits_match_the_dequantized_reference(model, block):
    cfg, params = _dense() if model == "dense" else _deepseek()
    q = quantize_fp8(params, block)
    _close_to_reference(params, cfg, q, seed=len(model))
    # and the MTP modules (their eh_proj and blocks quantized too)
    from mtpjax.model.mtp import mtp_forward
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6)), jnp.int32)
    _, hidden = mtpjax.forward(q, cfg, tokens, return_hidden=True)
    got = mtp_forward(q, cfg, 0, hidden, tokens)[1]
    ref = mtp_forward(dequantize_params(q), cfg, 0, hidden, tokens)[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0,
                               atol=2.0 ** -8 * float(jnp.abs(ref).max()))


PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


@pytest.mark.parametrize("model", ["dense", "deepseek"])
def test_fp8_greedy_generate_equals_the_reference_and_speculation_equals_plain(model):
    cfg, params = _dense() if model == "dense" else _deepseek()
    q = quantize_fp8(params, BLOCK)
    ref = mtpjax.generate(dequantize_params(q), cfg, PROMPTS, max_new_tokens=10).tokens
    # deepseek: MTP drafting on FP8 too (greedy speculation is lossless, so == the reference);
    # the dense model's speculation runs in the engine test below
    spec = mtpjax.SpecConfig(num_speculative_tokens=2) if model == "deepseek" else None
    assert mtpjax.generate(q, cfg, PROMPTS, max_new_tokens=10, spec=spec).tokens == ref


def test_fp8_engine_speculative_equals_plain_greedy():
    cfg, params = _dense()
    q = quantize_fp8(params, BLOCK)
    ref = mtpjax.generate(q, cfg, PROMPTS, max_new_tokens=9).tokens
    # min_token_bucket = the token budget: every step runs one T = 16 program
    llm = mtpjax.LLM(q, cfg, mtpjax.SpecConfig(num_speculative_tokens=2), num_pages=24,
                     page_size=4, max_num_seqs=3, max_num_batched_tokens=16, min_token_bucket=16,
                     max_model_len=32, warmup=False)
    out = llm.generate(PROMPTS, mtpjax.SamplingParams(max_tokens=9))
    assert [o.token_ids for o in out] == ref


def test_fused_projections_keep_fp8_blocks_whole():
    from mtpjax.model.fused import fuse_projections
    cfg, params = _dense()
    q = quantize_fp8(params, BLOCK)
    fused = fuse_projections(q, cfg)
    layer = fused["layers"][0]
    assert isinstance(layer["wqkv"], Fp8Weight) and layer["wqkv"].shape == (32, 64)
    assert isinstance(layer["w_gate_up"], Fp8Weight)
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(mtpjax.forward(fused, cfg, tokens)),
                                  np.asarray(mtpjax.forward(q, cfg, tokens)))
    # blocks that would straddle the q | k seam: left unfused
    odd = fuse_projections(quantize_fp8(params, (16, 12)), cfg)["layers"][0]
    assert "wqkv" not in odd and isinstance(odd["wq"], Fp8Weight)


def test_fused_projections_keep_an_fp8_kv_b_whole():
    """Splitting MLA's kv_b into W_UK / W_UV at load is for bf16 weights; an FP8 kv_b stays
    whole (dequantized in the step), a bf16 one beside FP8 query weights is split, and each
    fused model's logits equal its unfused model's exactly (the same products and sums)."""
    from mtpjax.model.fused import fuse_projections
    cfg, params = _deepseek(num_mtp_layers=1)
    q = quantize_fp8(params, BLOCK)
    fused = fuse_projections(q, cfg)
    for layer in fused["layers"]:
        assert isinstance(layer["wkv_b"], Fp8Weight) and "w_uk" not in layer
    half = fuse_projections(quantize_fp8(params, BLOCK, include=["wq", "wq_a", "wq_b"]), cfg)
    assert all("wkv_b" not in layer and "w_uk" in layer for layer in half["layers"])
    tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    for model, unfused in ((fused, q), (half, quantize_fp8(params, BLOCK,
                                                           include=["wq", "wq_a", "wq_b"]))):
        np.testing.assert_array_equal(np.asarray(mtpjax.forward(model, cfg, tokens)),
                                      np.asarray(mtpjax.forward(unfused, cfg, tokens)))


def _loops_carry_fp8_only(hlo: str, params) -> None:
    """Every while loop of the optimized HLO carries its FP8 weights as f8e4m3fn, never as a
    dequantized f32 / bf16 copy made before the loop (loop-invariant code motion hoisted the
    dequantization out of the loop until `dequantize_in_step` tied it to the activations)."""
    import re
    from mtpjax.model.params import tree_items
    fp8 = {",".join(map(str, x.shape)) for _, x in tree_items(params) if isinstance(x, Fp8Weight)}
    loops = [ln.split(" while(")[0] for ln in hlo.splitlines() if re.search(r" while\(", ln)]
    assert loops
    for carried in loops:
        found = re.findall(r"\b(f32|bf16|f8e4m3fn)\[([\d,]*)\]", carried)
        carried_fp8 = {d for t, d in found if t == "f8e4m3fn"}
        assert carried_fp8 and carried_fp8 <= fp8
        assert not [f"{t}[{d}]" for t, d in found if t != "f8e4m3fn" and d in fp8]


def test_fp8_generate_loop_moves_no_weights(monkeypatch):
    """tests/model/test_no_weight_copies.py's guard on an FP8 model: no weight-shaped copy, slice,
    transpose or concatenate in the optimized loop, and no dequantized copy carried by it."""
    guard = importlib.import_module("tests.model.test_no_weight_copies")
    gen = importlib.import_module("mtpjax.generate")
    params = quantize_fp8(mtpjax.init_params(guard.CFG, jax.random.PRNGKey(0)), BLOCK)
    shapes = {s for p in jax.tree.leaves(dequantize_params(params)) if p.ndim == 2
              for s in (p.shape, p.shape[::-1])}
    spec = mtpjax.SpecConfig(num_speculative_tokens=2)
    hlo = guard.capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
        params, guard.CFG, [[1, 2, 3], [4, 5]], max_new_tokens=4, spec=spec))
    assert guard.weight_moves(hlo, shapes) == []
    _loops_carry_fp8_only(hlo, params)


def test_fp8_mla_moe_loop_carries_fp8(monkeypatch):
    """The same for MLA's kv_b absorption and the MoE experts (float32 stand-ins, so a
    dequantized copy would show as f32 of a weight's shape)."""
    guard = importlib.import_module("tests.model.test_no_weight_copies")
    gen = importlib.import_module("mtpjax.generate")
    cfg = ds_config(num_mtp_layers=1)
    params = quantize_fp8(_ds_params(cfg, 4), BLOCK)
    hlo = guard.capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
        params, cfg, [[1, 2, 3], [4, 5]], max_new_tokens=4))
    _loops_carry_fp8_only(hlo, params)


# ---- sharding ------------------------------------------------------------------------------------

def test_scale_splits_with_its_values_only_along_whole_blocks():
    from jax.sharding import PartitionSpec as P
    mesh = {"data": 1, "model": 4}
    w = quantize(jnp.ones((64, 128)), (16, 16))             # 128 / 4 = 32: two whole blocks
    assert partition_specs(P(None, "model"), w, mesh) == (P(None, "model"), P(None, "model"))
    w = quantize(jnp.ones((64, 96)), (16, 32))              # 96 / 4 = 24: blocks would split
    assert partition_specs(P(None, "model"), w, mesh) == (P(), P())
    w = quantize(jnp.ones((64, 96)), (64, 1))               # per channel: one scale row
    assert partition_specs(P("model"), w, mesh) == (P("model"), P())
    w = quantize(jnp.ones((8, 64, 96)), (16, 16))           # experts split alike
    assert partition_specs(P("model"), w, mesh) == (P("model"), P("model"))


# ---- Orbax ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [BLOCK, "channel"])
def test_orbax_round_trip_keeps_fp8_bit_exact(tmp_path, block):
    from mtpjax.checkpoint import orbax_io
    cfg, params = _deepseek(1)
    q = quantize_fp8(params, block)
    orbax_io.save(str(tmp_path / "c"), q, cfg)
    back = orbax_io.restore(str(tmp_path / "c")).params
    assert jax.tree.structure(back) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    w = back["layers"][1]["w_down"]
    assert isinstance(w, Fp8Weight) and w.block == q["layers"][1]["w_down"].block
    assert w.dtype == jnp.bfloat16


# ---- memory plan ---------------------------------------------------------------------------------

# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), as released
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
    "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}


def test_deepseek_v3_fits_eight_h200s_in_fp8_and_not_in_bf16():
    cfg = ModelConfig.from_hf(DEEPSEEK_V3)
    fp8 = memory_plan(cfg, "fp8", num_devices=8, max_num_seqs=32, max_len=8192, page_size=64)
    bf16 = memory_plan(cfg, "bf16", num_devices=8, max_num_seqs=32, max_len=8192, page_size=64)
    assert abs(fp8.parameters - 671e9) <= 0.01 * 671e9          # DeepSeek's 671B
    assert 10e9 < fp8.mtp_parameters < 14e9                      # one MoE layer + eh_proj
    # FP8 is one byte a weight (+ a float32 per 128 x 128 block), bf16 two
    ratio = bf16.weight_bytes / fp8.weight_bytes
    assert 1.9 < ratio < 2.0
    assert fp8.weights_fit and fp8.fits and fp8.free_bytes > 0
    assert fp8.cache_bytes > 10e9                                # room for a real KV cache
    assert not bf16.weights_fit and not bf16.fits
    # latent cache: 576 values / token / layer (62 layers with the MTP one), bf16, replicated
    assert fp8.cache_bytes == 32 * 8192 * 62 * 576 * 2
    text = str(fp8)
    assert "fits" in text and "weights" in text and "KV / latent cache" in text
    assert "does NOT fit" in str(bf16)


def test_memory_plan_splits_over_the_model_axis_and_names_bad_arguments():
    cfg = tiny_config(num_layers=2)
    one = memory_plan(cfg, "bf16", num_devices=1, block=BLOCK)
    four = memory_plan(cfg, "bf16", num_devices=4, block=BLOCK)
    assert one.parameters == sum(int(np.prod(a.shape)) for p, a in
                                 _flat(mtpjax.init_params(cfg, jax.random.PRNGKey(0)))
                                 if p[0] != "mtp")
    assert four.weight_bytes < one.weight_bytes
    assert memory_plan(cfg, "fp8", num_devices=1, block=BLOCK).weight_bytes < one.weight_bytes
    with pytest.raises(ValueError, match="ep=2 != tp=4"):
        memory_plan(cfg, num_devices=4, ep=2)
    with pytest.raises(ValueError, match="weight_dtype='int4'"):
        memory_plan(cfg, "int4")
    with pytest.raises(ValueError, match="tp=3 must divide num_devices=4"):
        memory_plan(cfg, num_devices=4, tp=3)


def _flat(params):
    from mtpjax.model.params import tree_items
    return list(tree_items(params))


def test_fp8_params_on_meshes_match_one_device():
    """tests/fp8_mesh_case.py on 4 fake CPU devices, meshes (1, 4) and (2, 2): the expert-parallel
    MoE layer with FP8 routed and shared experts matches one device's; an FP8 checkpoint loaded
    with mesh= and an Orbax folder restored with mesh= equal shard_params' placement bit for
    bit, shardings included; scales split with
    their values only along whole blocks; greedy generate on the mesh equals one device's."""
    import json
    import os
    import subprocess
    import sys
    from tests.parallel.test_parallel import _env
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))     # tests/
    run = subprocess.run([sys.executable, os.path.join(here, "fp8_mesh_case.py")],
                         capture_output=True, text=True, env=_env(4), timeout=900)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, run.stderr[-4000:]
    out = json.loads(lines[-1][len("RESULT "):])
    for mesh in ("1x4", "2x2"):
        r = out[mesh]
        assert r["layer_err"] <= 1e-5 * out["layer_scale"], mesh
        assert r["loaded_equal"] and r["restored_equal"] and r["fp8"], mesh
        assert r["specs"]["w_gate"] == ["P('model',)", "P('model',)"]        # experts
        assert r["specs"]["wq_b"] == ["P(None, 'model')", "P(None, 'model')"]  # whole blocks
        assert r["specs"]["wkv_b"] == ["P()", "P()"]              # 80 / m: blocks would split
        assert r["specs"]["shared_gate"] == ["P(None, 'model')", "P()"]      # one scale column
    assert out["1x4"]["tokens_equal"]
