"""The step loop splits each step() call's time into host work and waiting for a result: the
benchmark's evidence of whether the host or the device sets the step rate."""

import time

import jax
import pytest

import mtpjax
from mtpjax import SamplingParams, SpecConfig
from tests.conftest import tiny_config


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_host_work_and_waiting_add_up_to_the_step_calls(async_scheduling):
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0), std=0.05)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=32,
                     async_scheduling=async_scheduling)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6))           # compiles
    loop = llm._loop
    loop.reset_host_split()
    schedule, sleep = loop.scheduler.schedule, 0.01

    def slow_schedule():                    # host work the split must count as host
        time.sleep(sleep)
        return schedule()
    loop.scheduler.schedule = slow_schedule
    t0 = time.perf_counter()
    llm.generate([[4, 5, 6, 7]], SamplingParams(max_tokens=12))
    total = time.perf_counter() - t0
    host, wait = loop.host_split()
    assert loop.timed_calls >= 4
    assert host >= sleep and wait >= 0.0
    # the step() calls are most of generate's time, and never more than it
    assert 0.5 * total <= (host + wait) * loop.timed_calls <= total


@pytest.mark.parametrize("warmup", [False, True])
def test_one_device_steps_take_their_inputs_as_numpy(monkeypatch, warmup):
    """On one device the packed batch reaches the step as a numpy array (the call moves it in
    C++; `jax.device_put` cost ~50 us more host time a step, and batch 1 is host-bound), both
    through the jitted step and through warmed-up executables, and compiles nothing extra."""
    import numpy as np
    runner_mod = __import__("mtpjax.engine.runner", fromlist=["_step"])
    cfg = tiny_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(1), std=0.05)
    llm = mtpjax.LLM(params, cfg, SpecConfig(num_speculative_tokens=2), num_pages=32,
                     max_num_batched_tokens=16, min_token_bucket=16, warmup=warmup)
    seen = []
    if warmup:
        for key, compiled in list(llm.runner.executables.items()):
            def spy(p, s, inputs, compiled=compiled):
                seen.append(type(inputs))
                return compiled(p, s, inputs)
            llm.runner.executables[key] = spy
    else:
        step = runner_mod._step

        def spy(params, cfg, spec, state, inputs, **kw):
            seen.append(type(inputs))
            return step(params, cfg, spec, state, inputs, **kw)
        monkeypatch.setattr(runner_mod, "_step", spy)
    want = mtpjax.generate(params, cfg, [[3, 1, 4, 1, 5]], max_new_tokens=8,
                           spec=SpecConfig(num_speculative_tokens=2)).tokens[0]
    compiles = llm.runner.num_compiles
    got = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(max_tokens=8))[0].token_ids
    assert got == want
    assert seen and set(seen) == {np.ndarray}
    if warmup:
        assert llm.runner.num_compiles == compiles
