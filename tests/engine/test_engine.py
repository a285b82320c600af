"""LLM engine: greedy output == mtpjax.generate without speculation, on random workloads."""

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.engine.scheduler import SchedulerOutput
from tests.conftest import tiny_config

V = 32


def _model(D, seed=1):
    cfg = tiny_config(vocab_size=V, num_mtp_layers=D)
    return cfg, mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)


def _workload(seed, n=7):
    """Prompts of different lengths, several sharing a prefix longer than a block."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, V, size=11).tolist()
    prompts = []
    for i in range(n):
        tail = rng.integers(0, V, size=int(rng.integers(1, 9))).tolist()
        prompts.append(shared + tail if i % 2 else tail + shared[: int(rng.integers(0, 5))])
    max_tokens = rng.integers(3, 14, size=n).tolist()
    return prompts, max_tokens


def _reference(params, cfg, prompts, max_tokens):
    out = mtpjax.generate(params, cfg, prompts, max_new_tokens=max(max_tokens))
    return [t[:m] for t, m in zip(out.tokens, max_tokens)]


@pytest.mark.parametrize("method,K,D,prefix,pages", [
    ("chain", 1, 1, True, 80),
    ("chain", 2, 2, True, 13),          # small cache: forces preemption
    ("multi_layer", 3, 3, False, 13),   # small cache: forces preemption
])   # (multi_layer D = 2 with prefix hits and preemption: tests/model/test_deepseek.py, on MLA)
def test_llm_greedy_equals_generate(method, K, D, prefix, pages):
    cfg, params = _model(D)
    prompts, max_tokens = _workload(K + 7 * D)
    want = _reference(params, cfg, prompts, max_tokens)
    # min_token_bucket=32: every step runs the one T = 32 program (fewer compiles)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=K, method=method),
                     num_pages=pages, page_size=4, max_num_seqs=3, max_num_batched_tokens=24,
                     min_token_bucket=32, enable_prefix_caching=prefix)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    for o in outs:
        assert o.num_draft_tokens == K * o.num_verify_steps
        assert 0 <= o.num_accepted_draft_tokens <= o.num_draft_tokens
    bm = llm.block_manager
    assert llm.scheduler.is_finished() and bm.num_used_blocks == 0   # nothing leaked
    bm.check_invariants([])
    if pages < 40:
        assert llm.num_preemptions > 0                                # the small cache preempted


def test_llm_without_spec_and_prefix_hits():
    cfg, params = _model(1)
    prompts, max_tokens = _workload(3, n=6)
    want = _reference(params, cfg, prompts, max_tokens)
    llm = mtpjax.LLM(params, cfg, None, num_pages=60, page_size=4, max_num_seqs=4,
                     max_num_batched_tokens=16)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert [o.token_ids for o in outs] == want
    again = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    assert [o.token_ids for o in again] == want
    assert llm.block_manager.num_cached_blocks > 0


def test_a_step_mixes_prefill_chunks_and_speculative_decodes():
    cfg, params = _model(1)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    want = _reference(params, cfg, prompts, [8, 8])
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=40,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    seen_mixed = False
    schedule = llm.scheduler.schedule

    def spy() -> SchedulerOutput:
        nonlocal seen_mixed
        out = schedule()
        if out.decodes and any(r.is_prefill for r in out.requests):
            seen_mixed = True
        return out

    llm.scheduler.schedule = spy
    outs = llm.generate(prompts, SamplingParams(max_tokens=8))
    assert seen_mixed
    assert [o.token_ids for o in outs] == want


def test_streaming_matches_generate():
    cfg, params = _model(1)
    prompts, max_tokens = _workload(5, n=4)
    want = _reference(params, cfg, prompts, max_tokens)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=60,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    got = [[] for _ in prompts]
    finished = set()
    for ev in llm.generate_stream(prompts, [SamplingParams(max_tokens=m) for m in max_tokens]):
        got[ev.request_index] += ev.new_token_ids
        if ev.finished:
            finished.add(ev.request_index)
            assert ev.output.token_ids == got[ev.request_index]
    assert got == want and finished == set(range(len(prompts)))


def test_bad_inputs_leave_the_engine_serving():
    cfg, params = _model(1)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=12,
                     page_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[1, 2], []])
    with pytest.raises(ValueError, match="token id 32 outside"):
        llm.generate([[1, 32]])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="can never be served"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="top_p"):
        llm.generate([[1]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="method 'beam'"):
        SpecConfig(method="beam")
    assert llm.scheduler.is_finished()              # nothing half-queued
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=5))
    assert [o.token_ids for o in out] == _reference(params, cfg, [[1, 2, 3], [4, 5]], [5, 5])


def test_async_scheduling_equals_sync_with_stops_sampling_and_prefix_hits(method="chain", K=2,
                                                                          D=1, pages=14):
    """Async scheduling (step t+1 dispatched before step t is read) changes nothing: same tokens
    and finish reasons as the synchronous engine for greedy and sampled requests with stop
    tokens (which void in-flight rows), shared prefixes and, with the small cache, preemption;
    greedy rows also match generate() cut at the first stop."""
    cfg, params = _model(D)
    prompts, max_tokens = _workload(11 + K, n=8)
    want = _reference(params, cfg, prompts, max_tokens)
    stops = (want[1][2], want[3][1])        # tokens that greedy rows do produce mid-run
    sps = [SamplingParams(max_tokens=m, stop_token_ids=stops,
                          temperature=0.0 if i % 2 else 1.0, top_k=0 if i % 4 else 8)
           for i, m in enumerate(max_tokens)]
    outs = {}
    for mode in (False, True):
        llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=K, method=method),
                         num_pages=pages, page_size=4, max_num_seqs=3, max_num_batched_tokens=24,
                         min_token_bucket=32, async_scheduling=mode)     # one T: few compiles
        outs[mode] = llm.generate(prompts, sps)
        assert llm.block_manager.num_used_blocks == 0 and not llm.scheduler._inflight
        if pages < 40:
            assert llm.num_preemptions > 0
    assert [(o.token_ids, o.finish_reason) for o in outs[True]] == \
        [(o.token_ids, o.finish_reason) for o in outs[False]]
    n_stopped = 0
    for sp, o, w in zip(sps, outs[True], want):
        if sp.temperature == 0:
            cut = next((i + 1 for i, t in enumerate(w) if t in stops), len(w))
            assert o.token_ids == w[:cut]
            n_stopped += o.finish_reason == "stop"
    assert n_stopped > 0


@pytest.mark.parametrize("seed", range(3))
def test_packed_batch_round_trips_through_one_int32_array(seed):
    """The runner's one host->device array: every field comes back bit for bit (floats and PRNG
    keys are bit-cast, so negative floats and keys with the high bit set must survive)."""
    from mtpjax.engine.runner import pack_host, unpack_device
    from mtpjax.sampling import SamplingArrays
    from mtpjax.speculative.mixed_step import MixedBatch
    rng = np.random.default_rng(seed)
    T, R, M, K = 16, 5, 7, 3
    i32 = lambda *shape: rng.integers(-2**31, 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32)
    batch = MixedBatch(
        tokens=i32(T), positions=i32(T), seq_ids=i32(T),
        cu_q_lens=np.concatenate([[0], i32(R)]).astype(np.int32), kv_lens=i32(R),
        block_tables=i32(R, M), slots=i32(R), kinds=i32(R), next_tokens=i32(R, K + 1),
        thinking=rng.random(R) < 0.5, hist_from=i32(R), num_drafts=i32(R),
        want_logprobs=rng.random(R) < 0.5,
        sampling=SamplingArrays(temperature=rng.normal(size=R).astype(np.float32), top_k=i32(R),
                                top_p=np.float32([np.inf, -0.0, 1e-30, -3.5, 0.7]),
                                keys=rng.integers(0, 2**32, size=(R, 2), dtype=np.uint64)
                                .astype(np.uint32)))
    flat = pack_host(batch)
    assert flat.dtype == np.int32 and flat.ndim == 1
    got = jax.jit(lambda f: unpack_device(f, num_tokens=T, num_rows=R, max_blocks=M))(flat)
    sent = jax.tree_util.tree_flatten_with_path(batch)[0]        # [(path, leaf)]
    for (name, want), have in zip(sent, jax.tree.leaves(got), strict=True):
        have = np.asarray(have)
        assert have.dtype == np.asarray(want).dtype, name
        np.testing.assert_array_equal(have.view(np.uint8), np.asarray(want).view(np.uint8),
                                      err_msg=str(name))
