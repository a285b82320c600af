"""Guards the on-device loops against copying weights (issue: end-to-end speed).

Measured on an H100 (docs/benchmarks.md): a slice of a stacked-layer weight inside
`generate`'s while_loop was materialized as a copy every iteration (13 GB per step at the 8B
shape), and XLA's GPU DotMerger concatenated q/k/v and gate/up weights every step. The fixes are
structural: every layer has its own weight buffers (nothing to slice), and every step is compiled
through `step_jit` (DotMerger off). These tests compile the real loops on CPU for a small model
whose weight shapes are unique and assert that no copy / slice / transpose / concatenate in the
optimized HLO produces a weight-shaped array, and that every jitted step goes through step_jit.
Speed itself stays in benchmarks.
"""

import importlib
import re

import jax
import jax.numpy as jnp
import pytest

import mtpjax
from mtpjax.step_jit import STEP_COMPILER_OPTIONS, STEP_FUNCTIONS

gen = importlib.import_module("mtpjax.generate")   # the module (mtpjax.generate is the function)

# unique weight shapes: E=48, heads 4 x 16 (q 64), kv 2 x 16 (32), I=80, V=200
CFG = mtpjax.ModelConfig(vocab_size=200, hidden_size=48, intermediate_size=80, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, num_mtp_layers=2)
MOVES = ("copy", "slice", "dynamic-slice", "transpose", "concatenate")
_INSTR = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* ([\w-]+)\(")


def weight_shapes(params):
    shapes = set()
    for leaf in jax.tree.leaves(params):
        if leaf.ndim == 2:
            shapes |= {tuple(leaf.shape), tuple(reversed(leaf.shape))}
    return shapes


def weight_moves(hlo_text: str, shapes) -> list[str]:
    """Instructions that move (copy, slice, transpose, concatenate) a weight-shaped array, or
    concatenate weights (an output whose leading dim is a weight's and the rest a sum)."""
    bad = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if not m or m.group(2) not in MOVES or not m.group(1):
            continue
        dims = tuple(int(d) for d in m.group(1).split(","))
        while len(dims) > 2 and dims[0] == 1:        # a stacked slice [1, a, b]
            dims = dims[1:]
        if dims in shapes or (m.group(2) == "concatenate" and len(dims) == 2
                              and dims[0] == CFG.hidden_size and dims[1] > CFG.hidden_size):
            bad.append(line.strip()[:160])
    return bad


def capture_and_compile(monkeypatch, module, name, run):
    """Runs `run()`, capturing the abstract arguments of module.<name>; returns its optimized
    HLO for them."""
    return capture_lowered(monkeypatch, module, name, run).compile().as_text()


def abstract(args):
    """args with every array replaced by its shape and dtype (enough to lower again)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
                        if isinstance(a, jax.Array) else a, args)


def capture_lowered(monkeypatch, module, name, run):
    """Runs `run()`, capturing the abstract arguments of module.<name> (a jitted function);
    returns it lowered for them."""
    fn = getattr(module, name)
    seen = {}

    def spy(*args, **kwargs):
        seen["args"] = abstract(args)
        seen["kwargs"] = kwargs
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    run()
    monkeypatch.undo()
    return fn.lower(*seen["args"], **seen["kwargs"])


@pytest.fixture(scope="module")
def params():
    return mtpjax.init_params(CFG, jax.random.PRNGKey(0))


def test_every_layer_has_its_own_weights(params):
    assert isinstance(params["layers"], tuple) and len(params["layers"]) == CFG.num_layers
    assert isinstance(params["mtp"], tuple) and len(params["mtp"]) == CFG.num_mtp_layers
    assert params["layers"][0]["wq"].shape == (48, 64)


def test_the_detector_sees_a_stacked_weight_slice(params):
    """The HLO check itself: slicing a stacked weight inside a loop is reported."""
    stacked = jnp.stack([p["wq"] for p in params["layers"]])

    @jax.jit
    def loop(w, x):
        return jax.lax.fori_loop(0, 3, lambda i, x: x @ w[1] @ w[2].T, x)

    hlo = loop.lower(stacked, jnp.ones((2, 48))).compile().as_text()
    assert weight_moves(hlo, weight_shapes(params))


def test_generate_loop_moves_no_weights(params, monkeypatch):
    hlo = capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
        params, CFG, [[1, 2, 3], [4, 5]], max_new_tokens=4))
    assert "while" in hlo
    assert weight_moves(hlo, weight_shapes(params)) == []


@pytest.mark.parametrize("method,K", [("chain", 3), ("multi_layer", 2)])
def test_speculative_loop_and_draft_loop_move_no_weights(params, monkeypatch, method, K):
    spec = mtpjax.SpecConfig(num_speculative_tokens=K, method=method)
    hlo = capture_and_compile(monkeypatch, gen, "_loop", lambda: mtpjax.generate(
        params, CFG, [[1, 2, 3], [4, 5]], max_new_tokens=4, spec=spec))
    assert hlo.count("while") >= 2                     # the generate loop and the draft loop
    assert weight_moves(hlo, weight_shapes(params)) == []


def test_engine_step_moves_no_weights(params, monkeypatch):
    runner = __import__("mtpjax.engine.runner", fromlist=["_step"])
    llm = mtpjax.LLM(params, CFG, mtpjax.SpecConfig(num_speculative_tokens=2), num_pages=32,
                     page_size=8, max_num_seqs=2, max_num_batched_tokens=32)
    hlo = capture_and_compile(monkeypatch, runner, "_step", lambda: llm.generate(
        [[1, 2, 3]], mtpjax.SamplingParams(max_tokens=3)))
    assert weight_moves(hlo, weight_shapes(params)) == []


def test_fused_mla_step_slices_no_weight_halves(monkeypatch):
    """MLA's absorbed attention uses kv_b as two halves, W_UK [R, H, dn] and W_UV [R, H, dv].
    Sliced from kv_b inside the step they were copied every step (a `loop_slice_fusion` in
    the H200 step of V2-Lite); `fuse_projections` splits kv_b once at load, so the engine's
    step (verify and draft passes) holds them only as parameters."""
    from tests.conftest import tiny_mla_moe_config
    runner = __import__("mtpjax.engine.runner", fromlist=["_step"])
    cfg = tiny_mla_moe_config(61)
    mla_params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), std=0.1)
    m = cfg.mla
    halves = {(m.kv_lora_rank, cfg.num_heads, m.qk_nope_head_dim),
              (m.kv_lora_rank, cfg.num_heads, m.v_head_dim)}
    moved = {}
    for fuse in (False, True):
        llm = mtpjax.LLM(mla_params, cfg, mtpjax.SpecConfig(num_speculative_tokens=2),
                         num_pages=32, page_size=8, max_num_seqs=2, max_num_batched_tokens=32,
                         fuse_projections=fuse)
        hlo = capture_and_compile(monkeypatch, runner, "_step", lambda: llm.generate(
            [[1, 2, 3]], mtpjax.SamplingParams(max_tokens=3)))
        moved[fuse] = weight_moves(hlo, halves)
    assert moved[False]            # the detector sees the in-step slices of the unsplit kv_b
    assert moved[True] == []


def test_every_jitted_step_goes_through_step_jit():
    import mtpjax.engine.runner as runner
    jitted = [getattr(m, n) for m in (gen, runner) for n in dir(m)
              if hasattr(getattr(m, n), "lower") and hasattr(getattr(m, n), "trace")]
    assert len(jitted) >= 3
    missing = [f.__name__ for f in jitted if not any(f is g for g in STEP_FUNCTIONS)]
    assert missing == []
    assert STEP_COMPILER_OPTIONS == {"xla_gpu_dot_merger_threshold_mb": 0}


def test_generate_loop_runs_inside_the_cuda_graph():
    """generate's loop is compiled with while loops as CUDA-graph commands (step_jit says why);
    the engine's step, which XLA graphs whole, keeps XLA's defaults."""
    import mtpjax.engine.runner as runner
    from mtpjax.step_jit import compiler_options_of
    loop = compiler_options_of(gen._loop)["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL", "FUSION", "CUBLAS", "CUSTOM_CALL"} <= set(loop)
    assert "xla_gpu_enable_command_buffer" not in compiler_options_of(runner._step)


def test_generate_and_the_engine_run_the_same_step(params, monkeypatch):
    """One device step: both paths trace `mixed_step` (and nothing else that steps)."""
    import mtpjax.engine.runner as runner
    ms = importlib.import_module("mtpjax.speculative.mixed_step")
    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["first_pass_len"])
        return ms.mixed_step(*args, **kwargs)

    monkeypatch.setattr(gen, "mixed_step", counting)
    monkeypatch.setattr(runner, "mixed_step", counting)
    spec = mtpjax.SpecConfig(num_speculative_tokens=2)
    # shapes not compiled elsewhere in this file, so every program is traced here
    out = mtpjax.generate(params, CFG, [[7, 8, 9, 10, 11]], max_new_tokens=5, spec=spec)
    assert len(calls) == 2                                # prefill + the loop body
    llm = mtpjax.LLM(params, CFG, spec, num_pages=32, page_size=8, max_num_seqs=3,
                     max_num_batched_tokens=64)
    got = llm.generate([[7, 8, 9, 10, 11]], mtpjax.SamplingParams(max_tokens=5))
    assert len(calls) > 2                                 # the engine's buckets
    assert got[0].token_ids == out.tokens[0]


def test_engine_steps_update_slot_state_in_place(monkeypatch):
    """The step reads each slot's draft-input history (hist_tokens [S, W], hist_hidden
    [S, W, H]) and writes it back: XLA fused the row gathers into several consumers, some of
    which it could run after the in-place update, and so copied the whole arrays first (at
    batch 1, in the one-token programs adaptive K runs). Every program an adaptive-K engine
    compiles, zero to K passes, updates them and draft_probs [S, K, V] in place."""
    import mtpjax.speculative.adaptive as adaptive
    from tests.conftest import tiny_mla_moe_config
    runner = __import__("mtpjax.engine.runner", fromlist=["_step"])
    cfg = tiny_mla_moe_config(59)
    mla_params = mtpjax.init_params(cfg, jax.random.PRNGKey(1), std=0.1)
    llm = mtpjax.LLM(mla_params, cfg, mtpjax.SpecConfig(num_speculative_tokens=3),
                     num_pages=32, page_size=8, max_num_seqs=3,
                     adaptive_k=mtpjax.AdaptiveK())
    monkeypatch.setattr(adaptive, "_best_passes", lambda *a, **k: 0)   # then one-token steps
    fn, calls = runner._step, {}

    def spy(*args, **kwargs):
        key = tuple(sorted((k, v) for k, v in kwargs.items() if k != "backend"))
        calls.setdefault(key, (abstract(args), kwargs))
        return fn(*args, **kwargs)
    monkeypatch.setattr(runner, "_step", spy)
    llm.generate([[1, 2, 3, 4, 5]], mtpjax.SamplingParams(max_tokens=16))
    monkeypatch.undo()
    state = llm.runner.state
    arrays = {"hist_tokens": state.hist_tokens, "hist_hidden": state.hist_hidden,
              "draft_probs": state.draft_probs}
    kinds = {name: (a.dtype.name.replace("float", "f").replace("int", "s"),
                    ",".join(map(str, a.shape))) for name, a in arrays.items()}
    one_token = [kw for _, kw in calls.values() if kw["shape"][0] == 1]
    assert {kw["draft_passes"] for kw in one_token} >= {0, 1}, sorted(calls)
    for args, kwargs in calls.values():
        hlo = fn.lower(*args, **kwargs).compile().as_text()
        copied = [name for name, (dt, dims) in kinds.items()
                  if re.search(rf"= {dt}\[{dims}\]\{{[\d,]*\}} copy\(", hlo)]
        assert copied == [], (kwargs["shape"], kwargs["draft_passes"], copied)
