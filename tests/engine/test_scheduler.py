"""Scheduler: mixed verify-decode + chunked-prefill steps, budgets, FCFS, preemption by
recomputation, refusal at add(), and exact truncation of accepted runs in postprocess."""

import random
from types import SimpleNamespace

import pytest

from mtpjax.engine import BlockManager, Scheduler, Sequence, SequenceStatus

VOCAB = 50


def params(max_tokens=None, stop=()):
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=stop)


def next_token(prefix):
    """A deterministic stand-in for the target's greedy choice."""
    return (sum(prefix[-3:]) * 7 + len(prefix)) % VOCAB


def reference(prompt, max_tokens, stop=()):
    out = list(prompt)
    while True:
        t = next_token(out)
        out.append(t)
        if t in stop or len(out) - len(prompt) == max_tokens:
            return out[len(prompt):]


def fake_step(sched, out, rng, check=True):
    """Play the device: check what the runner would pack, then commit greedy tokens; a decode
    accepts a random 0..K drafts (+ the bonus token)."""
    bm, K = sched.block_manager, sched.num_speculative_tokens
    committed = []
    if check:
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out) <= sched.max_num_seqs
        assert len({r.seq_id for r in out}) == len(out)
    for r in out:
        seq = r.seq
        if check:
            assert seq.status is SequenceStatus.RUNNING
            assert r.start_position == seq.num_computed_tokens
            # Every slot the step writes (its query tokens + lookahead) has a block.
            assert len(r.block_table) * bm.block_size >= r.context_len + sched.num_lookahead_tokens
            if r.is_prefill:
                assert r.token_ids == tuple(seq.token_ids[r.start_position:r.context_len])
                assert r.is_last_chunk == (r.context_len == seq.num_tokens)
            else:
                assert r.num_query_tokens == K + 1 and r.start_position == seq.num_tokens - 1
                assert r.token_ids == (seq.token_ids[-1],)
        if r.is_prefill:
            committed.append([next_token(seq.token_ids)] if r.is_last_chunk else [])
        else:
            toks = list(seq.token_ids)
            for _ in range(rng.randint(1, K + 1)):
                toks.append(next_token(toks))
            committed.append(toks[seq.num_tokens:])
    return sched.postprocess(out, committed)


def run_to_completion(sched, rng, max_steps=10_000):
    steps, log = 0, []
    while not sched.is_finished():
        out = sched.schedule()
        assert not out.is_empty, "scheduler stalled"
        log.append(out)
        fake_step(sched, out, rng)
        sched.block_manager.check_invariants(sched.running)
        steps += 1
        assert steps < max_steps
    return log


# ---------------------------------------------------------------------------------------------
def test_mixed_step_decodes_next_to_prefill_chunks_within_budgets():
    K = 3
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=12, num_speculative_tokens=K)
    short = [Sequence([1, 2, 3], sampling_params=params(20)) for _ in range(2)]
    long = Sequence(list(range(40)), sampling_params=params(5))
    for s in short + [long]:
        sched.add(s)
    rng = random.Random(0)
    out = sched.schedule()         # step 0: both short prompts + first chunk of the long one
    assert [(r.seq, r.num_query_tokens, r.is_last_chunk) for r in out] == \
        [(short[0], 3, True), (short[1], 3, True), (long, 6, False)]
    fake_step(sched, out, rng)
    out = sched.schedule()         # step 1: two decodes of K + 1 = 4 and a 4-token chunk
    assert [(r.is_prefill, r.num_query_tokens) for r in out] == [(False, 4), (False, 4), (True, 4)]
    assert out.prefills[0].start_position == 6
    assert out.num_batched_tokens == 12
    fake_step(sched, out, rng)
    mixed = 0
    for out in run_to_completion(sched, rng):
        mixed += bool(out.decodes and out.prefills)
    assert mixed >= 2
    for s in short:
        assert s.completion_token_ids == reference([1, 2, 3], 20)
    assert long.completion_token_ids == reference(list(range(40)), 5)


def test_without_chunked_prefill_a_prompt_is_scheduled_whole():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, num_speculative_tokens=1,
                      chunked_prefill=False)
    a, b = Sequence(list(range(10)), sampling_params=params(3)), Sequence(list(range(10)), sampling_params=params(3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(r.seq, r.num_query_tokens) for r in out] == [(a, 10)]   # b would not fit: waits
    with pytest.raises(ValueError, match="chunked prefill"):
        sched.add(Sequence(list(range(15)), sampling_params=params(3)))   # recompute of 17 > 16


def test_fcfs_admission_does_not_skip_a_request_that_does_not_fit():
    bm = BlockManager(8, 4)   # 32 slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, num_speculative_tokens=1)
    first = Sequence(list(range(20)), sampling_params=params(2))        # 5 blocks
    big = Sequence(list(range(100, 120)), sampling_params=params(2))    # 5 blocks: not both
    small = Sequence([7], sampling_params=params(2))                    # would fit, must wait
    for s in (first, big, small):
        sched.add(s)
    out = sched.schedule()
    assert [r.seq for r in out] == [first]
    assert list(sched.waiting) == [big, small]
    fake_step(sched, out, random.Random(1))    # every scheduled step is postprocessed once
    run_to_completion(sched, random.Random(1))
    assert all(s.is_finished for s in (first, big, small))


def test_decode_reserves_k_plus_one_plus_lookahead_across_boundaries():
    K, L, bs = 4, 3, 4
    bm = BlockManager(32, bs)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64, num_speculative_tokens=K,
                      num_lookahead_tokens=L)
    seq = Sequence(list(range(8)), sampling_params=params(50))
    sched.add(seq)
    out = sched.schedule()
    assert len(seq.block_table) == -(-(8 + L) // bs) == 3
    sched.postprocess(out, [[5]])                 # T = 9, seq_len = 8
    out = sched.schedule()
    assert len(seq.block_table) == -(-(9 + K + 1 + L) // bs) == 5   # crosses 2 boundaries
    assert out.requests[0].start_position == 8 and out.requests[0].context_len == 13
    sched.postprocess(out, [[1, 2]])              # 1 draft accepted + bonus
    assert seq.num_computed_tokens == 10 and seq.num_tokens == 11
    assert bm.num_cached_blocks == 2              # block 1 filled during decode: registered


def test_preemption_is_newest_first_and_keeps_generated_tokens():
    K, bs = 1, 4
    bm = BlockManager(6, bs)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=64, num_speculative_tokens=K)
    seqs = [Sequence([10 * i + j for j in range(4)], sampling_params=params(12)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    rng = random.Random(0)
    out = sched.schedule()                        # three prompts of one block each
    fake_step(sched, out, rng)                    # T = 5 each: a decode needs ceil(7/4) = 2 blocks
    out = sched.schedule()                        # 3 x 2 = 6 blocks: fits exactly
    assert out.preempted == [] and len(out.decodes) == 3
    fake_step(sched, out, rng)
    while not out.preempted:
        out = sched.schedule()
        if out.preempted:
            break
        fake_step(sched, out, rng)
    victim = out.preempted[0]
    assert victim is seqs[2]                      # the newest running request
    assert sched.waiting[0] is victim and victim.status is SequenceStatus.WAITING
    assert victim.block_table == [] and victim.num_computed_tokens == 0
    assert victim.num_completion_tokens > 0       # kept, to be recomputed as part of the prompt
    assert victim.num_prefill_tokens == victim.num_tokens - 1   # resumes at its last token
    assert victim not in [r.seq for r in out]
    fake_step(sched, out, rng)
    run_to_completion(sched, rng)
    for s in seqs:
        assert s.completion_token_ids == reference(s.prompt_token_ids, 12)


def tiny_cache_workload(rng, K, lookahead, chunked, async_scheduling=False):
    """A random small cache (maybe prefix caching) and up to 10 requests with random stops,
    some sharing a prefix; requests refused at add() are left out."""
    bs = rng.choice([1, 2, 4])
    bm = BlockManager(rng.randint(12, 20) * 4 // bs, bs, enable_prefix_caching=rng.random() < 0.7)
    sched = Scheduler(bm, max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.randint(K + 1, 24) + 8,
                      num_speculative_tokens=K, num_lookahead_tokens=lookahead, chunked_prefill=chunked,
                      eos_token_id=0, async_scheduling=async_scheduling)
    shared = [rng.randrange(1, VOCAB) for _ in range(6)]
    seqs = []
    for _ in range(10):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))]
        s = Sequence(prompt, sampling_params=params(rng.randint(1, 12), stop=(rng.randrange(VOCAB),)))
        try:
            sched.add(s)
        except ValueError:
            continue
        seqs.append(s)
    assert seqs
    return bm, sched, seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("K, lookahead, chunked", [(0, 0, True), (2, 1, True), (3, 2, False)])
def test_tiny_cache_all_requests_finish_with_all_tokens(seed, K, lookahead, chunked):
    rng = random.Random(seed)
    bm, sched, seqs = tiny_cache_workload(rng, K, lookahead, chunked)
    log = run_to_completion(sched, rng)
    for s in seqs:
        assert s.is_finished
        assert s.completion_token_ids == reference(s.prompt_token_ids, s.max_tokens,
                                                   tuple(s.stop_token_ids) + (0,))
        assert s.finish_reason == ("length" if s.num_completion_tokens == s.max_tokens
                                   and s.completion_token_ids[-1] not in s.stop_token_ids | {0}
                                   else "stop")
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert sum(len(o.preempted) for o in log) == sum(s.num_preemptions for s in seqs)


def test_some_tiny_cache_runs_do_preempt():
    """Guard for the test above: the setting must actually exercise preemption."""
    bm = BlockManager(10, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2)
    seqs = [Sequence([i + 1] * 3, sampling_params=params(9)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched, random.Random(3))
    assert sum(s.num_preemptions for s in seqs) > 0
    for s in seqs:
        assert s.completion_token_ids == reference(s.prompt_token_ids, 9)


def test_oversize_request_is_refused_at_add():
    K = 2
    bm = BlockManager(4, 4)                       # 16 slots
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, num_speculative_tokens=K)
    # last decode at T = P + M - 1 reserves ceil((P + M + K) / 4) blocks
    ok = Sequence(list(range(10)), sampling_params=params(4))           # 10 + 4 + 2 = 16
    sched.add(ok)
    too_big = Sequence(list(range(10)), sampling_params=params(5))      # 17 slots
    with pytest.raises(ValueError, match=r"max_tokens=5.*needs 5 blocks.*has 4"):
        sched.add(too_big)
    assert list(sched.waiting) == [ok]
    huge_prompt = Sequence(list(range(20)), sampling_params=params(None))
    with pytest.raises(ValueError, match="can never be served"):
        sched.add(huge_prompt)
    unbounded = Sequence(list(range(3)), sampling_params=params(None))
    sched.add(unbounded)
    assert unbounded.max_tokens == 16 - 3 - K
    capped = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=16, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len=20"):
        capped.add(Sequence(list(range(10)), sampling_params=params(11)))


def test_constructor_rejects_bad_limits():
    bm = BlockManager(4, 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens=3"):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=3, num_speculative_tokens=3)
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        Scheduler(bm, max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=8, num_speculative_tokens=-1)


def _decoding(K=3, max_tokens=10, stop=(), prompt=(1, 2, 3)):
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32, num_speculative_tokens=K)
    seq = Sequence(list(prompt), sampling_params=params(max_tokens, stop))
    sched.add(seq)
    sched.postprocess(sched.schedule(), [[4]])
    return bm, sched, seq


def test_stop_token_truncates_inside_an_accepted_run():
    bm, sched, seq = _decoding(stop=(9,))
    out = sched.schedule()
    finished = sched.postprocess(out, [[5, 9, 6, 7]])   # stop at the 2nd of 4 committed tokens
    assert finished == [seq] and seq.finish_reason == "stop"
    assert seq.completion_token_ids == [4, 5, 9]
    assert seq.status is SequenceStatus.FINISHED and seq.block_table == []
    assert bm.num_used_blocks == 0 and sched.is_finished()


def test_max_tokens_truncates_inside_an_accepted_run():
    _, sched, seq = _decoding(max_tokens=3)
    finished = sched.postprocess(sched.schedule(), [[5, 6, 7, 8]])
    assert finished == [seq] and seq.finish_reason == "length"
    assert seq.completion_token_ids == [4, 5, 6]


def test_last_prefill_token_can_finish_a_request():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32, num_speculative_tokens=2)
    seq = Sequence([1, 2, 3, 4, 5], sampling_params=params(1))
    sched.add(seq)
    assert sched.postprocess(sched.schedule(), [[8]]) == [seq]
    assert seq.completion_token_ids == [8]
    assert bm.num_cached_blocks == 1      # the committed full block stays in the prefix cache
    again = Sequence([1, 2, 3, 4, 5], sampling_params=params(1))
    sched.add(again)
    out = sched.schedule()
    assert again.num_cached_tokens == 4 and out.requests[0].start_position == 4
    assert out.requests[0].num_query_tokens == 1


def test_postprocess_rejects_wrong_counts_and_changes_nothing():
    K = 2
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, num_speculative_tokens=K)
    a = Sequence([1, 2, 3], sampling_params=params(10))
    b = Sequence(list(range(20)), sampling_params=params(10))
    sched.add(a)
    sched.add(b)
    sched.postprocess(sched.schedule(), [[4], []])   # a done, b's first chunk (5 tokens)
    out = sched.schedule()                           # a decode (3) + b chunk (5)
    state = [(s.num_tokens, s.num_computed_tokens, list(s.block_table)) for s in (a, b)]
    for bad, what in [([[4, 5, 6, 7], []], "committed 4 tokens"),   # > K + 1
                      ([[], []], "committed 0 tokens"),             # a decode commits >= 1
                      ([[4], [9]], "committed 1 tokens"),           # a non-final chunk commits 0
                      ([[4]], "for 1 requests")]:
        with pytest.raises(ValueError, match=what):
            sched.postprocess(out, bad)
        assert [(s.num_tokens, s.num_computed_tokens, list(s.block_table)) for s in (a, b)] == state
    sched.postprocess(out, [[4, 5], []])
    with pytest.raises(ValueError, match="not in the state"):
        sched.postprocess(out, [[4, 5], []])        # the same step twice


def test_abort_frees_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=32, num_speculative_tokens=1)
    a, b = Sequence([1] * 6, sampling_params=params(4)), Sequence([2] * 6, sampling_params=params(4))
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.abort(a)
    sched.abort(b)
    assert a.finish_reason == b.finish_reason == "abort"
    assert sched.is_finished() and bm.num_used_blocks == 0
    with pytest.raises(ValueError, match="neither waiting nor running"):
        sched.abort(a)


def test_docs_worked_example():
    """docs/engine.md, 'Worked example at a block boundary' (B = 4, K = 3, L = 0)."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=16, num_speculative_tokens=3)
    seq = Sequence([100, 101, 102, 103, 104, 105], sampling_params=params(20))
    sched.add(seq)
    out = sched.schedule()
    b0, b1 = seq.block_table
    assert (out.requests[0].start_position, out.requests[0].num_query_tokens) == (0, 6)
    sched.postprocess(out, [[6]])
    assert (seq.num_computed_tokens, seq.num_tokens, bm.num_cached_blocks) == (6, 7, 1)
    out = sched.schedule()
    assert seq.block_table[:2] == [b0, b1] and len(seq.block_table) == 3
    r = out.requests[0]
    assert (r.start_position, r.num_query_tokens, r.context_len) == (6, 4, 10)
    sched.postprocess(out, [[7, 8, 9]])
    assert (seq.num_computed_tokens, seq.num_tokens, bm.num_cached_blocks) == (9, 10, 2)
    out = sched.schedule()
    assert len(seq.block_table) == 4 and out.requests[0].start_position == 9


# ---- async scheduling: schedule(t+1) runs before postprocess(t) -----------------------------
def run_pipelined(sched, rng, max_steps=10_000):
    """Play the device one step behind the host, as LLM does with async scheduling. A step
    'executes' once the step before it is postprocessed (device order); its live decode rows
    start at the host's seq_len then, which must have blocks for K + 1 + L slots."""
    bm, K, L = sched.block_manager, sched.num_speculative_tokens, sched.num_lookahead_tokens
    stats = {"void_rows": 0, "steps": 0, "preempted": 0}

    def execute(out):
        committed = []
        for r in out:
            seq = r.seq
            if sched.is_void(out, r):        # finished / preempted since: anything comes back
                committed.append([rng.randrange(VOCAB)] if r.max_committed_tokens else [])
                continue
            assert seq.status is SequenceStatus.RUNNING
            if r.is_prefill:
                assert r.start_position == seq.num_computed_tokens
                assert r.token_ids == tuple(seq.token_ids[r.start_position:r.context_len])
                assert len(seq.block_table) * bm.block_size >= r.context_len + L
                committed.append([next_token(seq.token_ids)] if r.is_last_chunk else [])
            else:
                start = seq.num_computed_tokens     # what the device's slot state holds
                assert seq.num_tokens == start + 1
                assert len(seq.block_table) * bm.block_size >= start + K + 1 + L
                toks = list(seq.token_ids)
                for _ in range(rng.randint(1, K + 1)):
                    toks.append(next_token(toks))
                committed.append(toks[seq.num_tokens:])
        return committed

    inflight = None
    while True:
        out = sched.schedule()
        stats["preempted"] += len(out.preempted)
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(out) <= sched.max_num_seqs
        if inflight is not None:
            prev, committed = inflight
            stats["void_rows"] += sum(sched.is_void(prev, r) for r in prev)
            sched.postprocess(prev, committed)
            bm.check_invariants(sched.running)
        inflight = None if out.is_empty else (out, execute(out))
        if inflight is None and sched.is_finished():
            return stats
        assert inflight is not None or out.preempted or not sched.is_finished(), "stalled"
        stats["steps"] += 1
        assert stats["steps"] < max_steps


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("K, lookahead, chunked", [(0, 0, True), (2, 1, True), (3, 2, False)])
def test_async_pipelined_requests_finish_with_all_tokens(seed, K, lookahead, chunked):
    rng = random.Random(100 + seed)
    bm, sched, seqs = tiny_cache_workload(rng, K, lookahead, chunked, async_scheduling=True)
    stats = run_pipelined(sched, rng)
    for s in seqs:
        assert s.is_finished
        assert s.completion_token_ids == reference(s.prompt_token_ids, s.max_tokens,
                                                   tuple(s.stop_token_ids) + (0,))
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert not sched._inflight and not sched._dropped          # every step accounted for
    assert stats["preempted"] == sum(s.num_preemptions for s in seqs)


def test_async_runs_void_wasted_rows_and_preempt_in_flight_requests():
    """Guard for the test above: stops void in-flight rows, and small caches preempt requests
    that have a step in flight."""
    voids = preempted = 0
    for seed in range(8):
        rng = random.Random(seed)
        bm = BlockManager(10, 2)
        sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2,
                          eos_token_id=0, async_scheduling=True)
        seqs = [Sequence([i + 1 + seed] * 3, sampling_params=params(6, stop=(3, 7)))
                for i in range(4)]
        for s in seqs:
            sched.add(s)
        stats = run_pipelined(sched, rng)
        voids += stats["void_rows"]
        preempted += stats["preempted"]
        for s in seqs:
            assert s.completion_token_ids == reference(s.prompt_token_ids, 6, (3, 7, 0))
    assert voids > 0 and preempted > 0


@pytest.mark.parametrize("K", [0, 1, 3])
def test_async_limit_is_exact_for_a_request_alone(K):
    """With one step in flight the last decode reserves P + M + 2K slots: a request at the
    refusal limit runs alone to the end without preempting itself, one more token is refused."""
    bm = BlockManager(6, 4)                                  # 24 slots
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=16, num_speculative_tokens=K,
                      async_scheduling=True)
    limit = 24 - 5 - 2 * K
    assert sched.max_completion_tokens(5) == limit
    with pytest.raises(ValueError, match="x2 \\(async\\)"):
        sched.add(Sequence(list(range(5)), sampling_params=params(limit + 1)))
    seq = Sequence(list(range(1, 6)), sampling_params=params(limit))
    sched.add(seq)
    for seed in range(5):                                    # any acceptance pattern
        s = Sequence(list(range(1, 6)), sampling_params=params(limit))
        sched = Scheduler(BlockManager(6, 4), max_num_seqs=2, max_num_batched_tokens=16,
                          num_speculative_tokens=K, async_scheduling=True)
        sched.add(s)
        stats = run_pipelined(sched, random.Random(seed))
        assert stats["preempted"] == 0 and s.num_completion_tokens == limit
