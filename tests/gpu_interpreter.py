"""JAX's GPU kernel interpreter (the Mosaic-GPU kernels' CPU tests), compiling each simulated
thread's program once per kernel instead of once per grid point.

The interpreter runs a kernel's grid as a loop; at every grid point it hands the body's jaxpr
to one Python thread per warpgroup, and each thread traces, lowers and compiles that jaxpr
anew through the AOT path (`jit(...).trace(...).lower().compile()`), which skips JAX's
executable cache: the compiles were ~85% of an interpreted Mosaic case's time. Here each
thread keeps its compiled program for the next grid point of the same kernel call (the jaxpr
is the same object at every grid point), keyed also on the arguments' shapes. A thread runs
only its own program, as before: one program run from several threads at once would
deadlock (the threads wait on each other's barriers inside it). `clear()` drops the programs
(tests/conftest.py, after each module, with JAX's caches).
"""
from __future__ import annotations

import jax
import numpy as np

# (jaxpr, thread index, argument shapes and dtypes) -> compiled program
_programs: dict = {}


def _run(jaxpr, consts, *args):
    jax.core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr(jaxpr, consts, *args):
    """`thread_map._run_jaxpr`'s contract: run `jaxpr` (first argument: the thread index)
    for its callbacks' effects; no result."""
    leaves = jax.tree.leaves((consts, args))
    key = (jaxpr, int(args[0]), tuple((np.shape(x), np.asarray(x).dtype) for x in leaves))
    program = _programs.get(key)
    if program is None:
        traced = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args)
        program = _programs[key] = traced.lower().compile()
    program(consts, *args)


def install() -> None:
    """Routes the interpreter's per-thread runs through `_run_jaxpr` (a private module, present
    in JAX 0.10-0.11; a JAX without it keeps its own path)."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return
    if hasattr(thread_map, "_run_jaxpr"):
        thread_map._run_jaxpr = _run_jaxpr


def clear() -> None:
    _programs.clear()
