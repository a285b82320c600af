"""The engine survives what a caller can do: bad inputs, interrupts at any point of a step,
abort in every state, streams that stop early or interleave, several threads, a full queue.

One tiny float32 model and one engine shape for every test (the jitted step compiles once per
bucket); references are a fresh engine's greedy outputs. Numbers in test names refer to the
engine-reliability issue (/work/shared/repro/engine)."""

import gc
import threading

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams as SP
from mtpjax import SpecConfig
from mtpjax.engine import runner as runner_mod
from tests.conftest import random_params, tiny_config

V = 64
CFG = tiny_config(vocab_size=V, num_mtp_layers=2)
PARAMS = random_params(CFG, seed=0)
SPEC = SpecConfig(num_speculative_tokens=2)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 9], [20, 21, 22, 23, 24]]
MAX_TOKENS = [6, 5, 7, 4]


def make_llm(**kw):
    # min_token_bucket = the token budget: every step of every test runs one T = 16 program
    base = dict(num_pages=24, page_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                min_token_bucket=16, max_model_len=64)
    return mtpjax.LLM(PARAMS, CFG, kw.pop("spec", SPEC), **{**base, **kw})


_REF = {}


def reference(prompts, max_tokens):
    """A fresh engine's greedy tokens (cached)."""
    key = (tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _REF:
        outs = make_llm().generate(prompts, [SP(max_tokens=m) for m in max_tokens])
        _REF[key] = [o.token_ids for o in outs]
    return _REF[key]


def sps(max_tokens):
    return [SP(max_tokens=m) for m in max_tokens]


def assert_clean(llm):
    """Nothing held: every block free, every engine slot free, no request, allocator consistent."""
    bm = llm.block_manager
    assert llm.scheduler.is_finished() and not llm.scheduler._inflight
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0
    assert sorted(llm.runner.free_slots) == list(range(llm.runner.max_num_seqs))
    assert not llm.runner.slot_of
    assert not getattr(llm, "_requests", {})
    bm.check_invariants([])


def drain(llm, seqs, got=None, done=None, errors=(KeyboardInterrupt,), limit=500):
    """Steps until step() has reported every one of `seqs` (add_request requests) finished;
    returns the tokens step() reported per request id (each must come exactly once) and the
    finished sequences."""
    got = {} if got is None else got
    done = {} if done is None else done
    for _ in range(limit):
        if all(s.seq_id in done for s in seqs):
            return got, done
        try:
            updates = llm.step()
        except errors:
            llm.block_manager.check_invariants(llm.scheduler.running)
            continue
        for seq, new in updates:
            assert seq.seq_id not in done, "reported after its final report"
            got.setdefault(seq.seq_id, []).extend(new)
            if seq.is_finished:
                done[seq.seq_id] = seq
    raise AssertionError("requests never finished")


# ---- 1. out-of-range sampling params are refused at construction --------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(seed=2**63), r"seed=9223372036854775808"),
    (dict(seed=2**32), r"seed=4294967296"),
    (dict(seed=-1), r"seed=-1"),
    (dict(top_k=2**31), r"top_k=2147483648"),
    (dict(top_k=2**40), r"top_k=1099511627776"),
    (dict(stop_token_ids=(2**31,)), r"stop_token_ids"),
])
def test_1_sampling_params_outside_device_ranges_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SP(temperature=1.0, **kwargs)


def test_1_sampling_params_at_the_range_limits_run():
    llm = make_llm()
    out = llm.generate([[1, 2]], SP(max_tokens=3, temperature=1.0, seed=2**32 - 1,
                                    top_k=2**31 - 1))
    assert len(out[0].token_ids) == 3
    assert_clean(llm)


# ---- 2. generate validates every prompt before queueing any -------------------------------------

def test_2_a_bad_prompt_queues_nothing_and_changes_no_later_output():
    llm = make_llm()
    sampled = [SP(max_tokens=4, temperature=1.0)]
    with pytest.raises(ValueError, match="can never be served"):
        llm.generate([[1, 2], [1] * 300], SP(max_tokens=2))
    with pytest.raises(ValueError, match="token id 64 outside"):
        llm.generate([[1, 2], [3, 64]])
    assert_clean(llm)
    # no request id was used up: unseeded sampling (keyed by request id) matches a fresh engine
    assert llm.generate([[5, 6]], sampled)[0].token_ids == \
        make_llm().generate([[5, 6]], sampled)[0].token_ids


# ---- 3 + interrupts: an exception at any point of a step leaves a working engine ----------------

POINTS = [  # (object, method, raise before or after calling it)
    ("scheduler", "schedule", "before"), ("scheduler", "schedule", "after"),
    ("scheduler", "postprocess", "before"), ("scheduler", "postprocess", "after"),
    ("scheduler", "_is_stop", "after"),        # a token appended, its stop check not done
    ("runner", "dispatch", "before"), ("runner", "dispatch", "after"),
    ("runner", "collect", "before"), ("runner", "release", "before"),
    ("block_manager", "allocate", "after"),    # blocks taken, request not yet admitted
    ("block_manager", "may_append", "before"), ("block_manager", "commit", "before"),
    ("module", "_step", "after"),              # donated state lost with the step's result
]


def _install(monkeypatch, llm, point, n, exc=KeyboardInterrupt):
    obj_name, meth, when = point
    obj = runner_mod if obj_name == "module" else getattr(llm, obj_name)
    orig = getattr(obj, meth)
    calls = [0]

    def hook(*a, **k):
        calls[0] += 1
        if calls[0] == n and when == "before":
            raise exc("injected")
        r = orig(*a, **k)
        if calls[0] == n:
            raise exc("injected")
        return r
    monkeypatch.setattr(obj, meth, hook)
    return calls


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_3_interrupt_at_each_point_of_a_generate_leaves_a_working_engine(monkeypatch,
                                                                          async_scheduling):
    """KeyboardInterrupt from inside step() during generate(): generate raises, its requests
    are aborted (the stream is closed), everything is freed; the next generate equals a fresh
    engine's output. (Before the fix: 'not in the state this step was scheduled from' /
    'Buffer has been deleted or donated' on every later call.)"""
    want = reference(PROMPTS, MAX_TOKENS)
    fired = 0
    for point in POINTS:
        for n in (1, 4):
            llm = make_llm(async_scheduling=async_scheduling)
            llm.generate([[30, 31, 32, 33, 34, 35, 36, 37, 38]], SP(max_tokens=4))   # prefix cache
            with monkeypatch.context() as m:
                calls = _install(m, llm, point, n)
                try:
                    llm.generate(PROMPTS, sps(MAX_TOKENS))
                except KeyboardInterrupt:
                    fired += 1
                else:
                    assert calls[0] < n, (point, n)        # no interrupt: the hook never fired
            assert_clean(llm)
            outs = llm.generate(PROMPTS, sps(MAX_TOKENS))
            assert [o.token_ids for o in outs] == want, (point, n)
            assert_clean(llm)
    assert fired >= len(POINTS)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_3_interrupted_steps_of_add_request_users_are_recomputed(monkeypatch, async_scheduling):
    """add_request/step users keep their requests across an interrupted step: the requests of
    the lost steps are preempted and recomputed, every committed token is reported exactly
    once, and the final tokens equal a fresh engine's. RuntimeError behaves the same."""
    want = reference(PROMPTS, MAX_TOKENS)
    for point in POINTS:
        for n, exc in ((2, KeyboardInterrupt), (5, RuntimeError)):
            llm = make_llm(async_scheduling=async_scheduling)
            seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, sps(MAX_TOKENS))]
            with monkeypatch.context() as m:
                _install(m, llm, point, n, exc)
                got, done = drain(llm, seqs, errors=(KeyboardInterrupt, RuntimeError))
            assert [got[s.seq_id] for s in seqs] == want, (point, n)
            assert [llm.get_output(s).token_ids for s in seqs] == want
            assert all(s.finish_reason == "length" for s in seqs)
            llm.flush()
            assert_clean(llm)


def test_3_a_recovery_that_is_itself_interrupted_completes_at_the_next_call(monkeypatch):
    llm = make_llm()
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, sps(MAX_TOKENS))]
    got = {}
    for _ in range(2):
        for seq, new in llm.step():
            got.setdefault(seq.seq_id, []).extend(new)
    with monkeypatch.context() as m:
        _install(m, llm, ("runner", "collect", "before"), 1)
        _install(m, llm, ("block_manager", "reset", "before"), 1)
        with pytest.raises(KeyboardInterrupt):
            llm.step()
    assert llm._loop.needs_recovery
    got, done = drain(llm, seqs, got=got)
    assert [got[i] for i in sorted(got)] == reference(PROMPTS, MAX_TOKENS)
    assert_clean(llm)


# ---- 4. interleaved streams ---------------------------------------------------------------------

def test_4_streams_consumed_alternately_each_get_their_own_events(monkeypatch):
    llm = make_llm()
    a, b = PROMPTS[:2], PROMPTS[2:]
    ga, gb = llm.generate_stream(a, sps(MAX_TOKENS[:2])), llm.generate_stream(b, sps(MAX_TOKENS[2:]))
    schedule, calls = llm.scheduler.schedule, [0]

    def bounded():                       # before the fix the streams spun forever
        calls[0] += 1
        assert calls[0] < 300, "streams hang"
        return schedule()
    monkeypatch.setattr(llm.scheduler, "schedule", bounded)
    got = {"a": [[], []], "b": [[], []]}
    outs = {"a": [None] * 2, "b": [None] * 2}
    live = {"a": ga, "b": gb}
    while live:
        for k in list(live):
            ev = next(live[k], None)
            if ev is None:
                del live[k]
                continue
            got[k][ev.request_index] += ev.new_token_ids
            if ev.finished:
                outs[k][ev.request_index] = ev.output
    want = reference(PROMPTS, MAX_TOKENS)
    assert got["a"] + got["b"] == want
    assert [o.token_ids for o in outs["a"] + outs["b"]] == want
    assert_clean(llm)


# ---- 5. threads ---------------------------------------------------------------------------------

def test_5_threads_calling_generate_share_the_engine():
    llm = make_llm()
    want = reference(PROMPTS, MAX_TOKENS)
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(2):
                outs = llm.generate(PROMPTS[2 * i:2 * i + 2], sps(MAX_TOKENS[2 * i:2 * i + 2]))
                results.setdefault(i, []).append([o.token_ids for o in outs])
        except Exception as e:   # noqa: BLE001
            errors.append(repr(e))
    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(2):
        assert results[i] == [want[2 * i:2 * i + 2]] * 2
    assert_clean(llm)


def test_5_reentrant_call_is_a_clear_error(monkeypatch):
    llm = make_llm()
    schedule = llm.scheduler.schedule

    def reenter():
        llm.add_request([1, 2], SP(max_tokens=2))
        return schedule()
    monkeypatch.setattr(llm.scheduler, "schedule", reenter)
    with pytest.raises(RuntimeError, match="not re-entrant"):
        llm.generate([[1]], SP(max_tokens=2))
    monkeypatch.undo()
    assert_clean(llm)
    assert llm.generate(PROMPTS, sps(MAX_TOKENS))[0].token_ids == reference(PROMPTS, MAX_TOKENS)[0]


# ---- 6. abort -----------------------------------------------------------------------------------

def _drive_to(llm, seq, state, got):
    reached = {
        "waiting": lambda: True,
        "prefilling": lambda: 0 < seq.num_computed_tokens < seq.num_prefill_tokens,
        "decoding": lambda: seq.num_completion_tokens > 0 and seq.status.name == "RUNNING",
        "in_flight": lambda: bool(llm.scheduler._inflight.get(seq.seq_id)),
        "preempted": lambda: seq.num_preemptions > 0 and seq.status.name == "WAITING",
    }[state]
    for _ in range(100):
        if reached():
            return
        for s, new in llm.step():
            got.setdefault(s.seq_id, []).extend(new)
    raise AssertionError(f"never reached {state}: {seq!r}")


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "in_flight", "preempted"])
def test_6_abort_in_every_state_frees_blocks_and_slot_at_once(state, async_scheduling):
    if state == "in_flight" and not async_scheduling:
        pytest.skip("only async scheduling leaves a step in flight between calls")
    # "preempted": the others grow until the victim, the newest, is preempted
    llm = make_llm(async_scheduling=async_scheduling)
    prompts, max_tokens = ([[11] * 28, [12] * 28], [20, 20]) if state == "preempted" else \
        (PROMPTS[:2], MAX_TOKENS[:2])
    others = [llm.add_request(p, sp) for p, sp in zip(prompts, sps(max_tokens))]
    victim = llm.add_request([7] * 12, SP(max_tokens=8))
    got = {}
    _drive_to(llm, victim, state, got)
    slots_before = len(llm.runner.free_slots)
    out = llm.abort(victim.seq_id)
    assert out.finish_reason == "abort" and out.request_id == victim.seq_id
    assert victim.is_finished and not victim.block_table
    assert victim.seq_id not in llm.runner.slot_of
    assert len(llm.runner.free_slots) == slots_before + (state not in ("waiting", "preempted"))
    with pytest.raises(ValueError, match="cannot abort request"):
        llm.abort(victim.seq_id)                     # already aborted
    with pytest.raises(ValueError, match="unknown"):
        llm.abort(12345)
    got.pop(victim.seq_id, None)
    got, done = drain(llm, others, got=got)
    assert victim.seq_id not in got                  # never reported after abort
    assert [got[s.seq_id] for s in others] == reference(prompts, max_tokens)
    llm.flush()
    assert_clean(llm)
    # abort everything in one state at once: the engine returns to empty immediately
    seqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, sps(MAX_TOKENS))]
    llm.step()
    for s in seqs:
        llm.abort(s)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert sorted(llm.runner.free_slots) == list(range(llm.runner.max_num_seqs))
    assert llm.generate(PROMPTS, sps(MAX_TOKENS))[1].token_ids == reference(PROMPTS, MAX_TOKENS)[1]
    assert_clean(llm)


def test_6_scheduler_abort_behind_the_engines_back_does_not_leak_slots():
    llm = make_llm()                         # 3 slots, all taken, then leaked before the fix
    seqs = [llm.add_request(p, SP(max_tokens=20)) for p in ([1, 2, 3], [4, 5, 6], [7, 8])]
    for _ in range(3):
        llm.step()
    for s in seqs:
        llm.scheduler.abort(s)
    out = llm.generate([[1, 2, 3]], SP(max_tokens=6))
    assert out[0].token_ids == reference(PROMPTS[:1], [6])[0]


def test_6_abort_of_a_stream_request_ends_its_stream_entry():
    llm = make_llm()
    stream = llm.generate_stream(PROMPTS, sps(MAX_TOKENS))
    ev = next(stream)
    victim = 1
    llm.abort(victim)                              # a fresh engine's ids follow prompt order
    finals = {}
    for e in [ev, *stream]:
        if e.finished:
            finals[e.request_index] = e.output
    assert finals[victim].finish_reason == "abort"
    want = reference(PROMPTS, MAX_TOKENS)
    assert all(finals[i].token_ids == want[i] for i in range(4) if i != victim)
    assert_clean(llm)


# ---- 7. a stream that stops early aborts its requests -------------------------------------------

@pytest.mark.parametrize("how", ["close", "break", "garbage", "deferred"])
def test_7_a_stream_stopped_early_frees_everything(how, monkeypatch):
    llm = make_llm()
    prompts = PROMPTS * 3                          # more than the engine runs at once
    if how == "close":
        g = llm.generate_stream(prompts, SP(max_tokens=30))
        next(g)
        g.close()
    elif how == "break":
        for _ in llm.generate_stream(prompts, SP(max_tokens=30)):
            break
    elif how == "garbage":
        g = llm.generate_stream(prompts, SP(max_tokens=30))
        next(g)
        del g
        gc.collect()
    else:   # finalized while this thread is inside an engine step: the abort waits for its end
        g = llm.generate_stream(prompts, SP(max_tokens=30))
        next(g)
        schedule = llm.scheduler.schedule

        def close_during_step():
            if g.gi_frame is not None:
                g.close()
                assert llm._deferred
            return schedule()
        monkeypatch.setattr(llm.scheduler, "schedule", close_during_step)
        llm.step()
        monkeypatch.undo()
    assert llm.scheduler.is_finished() and llm.block_manager.num_used_blocks == 0
    assert sorted(llm.runner.free_slots) == list(range(llm.runner.max_num_seqs))
    assert not llm._requests and not llm._streams
    steps = llm.num_steps
    assert llm.generate([[5]], SP(max_tokens=1))[0].token_ids == reference([[5]], [1])[0]
    assert llm.num_steps - steps <= 2              # no orphan ran meanwhile
    assert_clean(llm)


# ---- 8. add_request/step users get their outputs; nothing per request is kept -------------------

def test_8_step_users_get_outputs_and_the_engine_keeps_nothing_per_request():
    llm = make_llm()
    prompts = [[1 + i % 50, 2, 3] for i in range(40)]
    seqs = [llm.add_request(p, SP(max_tokens=3)) for p in prompts]
    got, done = drain(llm, seqs)
    want = reference(prompts, [3] * 40)
    assert [got[s.seq_id] for s in seqs] == want
    assert not llm._metrics                        # before the fix: one entry per request, forever
    outs = [llm.get_output(s) for s in seqs]
    assert [o.token_ids for o in outs] == want and all(o.finish_reason == "length" for o in outs)
    assert all(o.num_draft_tokens == 2 * o.num_verify_steps for o in outs)
    assert sum(o.num_verify_steps for o in outs) > 0
    assert not llm._requests and not llm._metrics and not llm._direct_news
    with pytest.raises(ValueError, match="not held by the engine"):
        llm.get_output(seqs[0].seq_id)
    # a snapshot while running
    s = llm.add_request([1, 2, 3], SP(max_tokens=6))
    assert llm.get_output(s.seq_id).finish_reason is None
    drain(llm, [s])
    llm.flush()
    assert_clean(llm)


def test_8_step_users_and_generate_callers_share_the_engine():
    """Tokens of add_request requests committed by steps that generate() runs come back from
    the next step() call, not lost."""
    llm = make_llm()
    direct = [llm.add_request(p, sp) for p, sp in zip(PROMPTS[:2], sps(MAX_TOKENS[:2]))]
    llm.step()
    outs = llm.generate(PROMPTS[2:], sps(MAX_TOKENS[2:]))
    got, _ = drain(llm, direct)
    want = reference(PROMPTS, MAX_TOKENS)
    assert [got[s.seq_id] for s in direct] == want[:2]
    assert [o.token_ids for o in outs] == want[2:]


# ---- 9. inputs: refused clearly, or accepted when they are numpy scalars ------------------------

@pytest.mark.parametrize("prompts, match", [
    ([[1.7, 2.2]], r"token ids must be ints, got 1.7 \(float\)"),
    ([[1, True]], r"got True \(bool\)"),
    ([["1"]], r"got '1' \(str\)"),
    ([[1, None]], r"got None"),
    ([1, 2, 3], r"pass \[\[1, 2, 3\]\], not \[1, 2, 3\]"),
    (np.array([1, 2, 3]), r"must be 2-D"),
    ([np.arange(6).reshape(2, 3)], r"1-D sequence"),
    ([np.array([1.0, 2.0])], r"1-D sequence of integer"),
    ("hello", r"single string"),
    ([[]], r"empty prompt"),
    ([[1, 64]], r"token id 64 outside"),
    ([[1, -1]], r"token id -1 outside"),
])
def test_9_bad_prompts_are_refused_by_name(prompts, match):
    llm = make_llm()
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, SP(max_tokens=1))
    if isinstance(prompts, list) and isinstance(prompts[0], list):
        with pytest.raises(ValueError, match=match):
            llm.add_request(prompts[0])
    assert_clean(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_model_len=0), r"max_model_len=0"),
    (dict(max_model_len=5000), r"max_model_len=5000"),
    (dict(eos_token_id="3"), r"eos_token_id='3'"),
    (dict(eos_token_id=64), r"eos_token_id=64"),
    (dict(num_pages=4.5), r"num_pages=4.5"),
    (dict(page_size=4.0), r"page_size=4.0"),
    (dict(max_num_seqs=True), r"max_num_seqs=True"),
    (dict(seed="abc"), r"seed='abc'"),
    (dict(seed=2**32), r"seed=4294967296"),
    (dict(max_waiting_requests=0), r"max_waiting_requests=0"),
    (dict(async_scheduling="no"), r"async_scheduling='no'"),
    (dict(tokenizer=object()), r"tokenizer must have encode"),
])
def test_9_bad_engine_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_llm(**kwargs)


def test_9_bad_request_arguments_are_refused_by_name():
    llm = make_llm()
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams, a list"):
        llm.generate([[1]], {"max_tokens": 2})
    with pytest.raises(ValueError, match=r"sampling_params\[1\] must be a SamplingParams"):
        llm.generate([[1], [2]], [SP(), "greedy"])
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence"):
        SP(stop_token_ids=5)
    with pytest.raises(ValueError, match="stop_token_ids has 64, outside the vocabulary"):
        llm.generate([[1]], SP(stop_token_ids=(64,)))
    with pytest.raises(ValueError, match="abort takes a request id"):
        llm.abort("0")
    assert_clean(llm)


@pytest.mark.parametrize("mutate, match", [
    (lambda p: p["layers"][1].update(wq=np.zeros((32, 16), np.float32)),
     r"leaf 'layers/1/wq' has shape \(32, 16\), expected \(32, 32\)"),
    (lambda p: p["mtp"][1].pop("hnorm"), r"missing leaf 'mtp/1/hnorm' \(expected shape \(32,\)\)"),
    (lambda p: p.update(extra=np.zeros(3, np.float32)), r"unexpected leaf 'extra'"),
    (lambda p: p.update(embed=np.zeros((65, 32), np.float32)),
     r"leaf 'embed' has shape \(65, 32\), expected \(64, 32\)"),
])
def test_9_params_that_do_not_match_the_config_are_refused(mutate, match):
    params = jax.tree.map(lambda x: x, PARAMS)
    mutate(params)
    with pytest.raises(ValueError, match=match):
        mtpjax.LLM(params, CFG, SPEC, num_pages=24, page_size=4)


def test_9_numpy_scalars_are_accepted_and_normalized():
    sp = SP(temperature=np.float32(0.5), top_k=np.int64(3), top_p=np.float64(0.9),
            max_tokens=np.int32(4), stop_token_ids=np.array([5, 6]), seed=np.uint32(7))
    assert (type(sp.temperature), type(sp.top_k), type(sp.max_tokens), type(sp.seed)) == \
        (float, int, int, int)
    assert sp.stop_token_ids == (5, 6) and all(type(t) is int for t in sp.stop_token_ids)
    llm = make_llm(num_pages=np.int64(24), page_size=np.int32(4), seed=np.int64(3),
                   eos_token_id=np.int64(63))
    prompts = [np.array([1, 2, 3], np.int32), [np.int64(4), np.int16(5)]]
    outs = llm.generate(prompts, SP(max_tokens=np.int64(3)))
    assert [o.prompt_token_ids for o in outs] == [[1, 2, 3], [4, 5]]
    assert_clean(llm)


def test_9_mtpjax_generate_refuses_prompts_longer_than_the_model():
    cfg = tiny_config(vocab_size=V, max_position_embeddings=16)
    with pytest.raises(ValueError, match="17 tokens, more than the model's max_position_embeddings=16"):
        mtpjax.generate(PARAMS, cfg, [[1] * 17], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"not \[1, 2, 3\]"):
        mtpjax.generate(PARAMS, cfg, [1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="1-D list of integer"):
        mtpjax.generate(PARAMS, cfg, [[1.5, 2]], max_new_tokens=2)


# ---- 10. the waiting queue is bounded ------------------------------------------------------------

def test_10_add_request_refuses_past_max_waiting_requests_and_generate_feeds_in():
    llm = make_llm(max_waiting_requests=3)
    seqs = [llm.add_request([1, 2, i]) for i in range(3)]
    with pytest.raises(mtpjax.QueueFullError, match="max_waiting_requests=3"):
        llm.add_request([1, 2, 3])
    assert len(llm.scheduler.waiting) == 3 and len(llm._requests) == 3
    for s in seqs:
        llm.abort(s)
    # generate feeds a prompt list longer than the bound in as room frees
    prompts = PROMPTS * 3
    outs = llm.generate(prompts, sps(MAX_TOKENS * 3))
    assert [o.token_ids for o in outs] == reference(PROMPTS, MAX_TOKENS) * 3
    assert_clean(llm)
    assert make_llm().max_waiting_requests == 1024
