"""bench.gpu_check's opt-in table on CPU (reference attention, a small model): every opt-in path
gives the reference tokens, and the environment is restored after each."""

import os
import types

import jax
import pytest

import mtpjax
from mtpjax.bench import gpu_check
from tests.model.test_deepseek import ds_config


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_opt_in_paths_give_the_reference_tokens(name):
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        # 256 positions hold the longest prompt (120) and its tokens; the engine's block
        # tables span max_position_embeddings, so the reference attention gathers that many
        cfg = (mtpjax.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  num_mtp_layers=1, max_position_embeddings=256)
               if name == "gqa" else
               ds_config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                         max_position_embeddings=256))
        before = os.environ.get("MTPJAX_MOE_MATMUL")
        # the MLA model's MoE runs interpreted Pallas kernels here: fewer, shorter requests
        prompts = 3 if name == "gqa" else 2
        rows = gpu_check.check_opt_in(name, cfg, attention_impl="reference",
                                      max_new=6 if name == "gqa" else 4, num_prompts=prompts)
        assert os.environ.get("MTPJAX_MOE_MATMUL") == before
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert [r[1] for r in rows] == [label for label, _, _ in gpu_check.OPT_IN[name]]
    for r in rows:
        assert r[2] == r[3] == r[4] == prompts, r


def test_bf16_mla_table_plumbing_and_agreement_count(monkeypatch):
    """check_mla_kernels_bf16 (the table itself runs on the GPU): each kernel is forced in
    turn through MTPJAX_MLA_KERNEL, read while tracing, and the caller's value comes back;
    _agreeing counts each stream's tokens before its first difference. generate and LLM are
    stand-ins here, so that only the plumbing is tested, and cheaply."""
    assert gpu_check._agreeing([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5, 6]]) == 4
    seen = []

    def fake_generate(params, cfg, prompts, attention_impl, **kw):
        seen.append((attention_impl, os.environ.get("MTPJAX_MLA_KERNEL")))
        assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(params))
        wrong = attention_impl != "reference" and os.environ["MTPJAX_MLA_KERNEL"] == "triton"
        return types.SimpleNamespace(tokens=[[1, 2, 3 + wrong], [4, 5, 6]])

    class FakeLLM:
        def __init__(self, *a, **k):
            pass

        def generate(self, prompts, sampling):
            return [types.SimpleNamespace(token_ids=t) for t in ([1, 2, 3], [4, 9, 6])]

    monkeypatch.setattr(gpu_check, "_model_inputs", lambda cfg, n: (
        {"w": jax.numpy.ones((2, 2))}, [[7, 8]] * n))
    monkeypatch.setattr(gpu_check.mtpjax, "generate", fake_generate)
    monkeypatch.setattr(gpu_check.mtpjax, "LLM", FakeLLM)
    monkeypatch.setenv("MTPJAX_MLA_KERNEL", "triton")
    rows = gpu_check.check_mla_kernels_bf16(None, num_prompts=2)
    assert rows == [("mla", "mosaic", "6 (6)", "4 (6)"), ("mla", "triton", "5 (6)", "4 (6)")]
    assert seen == [("reference", "triton"), ("pallas", "mosaic"), ("pallas", "triton")]
    assert os.environ["MTPJAX_MLA_KERNEL"] == "triton"
    seen.clear()
    rows = gpu_check.check_mla_kernels_bf16(None, num_prompts=2, kernels=("mosaic",))
    assert rows == [("mla", "mosaic", "6 (6)", "4 (6)")]
    assert seen == [("reference", "triton"), ("pallas", "mosaic")]


def test_gpu_check_refuses_unknown_tables_and_mla_kernels():
    """Refused before anything runs, and before main() sets its matmul precision."""
    before = jax.config.jax_default_matmul_precision
    with pytest.raises(SystemExit, match="--mla-kernels takes mosaic and/or triton, got "
                                         r"\['flash'\]"):
        gpu_check.main(["--tables", "mla-bf16", "--mla-kernels", "flash"])
    with pytest.raises(SystemExit, match="--tables takes"):
        gpu_check.main(["--tables", "speed"])
    assert jax.config.jax_default_matmul_precision == before
