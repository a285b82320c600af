"""How every device step (prefill, generate's loops, the engine's step) is compiled.

`step_jit` is `jax.jit` plus the XLA options a serving step needs:

- `xla_gpu_dot_merger_threshold_mb=0`: XLA's GPU DotMerger pass merges dots that share an
  operand (x @ wq, x @ wk, x @ wv; x @ w_gate, x @ w_up) into one dot over *concatenated
  weights*. With weights as runtime arguments that concatenation is a copy of the layer's
  weights on every call (measured on an H100: 8 weight-sized concatenates per 4-layer step,
  docs/benchmarks.md), which costs more than the merged dot saves. Other backends ignore it.

`generate`'s on-device loop adds `LOOP_COMPILER_OPTIONS`: its while loops go into the CUDA
graph too (WHILE and CONDITIONAL commands become conditional graph nodes, so the loop runs
without the host). Without them each iteration starts with the host waiting for the loop's
predicate and then launching the body's CUDA graph while the device idles: `cuGraphLaunch` took
1.0-1.3 ms of every check at the 8B layer shape (a `jax.profiler` trace, docs/benchmarks.md).

Every jitted step is recorded in `STEP_FUNCTIONS` so a test can check none bypasses this.
"""

from __future__ import annotations

import functools

import jax

STEP_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
# XLA's default command-buffer types (xla/debug_options_flags.cc) plus WHILE and CONDITIONAL
LOOP_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer":
                         "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}
STEP_FUNCTIONS: list = []
_OPTIONS: dict[int, dict] = {}          # id(jitted step) -> its compiler options


def step_jit(fun=None, *, extra_options: dict | None = None, **jit_kwargs):
    """`jax.jit(fun, compiler_options=STEP_COMPILER_OPTIONS | extra_options, **jit_kwargs)`;
    usable as `@step_jit(static_argnames=...)` or `@step_jit`."""
    if fun is None:
        return functools.partial(step_jit, extra_options=extra_options, **jit_kwargs)
    jitted = jax.jit(fun, compiler_options={**STEP_COMPILER_OPTIONS, **(extra_options or {})},
                     **jit_kwargs)
    STEP_FUNCTIONS.append(jitted)
    _OPTIONS[id(jitted)] = {**STEP_COMPILER_OPTIONS, **(extra_options or {})}
    return jitted


def compiler_options_of(jitted) -> dict:
    """The compiler options `step_jit` gave this jitted step."""
    return dict(_OPTIONS[id(jitted)])
