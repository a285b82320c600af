"""`mtpjax.generate(..., spec=SpecConfig(...))`: prefill, then a `lax.while_loop` of spec steps."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig, SpecConfig
from mtpjax.speculative.step import SpecState, spec_prefill, spec_step
from mtpjax.step_jit import step_jit


@step_jit(static_argnames=("cfg", "spec", "max_new", "backend", "source"),
                   donate_argnames=("cache",))
def _prefill(params, cfg, spec, cache, tokens, positions, lens, tables, sp, limits, forced, *,
             max_new, backend, source):
    return spec_prefill(params, cfg, spec, cache, tokens, positions, lens, tables, sp, limits,
                        max_new=max_new, backend=backend, source=source, forced=forced)


@step_jit(static_argnames=("cfg", "spec", "backend", "source"),
                   donate_argnames=("state",))
def _loop(params, cfg, spec, state: SpecState, sp, limits, forced, *, backend, source):
    return jax.lax.while_loop(
        lambda s: ~jnp.all(s.done),
        lambda s: spec_step(params, cfg, spec, s, sp, limits, backend=backend, source=source,
                            forced=forced),
        state)


def speculative_generate(params, cfg: ModelConfig, spec: SpecConfig, cache, tokens, positions,
                         lens, tables, sp, limits, *, max_new: int, backend,
                         draft_source: str = "model", forced_tokens=None):
    from mtpjax.generate import GenerateOutput
    lim = limits
    from mtpjax.speculative.draft import DRAFT_SOURCES, DraftOverride
    B = tokens.shape[0]
    sources = [draft_source] * B if isinstance(draft_source, str) else list(draft_source)
    forced = DraftOverride(
        modes=jnp.asarray([DRAFT_SOURCES.index(s) for s in sources], jnp.int32),
        tokens=(jnp.zeros((B, 1), jnp.int32) if forced_tokens is None
                else jnp.asarray(forced_tokens, jnp.int32)))
    draft_source = sources[0] if len(set(sources)) == 1 else "mixed"
    state = _prefill(params, cfg, spec, cache, tokens, positions, lens, tables, sp, lim, forced,
                     max_new=max_new, backend=backend, source=draft_source)
    state = _loop(params, cfg, spec, state, sp, lim, forced, backend=backend, source=draft_source)
    num_out = np.asarray(state.num_out)
    out = np.asarray(state.out_tokens)
    toks = [out[i, :num_out[i]].tolist() for i in range(out.shape[0])]
    return GenerateOutput(tokens=toks, stats=state.stats.finalize(prefill_tokens=out.shape[0]))
