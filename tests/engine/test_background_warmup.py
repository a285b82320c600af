"""Background warm-up (engine/background_warmup.py) and serving a step with a larger compiled
bucket (engine/covering.py): the same tokens as an engine that compiles each step exactly,
nothing compiled after `wait_for_warmup()`, failures warned, threads stopped with the engine."""

import gc
import threading
import time
import warnings

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine import runner as runner_mod
from mtpjax.engine.background_warmup import BackgroundWarmup, covering_bucket
from mtpjax.engine.covering import covering_program, pad_tokens
from mtpjax.engine.executable_store import step_identity
from mtpjax.engine.warmup import step_buckets
from mtpjax.sampling import SAMPLING_MODES
from tests.conftest import random_params, tiny_config

_COMPILES = []


def _count_compiles(name, seconds, **kw):
    if name == "/jax/core/compile/backend_compile_duration":
        _COMPILES.append(seconds)


jax.monitoring.register_event_duration_secs_listener(_count_compiles)

# Counts XLA compiles: a hit in the run's shared persistent cache would hide one.
pytestmark = pytest.mark.own_compilation_cache

KW = dict(num_pages=40, page_size=4, max_num_seqs=2)


def _workload(seed, vocab):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in (1, 7, 13, 3, 2)]
    sps = [SamplingParams(max_tokens=int(m), temperature=t, seed=seed + i)
           for i, (m, t) in enumerate(zip([4, 9, 5, 7, 3], [0, 0.8, 0, 1.0, 0]))]
    return prompts, sps


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_covering_program_is_the_smallest_larger_one(seed):
    rng = np.random.default_rng(seed)
    R, M = 3, 5
    keys = {((int(T), R, M), int(F), str(m), int(p))
            for T, F, m, p in zip(2 ** rng.integers(0, 6, 30), 2 ** rng.integers(0, 6, 30),
                                  rng.choice(["greedy", "filter"], 30), rng.integers(0, 2, 30))}
    keys |= {((64, R + 1, M), 1, "greedy", 0), ((64, R, M + 1), 1, "greedy", 0)}  # other R, M
    executables = {k: object() for k in keys}
    for T, F, m, p in zip(2 ** rng.integers(0, 7, 20), 2 ** rng.integers(0, 7, 20),
                          rng.choice(["greedy", "filter"], 20), rng.integers(0, 2, 20)):
        want_key = ((int(T), R, M), int(F), str(m), int(p))
        # more draft passes serve a step too (they draw drafts nobody verifies), and a
        # "filter" program a "greedy" step (never the other way round)
        fits = [k for k in keys if k[0][1:] == (R, M)
                and k[2] in {want_key[2], "filter"} and k[3] >= want_key[3]
                and k[0][0] >= T and k[1] >= F]
        got = covering_program(executables, want_key)
        if not fits:
            assert got is None
        else:
            best = min(fits, key=lambda k: (k[0][0], k[1], k[3], k[2] != want_key[2]))
            assert got == (best, executables[best])


def test_pad_tokens_pads_like_pack_and_refuses_to_shrink():
    cfg = tiny_config(vocab_size=40, num_layers=1)
    llm = mtpjax.LLM(random_params(cfg), cfg, warmup=False, max_num_batched_tokens=8, **KW)
    batch, _ = llm.runner.pack(mtpjax.engine.scheduler.SchedulerOutput([], [], 0))
    padded = pad_tokens(batch, 32)
    assert padded.tokens.shape == (32,) and (padded.tokens[8:] == 0).all()
    assert (padded.positions[8:] == -1).all() and (padded.seq_ids[8:] == 0).all()
    np.testing.assert_array_equal(padded.cu_q_lens, batch.cu_q_lens)
    with pytest.raises(ValueError, match="num_tokens=4"):
        pad_tokens(batch, 4)


@pytest.mark.parametrize("max_tokens", [3, 8, 20, 64, 100])
@pytest.mark.parametrize("max_rows", [1, 3, 32])
@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("minimum", [1, 8])
def test_covering_bucket_is_a_reachable_bucket_covering_all(max_tokens, max_rows, window,
                                                            minimum):
    buckets = step_buckets(max_tokens, max_rows, window, minimum)
    T, F = covering_bucket(buckets)
    assert (T, F) in buckets
    assert all(T >= t and F >= f for t, f in buckets)


@pytest.mark.parametrize("modes", [SAMPLING_MODES, ("filter",)], ids=["both_modes", "filter"])
@pytest.mark.parametrize("spec", [None, SpecConfig(num_speculative_tokens=2)],
                         ids=["plain", "mtp_chain"])
def test_larger_compiled_bucket_gives_the_exact_buckets_tokens(spec, modes):
    """Only the largest bucket is compiled: every step runs padded up to it (greedy and seeded
    sampling rows) and commits the tokens of an engine compiling each step's own bucket; with
    only its "filter" program (background warm-up's first), greedy steps run on that one."""
    cfg = tiny_config(vocab_size=44, num_layers=1)
    params = random_params(cfg, seed=5)
    kw = dict(max_num_batched_tokens=16, **KW)
    exact = mtpjax.LLM(params, cfg, spec, warmup=False, **kw)
    llm = mtpjax.LLM(params, cfg, spec, warmup=False, **kw)
    buckets = step_buckets(16, 2, llm.runner.W)
    cover = covering_bucket(buckets)
    llm.runner.warm_modes = modes
    llm.runner.warmup([cover])
    assert {key[2] for key in llm.runner.executables} == set(modes)
    warming = type("Warming", (), {"done": lambda self: False})()
    llm.runner.warming = warming           # as while background warm-up runs
    ran = []
    pick = llm.runner._compiled_for

    def spy(batch, F, mode, *rest):
        out = pick(batch, F, mode, *rest)
        ran.append((batch.tokens.shape[0], F, out[0].tokens.shape[0], out[1], out[2] is not None))
        return out
    llm.runner._compiled_for = spy
    timed = []            # (mode, T, F, ran padded?, left out of adaptive K's step times?)
    dispatch = llm.runner.dispatch

    def spy_dispatch(out, *a, **k):
        n = len(ran)
        result = dispatch(out, *a, **k)
        if len(ran) > n:
            T, F, T2, F2, _ = ran[-1]
            timed.append((mode_of[0], T, F, (T, F) != (T2, F2), llm.runner.last_step_compiled))
        return result
    mode_of = [None]
    pack = llm.runner.pack

    def spy_pack(*a, **k):
        batch, F = pack(*a, **k)
        mode_of[0] = batch.sampling.mode
        return batch, F
    llm.runner.pack = spy_pack
    llm.runner.dispatch = spy_dispatch
    greedy = [SamplingParams(max_tokens=6, temperature=0)] * 3     # greedy-mode steps only
    for seed in (0, 1):
        prompts, sps = _workload(seed, 44)
        want = [o.token_ids for o in exact.generate(prompts, sps)]
        assert [o.token_ids for o in llm.generate(prompts, sps)] == want, seed
        # with a prompt longer than a step: chunks that fill the largest bucket exactly
        long = prompts[:2] + [np.random.default_rng(seed).integers(0, 44, 21).tolist()]
        want_greedy = [o.token_ids for o in exact.generate(long, greedy)]
        assert [o.token_ids for o in llm.generate(long, greedy)] == want_greedy, seed
    assert all(used and (T2, F2) == cover for _, _, T2, F2, used in ran), ran
    assert any((T, F) != cover for T, F, *_ in ran), "no step needed padding"
    # a step timed for adaptive K ran its own bucket in its own mode's program; every other
    # (padded up, or greedy on the filter program) is left out
    assert timed and all(skipped == (padded or (m == "greedy" and "greedy" not in modes))
                         for m, _, _, padded, skipped in timed), timed
    if spec is None:      # the case above happened: greedy steps in the largest bucket itself
        assert any(m == "greedy" and not padded for m, _, _, padded, _ in timed), timed
    llm.runner.warming = None              # warm-up over: a step's own bucket, compiled
    ran.clear()
    assert [o.token_ids for o in llm.generate(prompts, sps)] == want
    assert not any(used for T, F, _, _, used in ran if (T, F) != cover), ran


def test_background_warmup_same_tokens_and_no_compile_after_wait(monkeypatch):
    monkeypatch.setenv("MTPJAX_WARMUP_THREADS", "2")
    cfg = tiny_config(vocab_size=42, num_layers=1)              # a config no other test compiles
    params = random_params(cfg, seed=2)
    spec = SpecConfig(num_speculative_tokens=1)
    kw = dict(max_num_batched_tokens=8, **KW)
    prompts, sps = _workload(3, 42)
    gate = threading.Event()
    programs = runner_mod.ModelRunner.background_programs

    def gated(self, buckets):         # the threads compile once the first workload is served
        return [(T, F, key, lookup, lambda lower=lower: (gate.wait(600), lower())[1])
                for T, F, key, lookup, lower in programs(self, buckets)]
    monkeypatch.setattr(runner_mod.ModelRunner, "background_programs", gated)
    t0 = time.perf_counter()
    llm = mtpjax.LLM(params, cfg, spec, warmup="background", **kw)
    buckets = step_buckets(8, 2, llm.runner.W)
    cover = covering_bucket(buckets)
    assert [t[:2] for t in llm.warmup_times] == [cover]
    assert {key[2] for key in llm.runner.executables} == {"filter"}    # one program first
    ran = []
    pick = llm.runner._compiled_for

    def spy(batch, F, mode, *rest):
        out = pick(batch, F, mode, *rest)
        ran.append(((batch.tokens.shape[0], F), (out[0].tokens.shape[0], out[1]),
                    out[2] is not None))
        return out
    llm.runner._compiled_for = spy
    early = [o.token_ids for o in llm.generate(prompts, sps)]    # only the cover compiled
    assert not llm.warmup_done()
    assert all(run == cover and used for _, run, used in ran), ran
    assert any(own != cover for own, _, _ in ran), "no step needed padding"
    gate.set()
    assert llm.wait_for_warmup(timeout=600) and llm.warmup_done()
    assert sorted((T, F) for T, F, _ in llm.warmup_times) == sorted(buckets)
    assert time.perf_counter() - t0 < 600
    ran.clear()
    before, size = len(_COMPILES), runner_mod._step._cache_size()
    late = [o.token_ids for o in llm.generate(prompts, sps)]
    assert len(_COMPILES) == before, "a step compiled after the background warm-up"
    assert runner_mod._step._cache_size() == size
    assert all(own == run and used for own, run, used in ran), ran     # each its own bucket
    cold = mtpjax.LLM(params, cfg, spec, warmup=False, **kw)
    want = [o.token_ids for o in cold.generate(prompts, sps)]
    assert early == want and late == want


def test_warmup_argument_is_checked_by_name():
    cfg = tiny_config(vocab_size=40, num_layers=1)
    with pytest.raises(ValueError, match="warmup must be True, False, None or 'background', "
                                         "got warmup='later'"):
        mtpjax.LLM(random_params(cfg), cfg, warmup="later", max_num_batched_tokens=8, **KW)
    llm = mtpjax.LLM(random_params(cfg), cfg, warmup=False, max_num_batched_tokens=8, **KW)
    assert llm.warmup_done() and llm.wait_for_warmup(0)


def test_background_programs_have_the_stores_keys():
    """The threads look programs up by the shapes and shardings of the params and the state
    only: the identity (store key) is the one the blocking warm-up computes from the arrays."""
    cfg = tiny_config(vocab_size=40, num_layers=1)
    llm = mtpjax.LLM(random_params(cfg), cfg, SpecConfig(num_speculative_tokens=1),
                     warmup=False, max_num_batched_tokens=8, **KW)
    r = llm.runner
    seen = []

    class Store:
        def lookup(self, name, arrays, static):
            seen.append(step_identity(name, arrays, static))
            return "key", seen[-1], None
    r.store = Store()
    programs = r.background_programs([(8, 16)])
    assert len(programs) == 2
    for (T, F, key, lookup, _), mode in zip(programs, ("greedy", "filter")):
        assert key[1:3] == (16, mode)
        lookup()
        batch = r.pack(mtpjax.engine.scheduler.SchedulerOutput([], [], r.K))[0].replace(
            tokens=np.zeros(8, np.int32), seq_ids=np.zeros(8, np.int32),
            positions=np.full(8, -1, np.int32))
        inputs, shape = r.device_inputs(batch)
        assert key[0] == shape
        want = step_identity("engine_step", (r.params, r.state, inputs),
                             dict(cfg=r.cfg, spec=r.spec, **r._static(F, shape, mode)))
        assert seen[-1] == want


class _StubRunner:
    """What BackgroundWarmup reads of a runner, with programs that fail or wait."""

    def __init__(self, lowers):
        self.executables = {}
        self._lowers = lowers

    def background_programs(self, buckets):
        return [(T, F, ((T, 1, 1), F, "greedy", 0), lambda: None, lower)
                for (T, F), lower in zip(buckets, self._lowers)]


class _Lowered:
    def compile(self):
        return "program"


def test_a_failing_program_is_warned_and_the_others_registered():
    def boom():
        raise RuntimeError("no compiler today")
    runner = _StubRunner([lambda: _Lowered(), boom, lambda: _Lowered()])
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bw = BackgroundWarmup(runner, [(8, 8), (8, 16), (16, 16)], times, threads=1,
                              progress=False)
        assert bw.wait(30)
    assert sorted(runner.executables) == [((8, 1, 1), 8, "greedy", 0),
                                          ((16, 1, 1), 16, "greedy", 0)]
    assert [t[:2] for t in times] == [(8, 8), (16, 16)]
    assert len(bw.errors) == 1 and "T=8 F=16" in bw.errors[0]
    assert any("no compiler today" in str(w.message) for w in caught)


def test_threads_stop_when_the_runner_is_collected():
    gate = threading.Event()
    calls = []

    def slow():
        calls.append(1)
        gate.wait(30)
        return _Lowered()
    runner = _StubRunner([slow] * 6)
    bw = BackgroundWarmup(runner, [(8, 2 ** i) for i in range(6)], [], threads=1,
                          progress=False)
    threads = [t for t in threading.enumerate() if t.name.startswith("mtpjax-warmup")]
    assert threads and all(t.daemon for t in threads)
    del runner
    gc.collect()
    gate.set()                                   # the program in progress finishes
    assert bw.wait(30)
    assert len(calls) < 6, "the threads kept compiling for a collected engine"


def test_background_warmup_loads_the_blocking_warmups_store(tmp_path):
    """A `warmup=True` process fills the executable store; a background start then loads every
    program from it (the covering bucket on the serving thread, the rest on the threads)
    without tracing one, and commits the same tokens."""
    from tests.engine.test_executable_store import _child
    first = _child(tmp_path, 4)
    programs = first["buckets"] * len(SAMPLING_MODES)
    assert (first["hits"], first["misses"]) == (0, programs)
    second = _child(tmp_path, 4, STORE_CHILD_WARMUP="background")
    assert (second["hits"], second["misses"], second["refused"]) == (programs, 0, 0)
    assert second["traces"] == 0, "a background start traced its step"
    assert second["buckets"] == first["buckets"]
    assert second["tokens"] == first["tokens"]


def test_fewer_draft_passes_run_on_the_covering_program_meanwhile(monkeypatch):
    """Adaptive K while background warm-up runs: only the covering bucket at K passes is
    compiled, steps asking fewer passes run on it (padded up), and the tokens are plain
    decoding's; no step compiles."""
    import mtpjax.speculative.adaptive as adaptive
    from mtpjax.speculative.adaptive import AdaptiveK
    # the config and weights of the exact-bucket test above: its plain programs serve `want`
    # (the compile count below is the runner's own, not JAX's cache)
    cfg = tiny_config(vocab_size=44, num_layers=1)
    params = random_params(cfg, seed=5)
    kw = dict(max_num_batched_tokens=16, **KW)
    prompts, _ = _workload(5, 44)
    sps = [SamplingParams(max_tokens=6)] * len(prompts)
    want = [o.token_ids for o in mtpjax.LLM(params, cfg, None, warmup=False, **kw)
            .generate(prompts, sps)]
    rng = np.random.default_rng(5)

    def random_passes(self, policy, seq_ids, k_max, *a, **k):
        p = int(rng.integers(0, 3))
        return np.minimum(np.asarray(k_max, np.int64), p), p
    monkeypatch.setattr(adaptive.AcceptanceTable, "choose_step", random_passes)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), warmup=False,
                     adaptive_k=AdaptiveK(), **kw)
    cover = covering_bucket(step_buckets(16, 2, llm.runner.W))
    llm.runner.warm_passes = (2,)
    llm.runner.warmup([cover])
    llm.runner.warming = type("Warming", (), {"done": lambda self: False})()
    asked = []
    dispatch = llm.runner.dispatch
    llm.runner.dispatch = lambda out, ks=None, passes=None: asked.append(passes) or \
        dispatch(out, ks, passes)
    assert [o.token_ids for o in llm.generate(prompts, sps)] == want
    assert llm.runner.num_compiles == 0 and any(p < 2 for p in asked), asked
