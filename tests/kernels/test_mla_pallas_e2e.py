"""End to end on a DeepSeek-style MLA model: the Pallas MLA kernel (interpret mode on CPU) gives
the reference's greedy tokens, speculative K=2, through `generate` and through the engine (ragged
batches: chunked prefill rows next to verify rows; uniform batches in the draft passes)."""

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import ModelConfig, SamplingParams, SpecConfig

# test_deepseek's tiny DeepSeek-V3 attention (MLA, q LoRA, interleaved rope) with a dense FFN,
# one target layer and one MTP module: the MoE is not what is tested here, and XLA:CPU compiles
# dominate these tests. Rope 8 is fine interpreted (the compiled kernel needs >= 16).
CFG = ModelConfig(model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=48,
                  num_layers=1, num_heads=4, num_kv_heads=4, attention_kind="mla",
                  mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
                           qk_rope_head_dim=8, v_head_dim=12, rope_interleave=True),
                  num_mtp_layers=1)


def _ds_params(cfg, seed):
    return mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def _prompts(seed, n):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, CFG.vocab_size, int(t)).tolist() for t in rng.integers(4, 14, n)]


PROMPTS = _prompts(50, 3)
SPEC = SpecConfig(num_speculative_tokens=2)


@pytest.fixture(scope="module")
def params_and_want():
    """One reference run shared by both tests (its compile is the costly part)."""
    params = _ds_params(CFG, 5)
    want = mtpjax.generate(params, CFG, PROMPTS, max_new_tokens=5, page_size=8, spec=SPEC,
                           attention_impl="reference").tokens
    return params, want


def test_generate_mla_kernel_matches_reference(params_and_want):
    params, want = params_and_want
    got = mtpjax.generate(params, CFG, PROMPTS, max_new_tokens=5, page_size=8, spec=SPEC,
                          attention_impl="pallas_interpret")
    assert got.tokens == want


def test_engine_mla_kernel_matches_reference(params_and_want):
    """Token budget 8: prompts are prefilled in chunks that share a step with verify rows."""
    params, want = params_and_want
    llm = mtpjax.LLM(params, CFG, SPEC, num_pages=24, page_size=8, max_num_seqs=3,
                     max_num_batched_tokens=8, attention_impl="pallas_interpret", warmup=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5))
    assert [o.token_ids for o in outs] == want


def test_dispatch_runs_the_mosaic_mla_kernel_on_a_verify_batch(monkeypatch):
    """The model's dispatch with the Mosaic-GPU kernel (what the GPU default takes for bf16
    DeepSeek shapes; forced here, interpreted) == the reference on a uniform verify batch
    (q_len 4, one request left-padded to a short KV), bf16 latent pages."""
    import jax.numpy as jnp

    from mtpjax.cache import PagedBatch
    from mtpjax.model.backend import AttentionBackend
    from mtpjax.model.mla import LatentPages
    from pallas_kernels.mla_paged_attention import mosaic_tiles
    from tests.kernel_oracle import TOL, rel_err

    monkeypatch.setenv("MTPJAX_MLA_KERNEL", "mosaic")
    calls = []
    kernel = mosaic_tiles.mla_tiles_mgpu
    monkeypatch.setattr(mosaic_tiles, "mla_tiles_mgpu",
                        lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    rng = np.random.default_rng(7)
    rank, width, heads, page = 128, 192, 16, 16
    kv = np.array([70, 3, 40])
    positions = np.stack([np.arange(k - 4, k) for k in kv]).clip(min=-1)   # [3, 4]
    tables = rng.permutation(18)[:15].reshape(3, 5)
    batch = PagedBatch.uniform(jnp.asarray(positions, jnp.int32), jnp.asarray(tables))
    pages = LatentPages(jnp.asarray(rng.standard_normal((18, page, width)), jnp.bfloat16), rank)
    q = jnp.asarray(rng.standard_normal((12, heads, width)), jnp.bfloat16)
    got = AttentionBackend("pallas_interpret").paged_attention(q, pages, batch, sm_scale=0.1)
    want = AttentionBackend("reference").paged_attention(q, pages, batch, sm_scale=0.1)
    live = np.asarray(batch.positions) >= 0
    assert calls == [(3, 4, heads, width)]      # it ran, token-major: 64-row tiles in place
    assert got.shape == (12, heads, rank)
    assert rel_err(got[live], want[live]) < TOL["bfloat16"]
