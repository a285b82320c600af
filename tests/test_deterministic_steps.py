"""Guards the engine's step against float scatter-adds: on the GPU XLA lowers them to atomics,
whose order (and so rounding) changes from run to run. One in the MoE layer's combine made a
DeepSeek-V2-Lite-shaped model's greedy tokens differ between two runs of one program on the
H100 (docs/benchmarks.md, round 3 session 10). Integer scatter-adds (counts, sizes) are exact.
"""
import re

import jax
import pytest

import mtpjax

CFG = mtpjax.ModelConfig(model_type="deepseek_v3", vocab_size=96, hidden_size=32,
                         intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=4,
                         attention_kind="mla", q_lora_rank=24, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                         rope_interleave=True, ffn_kind="moe", n_routed_experts=8,
                         num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                         first_k_dense_replace=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, norm_topk_prob=True,
                         topk_method="noaux_tc", scoring_func="sigmoid", num_mtp_layers=1)


def float_scatter_adds(stablehlo: str) -> list[str]:
    """The scatters whose update computation adds floats."""
    bodies = re.findall(r'"stablehlo.scatter"\(.*?\}\) :', stablehlo, flags=re.S)
    return [b for b in bodies if re.search(r"stablehlo.add .*: tensor<(f|bf)\d+>", b)]


def lowered_step(monkeypatch, spec):
    runner = __import__("mtpjax.engine.runner", fromlist=["_step"])
    fn = runner._step
    seen = {}

    def spy(*args, **kwargs):
        seen["args"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                                    if isinstance(a, jax.Array) else a, args)
        seen["kwargs"] = kwargs
        return fn(*args, **kwargs)

    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    llm = mtpjax.LLM(params, CFG, spec, num_pages=32, page_size=8, max_num_seqs=2,
                     max_num_batched_tokens=32)
    monkeypatch.setattr(runner, "_step", spy)
    llm.generate([[1, 2, 3], [4, 5]], mtpjax.SamplingParams(max_tokens=3, temperature=1.0))
    monkeypatch.undo()
    return fn.lower(*seen["args"], **seen["kwargs"]).as_text()


@pytest.mark.parametrize("K,acceptance", [(0, None), (2, "rejection")])
def test_engine_step_of_an_mla_moe_model_has_no_float_scatter_add(monkeypatch, K, acceptance):
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=acceptance) if K else None
    text = lowered_step(monkeypatch, spec)
    assert '"stablehlo.scatter"' in text          # KV-cache writes: the search sees scatters
    bad = float_scatter_adds(text)
    assert not bad, bad[0][:500]
