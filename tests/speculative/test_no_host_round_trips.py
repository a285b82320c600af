"""Guards the jitted steps against XLA while loops that nobody asked for.

On the GPU every iteration of an XLA while loop copies its predicate to the host (outside a
CUDA graph's while command), so a loop hidden in a helper costs a host round trip per
iteration, per call. `jnp.searchsorted`'s default method is such a loop (log2(n) iterations):
in the grouped matmul's tile layout it held the H100's expert layer at 338 us for one
DeepSeek-V2-Lite token (102 us without), and the engine's speculative step ran one per step to
map draft-input rows to requests. The only loops a step
may hold are the ones the design names: the K-step draft loop (`lax.fori_loop`) and generate's
outer loops. Speed stays in benchmarks.
"""

import re

import jax
import jax.numpy as jnp
import pytest

import mtpjax
from tests.conftest import tiny_mla_moe_config
from tests.kernels.test_kernels_lower_for_cuda import CASES, lower_for_cuda
from tests.model.test_no_weight_copies import capture_and_compile

CFG = mtpjax.ModelConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_layers=2)
_WHILE = re.compile(r" while\(")


def hlo_whiles(hlo_text: str) -> int:
    return sum(1 for line in hlo_text.splitlines() if _WHILE.search(line))


@pytest.mark.parametrize("K,acceptance,expected", [(0, None, 0), (3, "rejection", 1),
                                                    (3, "relaxed", 1)])
def test_engine_step_holds_only_the_draft_loop(monkeypatch, K, acceptance, expected):
    """Plain step: no loop; a chain K=3 step: the draft loop alone (XLA:CPU keeps it as a
    while; a searchsorted of the draft-input rows added a second one, relaxed acceptance's
    scans over the drafts two more)."""
    runner = __import__("mtpjax.engine.runner", fromlist=["_step"])
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, acceptance=acceptance,
                             think_start_token_id=7, think_end_token_id=8) if K else None
    llm = mtpjax.LLM(params, CFG, spec, num_pages=32, page_size=8, max_num_seqs=2,
                     max_num_batched_tokens=32)
    hlo = capture_and_compile(monkeypatch, runner, "_step", lambda: llm.generate(
        [[1, 2, 3], [4, 5]], mtpjax.SamplingParams(max_tokens=3)))
    assert hlo_whiles(hlo) == expected


@pytest.mark.parametrize("name", ["grouped_matmul", "grouped_matmul_split_k", "grouped_swiglu",
                                  "grouped_swiglu_split_k"])
def test_grouped_matmul_wrapper_has_no_loop(name):
    """The kernel's wrapper (tile layout, padding, gathers) is loop-free in the CUDA export;
    the kernel's own K loop lives inside the Triton call, not in the StableHLO."""
    fn, args = CASES[name]
    text, _ = lower_for_cuda(fn, *args)
    assert "stablehlo.while" not in text


def test_tile_layout_has_no_loop():
    from pallas_kernels.grouped_matmul.grouped_matmul import tile_layout
    sizes = jnp.array([3, 0, 5, 1], jnp.int32)
    text = jax.jit(lambda s: tile_layout(s, 16, 4)[:2]).lower(sizes).as_text()
    assert "stablehlo.while" not in text


@pytest.mark.parametrize("K,expected", [(0, 2), (3, 3)])
def test_generate_loop_holds_only_its_named_loops(monkeypatch, K, expected):
    """generate's program: its outer while_loop and the fori_loop of steps between done-checks,
    plus the draft loop with MTP (these run as CUDA-graph while commands: step_jit)."""
    import importlib
    gen = importlib.import_module("mtpjax.generate")
    params = mtpjax.init_params(CFG, jax.random.PRNGKey(0))
    spec = mtpjax.SpecConfig(num_speculative_tokens=K) if K else None
    hlo = capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
        params, CFG, [[1, 2, 3], [4, 5]], max_new_tokens=4, spec=spec))
    assert hlo_whiles(hlo) == expected


class _LoopCalled(Exception):
    pass


@pytest.mark.parametrize("moe,spec", [(False, 2), (True, None), (True, 2)],
                         ids=["dense-mtp", "moe-plain", "moe-mtp"])
def test_generate_loop_graph_only_where_it_pays(monkeypatch, moe, spec):
    """generate's loop runs as CUDA-graph WHILE / CONDITIONAL commands, except speculative
    decoding on an MoE model: there the graph loop cost 1.8x the host-checked one at the
    DeepSeek-V2-Lite shape on an H200 (docs/benchmarks.md). Checked on the loop generate calls
    (its compile is skipped) and on its compiler options."""
    import importlib

    from mtpjax.step_jit import LOOP_COMPILER_OPTIONS, STEP_COMPILER_OPTIONS, compiler_options_of
    gen = importlib.import_module("mtpjax.generate")
    cfg = tiny_mla_moe_config(48, moe=moe)
    called = []
    for name in ("_loop", "_loop_host_checked"):
        def spy(*a, _name=name, _options=compiler_options_of(getattr(gen, name)), **k):
            called.append((_name, _options))
            raise _LoopCalled
        monkeypatch.setattr(gen, name, spy, raising=True)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), std=0.02)
    with pytest.raises(_LoopCalled):
        mtpjax.generate(params, cfg, [[1, 2, 3]], max_new_tokens=4,
                        spec=spec and mtpjax.SpecConfig(num_speculative_tokens=spec))
    (name, options), = called
    in_graph = not (moe and spec)
    assert name == ("_loop" if in_graph else "_loop_host_checked")
    graph_types = options.get("xla_gpu_enable_command_buffer", "")
    assert ("WHILE" in graph_types) == in_graph, options
    assert options == {**STEP_COMPILER_OPTIONS, **(LOOP_COMPILER_OPTIONS if in_graph else {})}
