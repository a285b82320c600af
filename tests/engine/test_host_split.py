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
