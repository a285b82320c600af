"""The MoE step rule's probes back off while they confirm the rule's count, and the rule still
follows a change of acceptance; a simulated batch-1 engine on V2-Lite's measured step times
stays within reach of the best fixed K."""

import numpy as np
import pytest

from mtpjax.bench import e2e
from mtpjax.speculative.adaptive import AcceptanceTable, AdaptiveK, ProbeSchedule
from mtpjax.speculative.expert_cost import ExpertStepCost
from mtpjax.speculative.step_times import StepTimes

# V2-Lite, batch 1, H200: seconds of a steady step by draft passes 0..3
STEP_SECONDS = (3.19e-3, 4.07e-3, 4.79e-3, 6.14e-3)
# ... and what a step right after a change of passes took beyond that (4.6-17 ms against
# 3.9-5.6 steady, V2-Lite batch 1, H200)
SWITCH_SECONDS = 8e-3
# a verify's token bucket by the drafts it verifies (an MoE engine's buckets: 1, 2, 4, ...)
VERIFY_BUCKET = (1, 2, 4, 4)


def probe_steps(schedule, rules):
    return [i for i, r in enumerate(rules) if schedule.due(i, r)]


def test_probes_back_off_while_the_count_holds():
    s = ProbeSchedule(64, 512)
    got = probe_steps(s, [1] * 3000)
    starts = got[::2]
    assert all(b == a + 1 for a, b in zip(got[::2], got[1::2]))        # two steps each
    gaps = np.diff(starts).tolist()
    assert starts[0] == 62
    assert gaps[:5] == [128, 256, 512, 512, 512]                      # doubling, capped


def test_a_changed_count_restarts_the_shortest_wait():
    s = ProbeSchedule(16, 1024)
    rules = [1] * 200
    first = probe_steps(s, rules)
    # the count moves right after a probe (the probe found a better one): next in 16 again
    s = ProbeSchedule(16, 1024)
    rules = [1] * 16 + [3] * 184
    got = probe_steps(s, rules)
    assert got[:2] == [14, 15] and got[2:4] == [16 + 14, 16 + 15]
    assert len(got) > len(first)
    # the count moves between probes (the wait had grown to 64): the next probe comes
    # within the shortest wait, then the waits double again
    s = ProbeSchedule(16, 1024)
    rules = [1] * 100 + [2] * 300
    got = probe_steps(s, rules)
    later = [i for i in got if i >= 100][::2]
    assert later[0] <= 100 + 14 and np.diff(later).tolist()[:2] == [32, 64]
    assert not ProbeSchedule(0, 64).due(10, 1)


def simulate(alpha_of_step, steps, seed, policy=None, fixed=None, request_steps=None,
             switch_seconds=0.0):
    """A batch-1 engine on STEP_SECONDS: each step verifies at most the drafts the step
    before drew, each kept with probability alpha (iid, the chain stops at the first miss); a
    new request every request_steps steps (None: one request throughout). As in the engine,
    a step's program is its draft passes and its verify's token bucket (1, 2, 4, 4 tokens for
    0..3 drafts); a step whose program differs from the step before takes switch_seconds more
    and is kept apart (`StepTimes.record_switch`), and a step that verified fewer drafts than
    it draws is not timed. -> (tokens, seconds, passes per step). Every policy of a seed sees
    the same draws (common random numbers), so their difference is the policy's, not the
    luck's."""
    rng = np.random.default_rng(seed)
    draws, jitter = rng.random((steps, 3)), rng.uniform(0.97, 1.03, steps)
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    table, times = AcceptanceTable(3), StepTimes()
    tokens = seconds = 0.0
    passes_run, programs = [], []
    for i in range(steps):
        sid = i // request_steps if request_steps else 0
        if request_steps and i and i % request_steps == 0:
            table.drop(sid - 1)
        if fixed is None:
            ks, passes = table.choose_step(policy, [sid], [3], 1, cost, times, i)
            k = int(ks[0])
        else:
            k = passes = fixed
        k = min(k, passes_run[-1]) if passes_run else 0         # drafts the slot holds
        hits = draws[i, :k] < alpha_of_step(i)
        accepted = int(np.argmin(hits)) if not hits.all() else k
        program = (VERIFY_BUCKET[k], passes)
        t = STEP_SECONDS[passes] * jitter[i]
        switched = bool(programs) and program != programs[-1]
        t += switch_seconds if switched else 0.0
        if fixed is None:
            table.observe([sid], [k], [accepted], policy.decay, policy.step_decay)
            if k != passes:
                pass                                   # verified fewer: not a steady step
            elif switched and switch_seconds:
                times.record_switch(1, passes, t)
            elif not switched:
                times.record(1, passes, t)
        tokens += 1 + accepted
        seconds += t
        passes_run.append(passes)
        programs.append(program)
    return tokens, seconds, passes_run


def fixed_rates(alpha):
    """Tokens per second of fixed K = 0..3 at iid acceptance alpha on STEP_SECONDS."""
    return np.asarray([sum(alpha ** i for i in range(k + 1)) / STEP_SECONDS[k]
                       for k in range(4)])


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 0.65, 0.8, 0.95])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_simulated_engine_near_the_best_fixed_k(alpha, seed):
    """Within 2% of the best fixed K where every other count is more than the switch margin
    behind; within the margin and that 2% where one is not (a near-tie may hold the count up
    to the margin worse: that is what the margin is for). The 2% pays for timing every count
    (its first steps after a change of program are not timed) and the probes: 98.4-99.6%
    where the lead is clear. Probes every 64 steps without back-off, re-timing every count out
    of use every 256 steps and ten steps' memory gave 0.967 at acceptance 0.1."""
    steps, policy = 3000, AdaptiveK()
    best = max(t / s for t, s, _ in (simulate(lambda i: alpha, steps, seed, fixed=k)
                                     for k in range(4)))
    tok, sec, passes = simulate(lambda i: alpha, steps, seed, policy)
    rates = np.sort(fixed_rates(alpha))
    clear = rates[-2] < rates[-1] * (1 - policy.switch_margin)
    floor = 0.98 if clear else 0.98 - policy.switch_margin
    assert tok / sec >= floor * best, (alpha, seed, tok / sec / best, np.bincount(passes))


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5, 0.8, 0.95])
def test_switching_costs_keep_detours_apart(alpha):
    """With a switch of program costing two steps (SWITCH_SECONDS; a detour to another
    count and back takes two to four), the rule's detours (probes, re-timing counts out of
    use) wait until four switches fit the switch budget: within 5% of the best fixed K over
    3000 steps (95.6-98.9%; the first timing of every count and the detours' own steps
    included; 93.9-97.9% when the wait counted two switches), where the same rule without
    the budget lost up to 16% (at 0.3)."""
    steps = 3000
    for seed in (0, 1, 2):
        best = max(t / s for t, s, _ in (simulate(lambda i: alpha, steps, seed, fixed=k)
                                         for k in range(4)))
        tok, sec, passes = simulate(lambda i: alpha, steps, seed, AdaptiveK(),
                                    switch_seconds=SWITCH_SECONDS)
        switches = int(np.sum(np.diff(passes) != 0))
        assert tok / sec >= 0.95 * best, (alpha, seed, tok / sec / best, switches)
        assert switches <= 30, switches
    if alpha == 0.5:        # without the budget: probes and re-timings every 64-256 steps
        best = max(t / s for t, s, _ in (simulate(lambda i: alpha, steps, 0, fixed=k)
                                         for k in range(4)))
        tok, sec, passes = simulate(lambda i: alpha, steps, 0, AdaptiveK(switch_budget=0.0),
                                    switch_seconds=SWITCH_SECONDS)
        assert tok / sec < 0.92 * best and np.sum(np.diff(passes) != 0) > 80


def test_detour_wait_keeps_a_detours_switches_within_the_budget():
    """detour_wait = ceil(4 x median extra of a switch / (budget x the count's steady step));
    0 until both are measured; a switch into an unmeasured count is not kept; no key expires
    before min_age."""
    rng = np.random.default_rng(0)
    times = StepTimes(window=4, max_age=8)
    times.record_switch(1, 1, 0.02)                   # count 1 unmeasured: nothing to subtract
    assert times.switch_seconds() == 0.0 and times.detour_wait(1, 1, 0.01) == 0
    steady = rng.uniform(3e-3, 6e-3)
    for _ in range(3):
        times.record(1, 1, steady)
    extras = rng.uniform(2e-3, 12e-3, 5)
    for e in extras:
        times.record_switch(1, 1, steady + e)
    extra = float(np.median(extras[-4:]))
    assert times.switch_seconds() == pytest.approx(extra)
    assert times.detour_wait(1, 1, 0.01) == int(np.ceil(4 * extra / (0.01 * steady)))
    assert times.detour_wait(1, 1, 0.0) == 0 and times.detour_wait(1, 2, 0.01) == 0
    times.record_switch(1, 1, steady / 2)             # faster than steady: no negative cost
    assert min(times.switch_extra) == 0.0
    times.record(1, 0, 1e-3)
    times.min_age = 50
    for _ in range(40):                               # past max_age (8), within min_age
        times.record(1, 1, steady)
    assert times.count(1, 0) == 1
    for _ in range(20):
        times.record(1, 1, steady)
    assert times.count(1, 0) == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rule_follows_acceptance_that_rises(seed):
    """Acceptance 0.4, then 0.95 from step 2000: the probes had backed off while one pass was
    best (two and three give 2% and 19% fewer tokens per second at 0.4), yet within 1000
    steps the rule drafts two or three (each within 1.5% of the other at 0.95; one pass gives
    21% fewer tokens)."""
    _, _, passes = simulate(lambda i: 0.4 if i < 2000 else 0.95, 4000, seed, AdaptiveK())
    passes = np.asarray(passes)
    assert np.mean(passes[1000:2000] == 1) > 0.8
    assert np.mean(passes[3000:] >= 2) > 0.95


@pytest.mark.parametrize("max_age", [8, 20, 33])
def test_expired_counts_wait_twice_as_long_each_time(max_age):
    """A count out of use is timed again max_age records after its last timing, then 2x,
    4x ... up to MAX_AGE_GROWTH x max_age; the count in use never expires."""
    times = StepTimes(window=4, max_age=max_age)
    retimed = []
    for step in range(80 * max_age):
        if times.count(1, 0) < 3:                # the rule times an unmeasured count
            retimed.append(times.records)
            for _ in range(3):
                times.record(1, 0, 1e-3)
        times.record(1, 1, 1e-3)                 # the count in use
        assert times.count(1, 1) == min(step + 1, 4)
    # records between one timing's last sample and the next timing
    waits = [b - (a + 2) for a, b in zip(retimed, retimed[1:])]
    limits = [min(max_age * 2 ** j, StepTimes.MAX_AGE_GROWTH * max_age)
              for j in range(len(waits))]
    assert waits == [lim + 1 for lim in limits]
    assert len(waits) >= 6 and waits[-1] == StepTimes.MAX_AGE_GROWTH * max_age + 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_new_request_starts_from_the_pooled_acceptance(seed):
    """The step rule's counts of a new request start from POOL_SEED_STEPS steps' worth of
    every request's pooled acceptance, not from the fixed prior: after requests kept ~0.2 of
    their drafts, a new one is judged at ~0.2 from its first step (the prior, 0.7, would
    have it draft for tens of steps)."""
    from mtpjax.speculative import adaptive
    rng = np.random.default_rng(seed)
    alpha = rng.uniform(0.1, 0.3)
    table, policy = AcceptanceTable(3), AdaptiveK()
    for sid in range(3):
        for _ in range(150):
            drafts = rng.random(3) < alpha
            accepted = int(np.argmin(drafts)) if not drafts.all() else 3
            table.observe([sid], [3], [accepted], policy.decay, policy.step_decay)
        table.drop(sid)
    r = table.rows([99])[0]
    assert table.step_trials[r, 0] == pytest.approx(adaptive.POOL_SEED_STEPS)
    est = table.step_hits[r, 0] / table.step_trials[r, 0]
    assert abs(est - alpha) < 0.15
    assert table.trials[r].sum() == 0                 # the per-request rule starts afresh
