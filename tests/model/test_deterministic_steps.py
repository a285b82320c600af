"""Guards the engine's step against float scatter-adds: on the GPU XLA lowers them to atomics,
whose order (and so rounding) changes from run to run. One in the MoE layer's combine made a
DeepSeek-V2-Lite-shaped model's greedy tokens differ between two runs of one program on the
H100. Integer scatter-adds (counts, sizes) are exact.
"""
import re

import jax
import pytest

import mtpjax
from mtpjax.engine import runner
from tests.model.test_deepseek import ds_config
from tests.model.test_no_weight_copies import capture_lowered


def float_scatter_adds(stablehlo: str) -> list[str]:
    """The scatters whose update computation adds floats."""
    bodies = re.findall(r'"stablehlo.scatter"\(.*?\}\) :', stablehlo, flags=re.S)
    return [b for b in bodies if re.search(r"stablehlo.add .*: tensor<(f|bf)\d+>", b)]


@pytest.mark.parametrize("K,acceptance", [(0, None), (2, "rejection")])
def test_engine_step_of_an_mla_moe_model_has_no_float_scatter_add(monkeypatch, K, acceptance):
    cfg = ds_config(num_mtp_layers=1)                    # MLA attention, MoE layers
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=acceptance) if K else None
    llm = mtpjax.LLM(mtpjax.init_params(cfg, jax.random.PRNGKey(0)), cfg, spec, num_pages=32,
                     page_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    text = capture_lowered(monkeypatch, runner, "_step", lambda: llm.generate(
        [[1, 2, 3], [4, 5]], mtpjax.SamplingParams(max_tokens=3, temperature=1.0))).as_text()
    assert '"stablehlo.scatter"' in text          # KV-cache writes: the search sees scatters
    bad = float_scatter_adds(text)
    assert not bad, bad[0][:500]
