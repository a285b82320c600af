"""A step runs as many draft passes as the largest k the next step asks (chain drafting):
fewer passes draw a prefix of the same drafts, a row never verifies a draft that was not
drawn, and the tokens stay those of plain decoding whatever the passes."""

import jax
import numpy as np
import pytest

import mtpjax
import mtpjax.speculative.adaptive as adaptive
from mtpjax import SamplingParams, SpecConfig
from mtpjax.speculative.adaptive import AdaptiveK
from tests.conftest import tiny_config, tiny_mla_moe_config


def _prompts(cfg, seed, n=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, cfg.vocab_size, size=4 + 3 * i).tolist() for i in range(n)]


@pytest.mark.parametrize("seed", [0, 1])
def test_random_passes_keep_plain_tokens(monkeypatch, seed):
    """The adaptive policy's pass count replaced by a random one each step (0..K): greedy
    tokens equal plain decoding, and steps really ran with fewer passes. Both seeds share one
    config (their own weights and prompts), so the second reuses the first's programs."""
    cfg = tiny_mla_moe_config(53)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.05)
    prompts, sp = _prompts(cfg, seed), SamplingParams(max_tokens=10)
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(adaptive, "_best_passes", lambda *a: int(rng.integers(0, 4)))
    # one token bucket (the 21-token prefill's) and block tables of 64 positions (not 4096):
    # the random pass counts compile one program each, and steps stay cheap
    kw = dict(num_pages=32, min_token_bucket=32, max_model_len=64)
    plain = mtpjax.LLM(params, cfg, None, **kw).generate(prompts, sp)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3),
                     adaptive_k=AdaptiveK(probe_interval=0), **kw)
    seen = []
    dispatch = llm.runner.dispatch
    llm.runner.dispatch = lambda out, ks=None, passes=None: seen.append(passes) or \
        dispatch(out, ks, passes)
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert {0, 1, 2} & set(seen) and 3 in seen, seen


def _first_drafts(llm, prompts, sp, rng=None):
    """{(request index, N): (pending token, first draft)} after every step that drafted: the
    slot's state right after the step. rng: each step verifies a random number of the drafts
    each row holds and runs a random number of passes (0..K)."""
    seen, dispatch, runner = {}, llm.runner.dispatch, llm.runner

    def spy(out, ks=None, passes=None):
        if rng is not None:
            ks = runner.verify_counts(out, rng.integers(0, runner.K + 1, len(out.requests)))
            passes = int(rng.integers(0, runner.K + 1))
        result = dispatch(out, ks, passes)
        if passes != 0:
            st = runner.state
            for req in out.requests:
                slot = runner.slot_of[req.seq_id]
                seen[(req.seq_id, int(st.seq_len[slot]))] = (int(st.pending[slot]),
                                                             int(st.drafts[slot, 0]))
        return result
    runner.dispatch = spy
    llm.generate(prompts, sp)
    first = min(k[0] for k in seen)
    return {(i - first, n): v for (i, n), v in seen.items()}


@pytest.mark.parametrize("seed", [2, 3])
def test_drafts_do_not_depend_on_the_drafts_verified_before(seed):
    """A chain MTP's first draft after a committed prefix is a function of that prefix. Steps
    that verify fewer drafts are packed as narrower rows whose MTP first pass covers fewer
    positions (the rest of the draft-input history shifted over), and steps that run fewer
    passes leave fewer drafts: at every committed length the drafts still equal those of an
    engine that always verifies and draws K."""
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(seed), std=0.3)
    prompts, sp = _prompts(cfg, seed), SamplingParams(max_tokens=16)
    spec = SpecConfig(num_speculative_tokens=3)
    # one token bucket (the 21-token prefill's): rows are still packed as narrow as the drafts
    # they verify and the first pass as short, inside one 32-token program per pass count
    kw = dict(num_pages=32, max_num_batched_tokens=32, min_token_bucket=32, max_model_len=64)
    full = _first_drafts(mtpjax.LLM(params, cfg, spec, **kw), prompts, sp)
    mixed = _first_drafts(mtpjax.LLM(params, cfg, spec, **kw), prompts, sp,
                          np.random.default_rng(seed))
    both = full.keys() & mixed.keys()
    assert len(both) >= 10, (sorted(full), sorted(mixed))
    assert {k: mixed[k] for k in both} == {k: full[k] for k in both}


def test_fewer_passes_draw_a_prefix_of_the_drafts():
    """Drafts of p passes are the first p of K passes' drafts; the rest stay 0."""
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(4), std=0.3)
    prompts = _prompts(cfg, 4, n=2)
    K = 3
    drafts = {}
    for p in range(K + 1):
        llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=K), num_pages=32,
                         max_num_batched_tokens=64)
        for t in prompts:
            llm.add_request(t, SamplingParams(max_tokens=8))
        out = llm.scheduler.schedule()                  # both prompts in one prefill step
        assert all(r.is_prefill and r.is_last_chunk for r in out.requests)
        result = np.asarray(llm.runner.dispatch(out, None, p))
        slots = [llm.runner.slot_of[r.seq_id] for r in out.requests]
        drafts[p] = np.asarray(llm.runner.state.drafts)[slots]
        del result
    for p in range(K):
        np.testing.assert_array_equal(drafts[p][:, :p], drafts[K][:, :p])
        assert (drafts[p][:, p:] == 0).all()


def test_a_row_never_verifies_an_undrawn_draft():
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(5), std=0.3)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3), num_pages=32)
    seq = llm.add_request(_prompts(cfg, 5, n=1)[0], SamplingParams(max_tokens=8))
    out = llm.scheduler.schedule()
    result = llm.runner.dispatch(out, None, 1)         # the prefill drew one draft
    llm._loop._complete(out, result, [3] * len(out.requests), 1)
    assert llm.runner.drafted[seq.seq_id] == 1
    dec = llm.scheduler.schedule()
    assert not dec.requests[0].is_prefill
    assert llm.runner.verify_counts(dec, [3]) == [1]
    with pytest.raises(ValueError, match="would verify 3 drafts, but its last step drew 1"):
        llm.runner.pack(dec, [3])
    with pytest.raises(ValueError, match="draft passes must be 0..K=3"):
        llm.runner.dispatch(dec, [1], 4)


@pytest.mark.parametrize("held", [0, 1, 2, 3])
def test_a_decode_row_is_as_wide_as_the_drafts_it_verifies(held):
    """A batch-1 decode holding `held` drafts packs held + 1 tokens: its verify and MTP first
    pass run in the (held + 1)-token buckets, not in K + 1's."""
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(7), std=0.3)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3), num_pages=32,
                     min_token_bucket=1)
    llm.add_request(_prompts(cfg, 7, n=1)[0], SamplingParams(max_tokens=8))
    out = llm.scheduler.schedule()
    result = llm.runner.dispatch(out, None, held)
    llm._loop._complete(out, result, [3], held)
    dec = llm.scheduler.schedule()
    batch, F = llm.runner.pack(dec, llm.runner.verify_counts(dec, [3]))
    assert list(batch.cu_q_lens[:2]) == [0, held + 1]
    assert batch.tokens.shape[0] == F == {0: 1, 1: 2, 2: 4, 3: 4}[held]


def test_step_times_skip_steps_delayed_by_a_compile(monkeypatch):
    """A step whose readback waited for a compile (its own, or the next step's dispatched
    while it was in flight) is no step time: each compile here also sleeps 1.5 s, so a
    sample that took one in would be >= 1.5 s."""
    import time
    cfg = tiny_mla_moe_config(67)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(6), std=0.05)
    # one token bucket (the 11-token prefill's): a program per pass count, each compiled
    # (and slept on) once while the adaptive rule tries the counts in turn
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3), num_pages=32,
                     max_num_batched_tokens=16, min_token_bucket=16, max_model_len=64,
                     adaptive_k=AdaptiveK(), async_scheduling=True)
    dispatch = llm.runner.dispatch

    def slow_compiles(*a, **k):
        before = llm.runner.num_compiles
        out = dispatch(*a, **k)
        if llm.runner.num_compiles > before:
            time.sleep(1.5)
        return out
    llm.runner.dispatch = slow_compiles
    llm.generate(_prompts(cfg, 6, n=2), SamplingParams(max_tokens=24))
    samples = [t for d in llm._loop.step_times.samples.values() for t in d]
    assert llm.runner.num_compiles >= 3 and samples
    assert max(samples) < 1.5, sorted(samples)[-3:]


def test_step_times_skip_the_step_after_a_change_of_program(monkeypatch):
    """A step that runs another program than the step before it (slower on a GPU, here a
    0.4 s sleep in its dispatch) is kept apart from the rule's step times. After a change of
    passes that is the first step (other passes) and often the second (the same passes, at
    the token bucket of the new count's verify)."""
    import time
    cfg = tiny_mla_moe_config(71)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(7), std=0.05)
    rng = np.random.default_rng(7)
    # a new count every ~4 steps, so both switches and steady runs occur
    choice = [3]
    def best(*a, **k):
        if rng.uniform() < 0.25:
            choice[0] = int(rng.integers(0, 4))
        return choice[0]
    monkeypatch.setattr(adaptive, "_best_passes", best)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3), num_pages=32,
                     adaptive_k=AdaptiveK(probe_interval=0, step_probe_interval=0),
                     async_scheduling=False)
    dispatch, last = llm.runner.dispatch, [None]

    buckets = set()

    def slow_switches(out, ks=None, passes=None):
        result = dispatch(out, ks, passes)
        program = llm.runner.last_program
        if last[0] is not None and program != last[0]:
            time.sleep(0.4)
            if last[0][3] == program[3]:             # same passes, another token bucket
                buckets.add((last[0][0][0], program[0][0]))
        last[0] = program
        return result
    llm.runner.dispatch = slow_switches
    # steps that compiled are never timed (another test); the others after a switch sleep
    llm.generate(_prompts(cfg, 8, n=1), SamplingParams(max_tokens=40))
    samples = [t for d in llm._loop.step_times.samples.values() for t in d]
    assert samples and max(samples) < 0.4, sorted(samples)[-3:]
    assert any(t >= 0.4 for _, t in llm._loop.switch_step_times)
    assert buckets, "no step changed token bucket at unchanged passes"
    # every decode step not timed is counted with its reason (the bench prints them)
    untimed = llm._loop.untimed_steps
    assert untimed[(3, "compiled")] >= 1
    assert sum(n for (_, why), n in untimed.items() if why == "after a switch") == \
        len(llm._loop.switch_step_times)
    # ... and what a switch cost beyond the steady time is kept for spacing the rule's detours
    # (a switch into a count not timed yet is not)
    extra = llm._loop.step_times.switch_extra
    assert extra and max(extra) >= 0.4 - max(samples)
    assert llm._loop.step_times.switch_seconds() > 0.3
