"""`mtpjax.generate` in the DP-attention layout (`dp_attention.py`): the prefill step and the
decode loop each run as one `shard_map` over the mesh's "data" axis.

Device i of d holds requests [i*R, (i+1)*R) (R = B / d) in its slots, their latent pages in its
own pool of P / d pages (block tables hold local page ids), and runs the one-device step on
them; only the MoE layers talk to other devices (`dp_expert_parallel.py`). The prefill batch is
packed per device (each device's prompts in its own ragged batch, padded to a common length);
the decode loop stops when every device's requests are done (one psum of the live count per
check). Acceptance statistics are kept per device and summed at the end.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mtpjax.cache import init_cache
from mtpjax.generate import (GenerateState, generate_prefill, generate_step, plan_pages,
                             prefill_batch)
from mtpjax.model.backend import SplitTokens
from mtpjax.parallel.distributed import to_host
from mtpjax.parallel.dp_attention import (DP_ATTENTION_RULES, check_dp_attention,
                                          param_partition_specs, param_shardings_like,
                                          rows_spec, state_partition_specs)
from mtpjax.parallel.kernels import shard_map_compat
from mtpjax.parallel.placement import create_sharded, place
from mtpjax.speculative.metrics import SpecStats
from mtpjax.speculative.mixed_step import SlotState
from mtpjax.step_jit import step_jit

__all__ = ["generate_dp_attention"]

AXIS = "data"


def _inner(backend):
    """The backend each device runs under the shard_map: one device's (no mesh), with the MoE
    layers told how the tokens are split."""
    return dataclasses.replace(backend, mesh=None,
                               split_tokens=SplitTokens(AXIS, int(backend.mesh.shape[AXIS])))


def _slot_specs(slots, cfg, mesh):
    # an empty leaf (K = 0 drafts) still splits its rows: the specs are read off a stand-in
    # whose empty dims are non-empty (never a split dim: those are rows or pages)
    d = int(mesh.shape[AXIS])
    stand_in = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(tuple(n or d for n in a.shape), a.dtype), slots)
    return state_partition_specs(stand_in, cfg, mesh)


def _state_specs(slot_specs):
    """GenerateState's specs: slots by the layout, rows split, statistics one row per device."""
    rows = P(AXIS)
    return GenerateState(slots=slot_specs, block_tables=rows, out_tokens=rows, num_out=rows,
                         done=rows, stats=SpecStats(*([rows] * 7)))


def _per_device_stats(stats):
    return jax.tree.map(lambda x: x[None], stats)


@step_jit(static_argnames=("cfg", "spec", "first_pass_len", "max_new", "backend", "draft_source"),
          donate_argnames=("slots",))
def _prefill(params, cfg, spec, slots, batch, limits, forced, *, first_pass_len, max_new,
             backend, draft_source):
    mesh, inner = backend.mesh, _inner(backend)

    def body(params, slots, batch, limits, forced):
        batch = jax.tree.map(lambda x: x[0], batch)          # this device's packed prompts
        state = generate_prefill(params, cfg, spec, slots, batch, limits,
                                 first_pass_len=first_pass_len, max_new=max_new, backend=inner,
                                 draft_source=draft_source, forced=forced)
        return state.replace(stats=_per_device_stats(state.stats))

    slot_specs = _slot_specs(slots, cfg, mesh)
    run = shard_map_compat(body, mesh=mesh, in_specs=(
        param_partition_specs(params, cfg, mesh), slot_specs, rows_spec(batch),
        rows_spec(limits), rows_spec(forced)), out_specs=_state_specs(slot_specs))
    return run(params, slots, batch, limits, forced)


@step_jit(static_argnames=("cfg", "spec", "backend", "draft_source", "steps_per_check"),
          donate_argnames=("state",))
def _loop(params, cfg, spec, state, sampling, limits, forced, num_drafts, *, backend,
          draft_source, steps_per_check):
    mesh, inner = backend.mesh, _inner(backend)

    def body(params, state, sampling, limits, forced, num_drafts):
        state = state.replace(stats=jax.tree.map(lambda x: x[0], state.stats))

        def steps(s):
            return jax.lax.fori_loop(0, steps_per_check, lambda _, t: generate_step(
                params, cfg, spec, t, sampling, limits, backend=inner,
                draft_source=draft_source, forced=forced, num_drafts=num_drafts), s)

        def any_live(s):           # every device runs the same steps (the MoE layers' collectives)
            return jax.lax.psum(jnp.sum(~s.done, dtype=jnp.int32), AXIS) > 0

        state = jax.lax.while_loop(any_live, steps, state)
        return state.replace(stats=_per_device_stats(state.stats))

    specs = _state_specs(_slot_specs(state.slots, cfg, mesh))
    run = shard_map_compat(body, mesh=mesh, in_specs=(
        param_partition_specs(params, cfg, mesh), specs, rows_spec(sampling), rows_spec(limits),
        rows_spec(forced), rows_spec(num_drafts)), out_specs=specs)
    return run(params, state, sampling, limits, forced, num_drafts)


def plan_device_pages(needed_tokens, num_devices: int, page_size: int, num_pages: int | None,
                      seed: int):
    """Block tables int32[B, M] of *local* page ids (request b's pages in device b // R's pool)
    and the pages per device. num_pages: the pages of all devices together (a multiple of the
    device count; default: d x the most any device needs)."""
    B = len(needed_tokens)
    R = B // num_devices
    groups = [needed_tokens[i * R:(i + 1) * R] for i in range(num_devices)]
    if num_pages is None:
        per_device = max(sum(math.ceil(n / page_size) for n in g) for g in groups)
    elif num_pages % num_devices:
        raise ValueError(f"layout='dp_attention' splits the page pool evenly over the devices: "
                         f"num_pages={num_pages} is not a multiple of data_parallel="
                         f"{num_devices}")
    else:
        per_device = num_pages // num_devices
    tables = [plan_pages(g, page_size, per_device, seed + i)[0] for i, g in enumerate(groups)]
    M = max(t.shape[1] for t in tables)
    return np.concatenate([np.pad(t, ((0, 0), (0, M - t.shape[1]))) for t in tables]), per_device


def device_prefill_batches(prompts, spec, sampling, tables, num_devices: int):
    """One prefill batch per device (its own prompts packed), padded to a common token count and
    stacked on a leading device axis; and the first-pass length of the largest."""
    R = len(prompts) // num_devices
    batches, F = [], 0
    for i in range(num_devices):
        rows = slice(i * R, (i + 1) * R)
        b, f = prefill_batch(prompts[rows], spec, jax.tree.map(lambda x: x[rows], sampling),
                             tables[rows])
        batches.append(b)
        F = max(F, f)
    T = max(b.tokens.shape[0] for b in batches)
    pad = lambda a, value: np.pad(a, (0, T - a.shape[0]), constant_values=value)
    batches = [b.replace(tokens=pad(b.tokens, 0), positions=pad(b.positions, -1),
                         seq_ids=pad(b.seq_ids, 0)) for b in batches]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches), F


def generate_dp_attention(params, cfg, spec, prompts, *, mesh, needed_tokens, page_size,
                          num_pages, seed, dtype, sampling, limits, forced, num_drafts,
                          max_new: int, backend, draft_source, steps_per_check) -> GenerateState:
    """generate's prefill and loop in the DP-attention layout -> the final GenerateState, its
    statistics combined over the devices (host arrays)."""
    d = check_dp_attention(cfg, mesh, len(prompts))
    B = len(prompts)
    tables, per_device = plan_device_pages(needed_tokens, d, page_size, num_pages, seed)
    batch, F = device_prefill_batches(prompts, spec, sampling, tables, d)
    rows = NamedSharding(mesh, P(AXIS))
    params = jax.tree.map(place, params, param_shardings_like(params, cfg, mesh))
    slots = create_sharded(lambda: SlotState.create(
        cfg, spec, init_cache(cfg, d * per_device, page_size, dtype), B, dtype), cfg, mesh,
        DP_ATTENTION_RULES)
    batch, sampling, limits, forced, num_drafts = jax.tree.map(
        lambda x: place(x, rows), (batch, sampling, limits, forced, num_drafts))
    state = _prefill(params, cfg, spec, slots, batch, limits, forced, first_pass_len=F,
                     max_new=max_new, backend=backend, draft_source=draft_source)
    state = _loop(params, cfg, spec, state, sampling, limits, forced, num_drafts,
                  backend=backend, draft_source=draft_source, steps_per_check=steps_per_check)
    # each device counted its own requests; the loop ran the same steps on all of them, and a
    # device's steps with a live request are a prefix of those: the run's steps are the most
    per_device = jax.tree.map(to_host, state.stats)
    stats = jax.tree.map(lambda x: x.sum(0), per_device).replace(steps=per_device.steps.max(0))
    return state.replace(stats=stats)
