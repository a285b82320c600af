"""Expert-aware adaptive K: the MoE step-cost model and the tokens-per-byte choice of k."""

import dataclasses

import jax
import numpy as np
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from mtpjax.bench import e2e
from mtpjax.speculative import adaptive
from mtpjax.speculative.adaptive import AdaptiveK
from mtpjax.speculative.expert_cost import ExpertStepCost
from mtpjax.speculative.step_times import StepTimes
from tests.conftest import tiny_mla_moe_config


@pytest.mark.parametrize("shape", ["deepseek-v2-lite", "deepseek-v3-slice"])
def test_step_bytes_match_the_benchmark_floor_at_full_k(shape):
    """The cost model composes the parameter table's parts (`model/weight_bytes.py`) into the
    e2e bench's floor of a K=3 step (all K draft passes, 1 + K verify tokens); one verified token
    reads fewer experts."""
    cfg = e2e.model_config(shape)
    cost = ExpertStepCost.from_config(cfg, 3)
    floor = e2e.step_bytes(e2e.weight_bytes(cfg), cfg, 1, 0.0, 3)["total"]
    assert cost.step_bytes(1, 4) == pytest.approx(floor, rel=1e-9)
    steps = cost.step_bytes(1, np.arange(1, 5))
    assert np.all(np.diff(steps) > 0)
    assert ExpertStepCost.from_config(e2e.model_config("llama3-8b"), 3) is None
    # three MTP modules: a draft pass still reads one module's weights
    cfg3 = dataclasses.replace(cfg, num_mtp_layers=3)
    cost3 = ExpertStepCost.from_config(cfg3, 3)
    floor3 = e2e.step_bytes(e2e.weight_bytes(cfg3), cfg3, 1, 0.0, 3)["total"]
    assert cost3.step_bytes(1, 4) == pytest.approx(floor3, rel=1e-9)


def _choose(cost, alphas, k_max, batch, **kw):
    n = len(alphas)
    trials = np.full((n, 3), 1e6)
    hits = trials * np.asarray(alphas)[:, None]
    policy = AdaptiveK(probe_interval=0, **kw)
    return policy.choose_many(trials, hits, np.zeros(n, np.int64), np.asarray(k_max), batch,
                              cost)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_one_takes_the_k_with_most_tokens_per_byte(seed):
    rng = np.random.default_rng(seed)
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    for _ in range(20):
        a = rng.uniform(0, 1, 3)
        trials = np.full((1, 3), 1e6)
        k = AdaptiveK(probe_interval=0).choose_many(trials, trials * a, np.zeros(1, np.int64),
                                                    np.asarray([3]), 1, cost)[0]
        gain = np.cumprod(a)
        tokens = 1 + np.concatenate([[0.0], np.cumsum(gain)])
        per_byte = tokens / cost.step_bytes(1, 1 + np.arange(4))
        assert per_byte[k] == pytest.approx(per_byte.max(), rel=1e-6)


def test_choice_grows_with_acceptance_and_respects_bounds():
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    ks = [int(_choose(cost, [a], [3], 1)[0]) for a in np.linspace(0.0, 1.0, 21)]
    assert ks == sorted(ks) and ks[0] == 0 and ks[-1] == 3     # low acceptance: plain
    assert int(_choose(cost, [0.9], [1], 1)[0]) == 1            # never above the request's k
    assert int(_choose(cost, [0.0], [3], 1, min_k=2)[0]) == 2   # min_k holds
    # off: the dense threshold rule (draft while the kept chance >= draft_cost)
    assert int(_choose(cost, [0.5], [3], 1, expert_aware=False)[0]) == 1


def test_bad_expert_aware_is_refused():
    with pytest.raises(ValueError, match="expert_aware must be True or False"):
        AdaptiveK(expert_aware="yes")


def test_engine_moe_adaptive_k_is_expert_aware_and_lossless(monkeypatch):
    cfg = tiny_mla_moe_config(57)
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(3), std=0.05)
    prompts = [[1, 5, 9, 2], [7, 3, 3, 8, 1, 4]]
    sp = SamplingParams(max_tokens=12)
    calls = []
    inner = adaptive._best_passes
    monkeypatch.setattr(adaptive, "_best_passes", lambda *a: calls.append(a) or inner(*a))
    plain = mtpjax.LLM(params, cfg, None, num_pages=32).generate(prompts, sp)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=3), num_pages=32,
                     adaptive_k=AdaptiveK())
    got = llm.generate(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert calls                                   # the MoE model took the expert-aware rule


def test_step_bytes_with_passes():
    """p draft passes: K passes is the old count; each pass fewer saves one pass's module,
    lm_head and draft experts; p = 0 still runs the module's first pass (no lm_head)."""
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    for B, n in ((1, 4), (32, 128)):
        full = cost.step_bytes(B, n)
        by_p = cost.step_bytes(B, n, np.arange(4))
        assert by_p[3] == pytest.approx(full)
        per_pass = cost.pass_bytes + cost.draft_expert_bytes / 3 * cost.touched(B)
        np.testing.assert_allclose(np.diff(by_p)[1:], per_pass, rtol=1e-9)
        assert by_p[1] - by_p[0] == pytest.approx(cost.lm_head_bytes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_best_passes_maximises_tokens_per_measured_second(seed):
    """With every pass count measured, the choice is the argmax of expected tokens / measured
    time, whatever the byte model says."""
    rng = np.random.default_rng(seed)
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    for _ in range(10):
        times = StepTimes()
        secs = np.sort(rng.uniform(2e-3, 6e-3, 4))
        for p, t in enumerate(secs):
            times.record(1, p, t)
        a = rng.uniform(0, 1, 3)
        gain = np.cumprod(a)[None]
        got = adaptive._best_passes(gain, np.asarray([3]), 1, cost, times)
        tokens = 1 + np.concatenate([[0.0], np.cumsum(gain[0])])
        assert (tokens / secs)[got] == pytest.approx((tokens / secs).max(), rel=1e-9)


def test_step_times_calibrate_the_unmeasured_counts():
    """One measured count scales the byte model of the others by its seconds per byte; a
    measured count is its median."""
    times = StepTimes(window=3)
    model = np.asarray([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(times.estimate(1, model), model)        # nothing measured
    for t in (9.0, 5.0, 6.0, 1.0):                                    # window 3: 5, 6, 1
        times.record(1, 2, t)
    np.testing.assert_allclose(times.estimate(1, model), model * 5.0 / 3.0)   # median 5
    times.record(2, 0, 4.0)                            # batch 2 -> its own bucket
    assert times.estimate(2, model)[0] == 4.0
    assert times.estimate(1, model)[0] == pytest.approx(5.0 / 3.0)   # its own bucket first


def test_step_rule_measures_then_chooses_then_probes():
    """Unmeasured counts run first; then the best by tokens per measured second; the last
    two of every step_probe_interval steps run every draft asked."""
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    pol = AdaptiveK(step_probe_interval=8)
    trials = np.full((1, 3), 1e6)
    hits = trials * 0.5
    times = StepTimes()
    first = pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, 0)
    assert first[1] == 0 and int(first[0][0]) == 0                 # nothing measured: 0 first
    for _ in range(adaptive.MEASURED_STEPS - 1):
        times.record(1, 0, 3.2e-3)
    assert pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, 1)[1] == 0
    times.record(1, 0, 3.2e-3)                          # three steps of 0: 1 is next
    assert pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, 1)[1] == 1
    for _ in range(adaptive.MEASURED_STEPS):
        for p, t in enumerate((3.2e-3, 4.0e-3, 5.3e-3, 6.0e-3)):     # V2-Lite, H200, batch 1
            times.record(1, p, t)
    got = [pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, i)
           for i in range(16)]
    passes = [p for _, p in got]
    # at acceptance 0.5: 1.5 tokens / 4.0 ms beats 1.75 / 5.3 and 1 / 3.2
    assert passes == [1] * 6 + [3, 3] + [1] * 6 + [3, 3]
    assert all(int(k[0]) == p for k, p in got)
    capped = pol.choose_step(trials, trials * 0.2, np.zeros(1, np.int64), [2], 1, cost,
                             times, 7)
    assert capped[1] == 2 and int(capped[0][0]) == 2


def test_step_rule_keeps_its_count_unless_another_is_clearly_better():
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    times = StepTimes()
    for p, t in enumerate((3.2e-3, 4.0e-3, 5.3e-3, 6.0e-3)):
        for _ in range(adaptive.MEASURED_STEPS):
            times.record(1, p, t)
    trials = np.full((1, 3), 1e6)
    pol = AdaptiveK(switch_margin=0.05)
    # acceptance 0.8: three drafts 2.95 / 6.0 = 0.49 per ms, one 1.8 / 4.0 = 0.45 (9% less)
    hits = trials * 0.8
    assert pol.rule_passes(trials, hits, [3], 1, cost, times, current=1) == 3
    # acceptance 0.74: three give 2.69 / 6.0 = 0.449, one 1.74 / 4.0 = 0.435: within 5%
    hits = trials * 0.74
    assert pol.rule_passes(trials, hits, [3], 1, cost, times, current=None) == 3
    assert pol.rule_passes(trials, hits, [3], 1, cost, times, current=1) == 1


def test_later_positions_shrink_toward_the_first():
    """A position judged a few times with bad luck does not keep the rule away: later
    positions shrink toward the request's first-position estimate."""
    trials = np.asarray([[100.0, 2.0, 0.0]])
    hits = np.asarray([[80.0, 0.0, 0.0]])
    a = adaptive._step_alphas(trials, hits, 0.7, 2.0)[0]
    first = (80 + 1.4) / 102
    assert a[0] == pytest.approx(first)
    assert a[1] == pytest.approx(4 * first / 6) and a[2] == pytest.approx(first)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_times_expire_so_a_left_count_is_timed_again(seed):
    """A count timed only early (slow first steps) and then left expires after max_age
    records of other counts: it reads unmeasured, so the step rule times it again instead of
    judging it by those early steps for ever."""
    rng = np.random.default_rng(seed)
    cost = ExpertStepCost.from_config(e2e.model_config("deepseek-v2-lite"), 3)
    times = StepTimes(window=4, max_age=int(rng.integers(20, 60)))
    slow_early = (4.7e-3, 7.6e-3, 7.7e-3, 6.2e-3)       # the first steps of a fresh engine
    for p, t in enumerate(slow_early):
        for _ in range(adaptive.MEASURED_STEPS):
            times.record(1, p, t * rng.uniform(0.98, 1.02))
    pol = AdaptiveK(step_probe_interval=0)
    trials = np.full((1, 3), 1e6)
    hits = trials * 0.5
    assert pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, 0)[1] == 3
    steps, passes_seen = 0, []
    truth = (3.2e-3, 4.0e-3, 5.3e-3, 6.0e-3)
    while steps < 4 * times.max_age:
        _, p = pol.choose_step(trials, hits, np.zeros(1, np.int64), [3], 1, cost, times, steps)
        times.record(1, p, truth[p])
        passes_seen.append(p)
        steps += 1
    # after the early samples expire every count is timed again, and one pass (1.5 tokens /
    # 4.0 ms beats 1.75 / 5.3 and 1.875 / 6.0) wins from then on
    assert set(passes_seen) == {0, 1, 2, 3}
    assert passes_seen[-times.max_age:].count(1) >= times.max_age - 4 * adaptive.MEASURED_STEPS
    assert times.measured(1, 1) == pytest.approx(truth[1])


def test_step_times_reject_a_max_age_below_the_window():
    with pytest.raises(ValueError, match="max_age"):
        StepTimes(window=8, max_age=4)
