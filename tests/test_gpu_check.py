"""bench.gpu_check's opt-in table on CPU (reference attention, a small model): every opt-in path
gives the reference tokens, and the environment is restored after each."""

import os

import jax
import pytest

import mtpjax
from mtpjax.bench import gpu_check
from tests.test_deepseek import ds_config


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_opt_in_paths_give_the_reference_tokens(name):
    jax.config.update("jax_default_matmul_precision", "highest")
    try:
        cfg = (mtpjax.ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                                  num_mtp_layers=1) if name == "gqa" else
               ds_config(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32))
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
