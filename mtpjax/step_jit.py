"""How every device step (prefill, generate's loops, the engine's step) is compiled.

`step_jit` is `jax.jit` plus the XLA options a serving step needs:

- `xla_gpu_dot_merger_threshold_mb=0`: XLA's GPU DotMerger pass merges dots that share an
  operand (x @ wq, x @ wk, x @ wv; x @ w_gate, x @ w_up) into one dot over *concatenated
  weights*. With weights as runtime arguments that concatenation is a copy of the layer's
  weights on every call (measured on an H100: 8 weight-sized concatenates per 4-layer step,
  docs/benchmarks.md), which costs more than the merged dot saves. Other backends ignore it.

Every jitted step is recorded in `STEP_FUNCTIONS` so a test can check none bypasses this.
"""

from __future__ import annotations

import functools

import jax

STEP_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
STEP_FUNCTIONS: list = []


def step_jit(fun=None, **jit_kwargs):
    """`jax.jit(fun, compiler_options=STEP_COMPILER_OPTIONS, **jit_kwargs)`; usable as
    `@step_jit(static_argnames=...)` or `@step_jit`."""
    if fun is None:
        return functools.partial(step_jit, **jit_kwargs)
    jitted = jax.jit(fun, compiler_options=dict(STEP_COMPILER_OPTIONS), **jit_kwargs)
    STEP_FUNCTIONS.append(jitted)
    return jitted
