"""Data-parallel serving: several independent engines, one per group of devices.

`DataParallelLLM(params, cfg, spec, data_parallel=d, tensor_parallel=m)` builds d `LLM`s, replica
r on devices [r*m, (r+1)*m) (a ("data", "model") mesh of (1, m); one device when m = 1). Each
replica has its own weights, page pool, scheduler and slots: nothing is shared and no
collective crosses replicas — the memory a request's KV takes is on its replica only (the
mesh's "data" axis, by contrast, replicates the page pool; docs/parallel.md).

Requests are assigned when they arrive, each to the replica with the fewest prompt + max new
tokens assigned so far in that call (ties: the lowest replica), and all replicas are stepped
from one host thread in turn: a step is dispatched asynchronously (async scheduling), so while
the host packs and reads back replica r, the other replicas' devices run their steps.

Outputs equal a single engine's for greedy requests and for sampled ones with an explicit
`SamplingParams(seed=...)` (a request's key depends only on its seed); a sampled request without
a seed gets a key from its replica's seed and request id, as in any engine.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from mtpjax.config import SamplingParams
from mtpjax.engine.llm import LLM, RequestOutput, StreamEvent, _prompt_list
from mtpjax.parallel.mesh import make_mesh
from mtpjax.sampling import as_sampling_list


class DataParallelLLM:
    """d engines on disjoint device groups, one request stream (see the module docstring)."""

    def __init__(self, params, cfg, spec=None, *, data_parallel: int, tensor_parallel: int = 1,
                 devices=None, **llm_kwargs):
        for name, n in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {name}={n!r}")
        if "mesh" in llm_kwargs:
            raise ValueError("DataParallelLLM places its replicas itself: pass devices=, not "
                             "mesh=")
        devices = list(jax.devices() if devices is None else devices)
        need = data_parallel * tensor_parallel
        if need > len(devices):
            raise ValueError(f"data_parallel={data_parallel} x tensor_parallel={tensor_parallel} "
                             f"needs {need} devices, but {len(devices)} are given")
        self.replicas = [
            LLM(params, cfg, spec, mesh=make_mesh(
                tensor_parallel=tensor_parallel,
                devices=devices[r * tensor_parallel:(r + 1) * tensor_parallel]), **llm_kwargs)
            for r in range(data_parallel)]
        self.cfg, self.spec = cfg, spec

    @property
    def num_steps(self) -> int:
        """Steps of the busiest replica (replicas step side by side)."""
        return max(r.num_steps for r in self.replicas)

    def flush(self) -> None:
        for r in self.replicas:
            r.flush()

    def assign(self, prompts, sampling: list[SamplingParams]) -> list[int]:
        """Replica of each request: the least loaded by prompt + max new tokens, in order."""
        load = [0] * len(self.replicas)
        out = []
        for p, sp in zip(prompts, sampling):
            r = min(range(len(load)), key=lambda i: (load[i], i))
            load[r] += len(p) + (sp.max_tokens or 0)
            out.append(r)
        return out

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[StreamEvent]:
        """StreamEvents of every replica as their tokens commit; `request_index` indexes
        `prompts`, `request_id` is the replica engine's id. Closing the generator early closes
        every replica's stream (their unfinished requests are aborted)."""
        prompts = _prompt_list(prompts)
        sampling = as_sampling_list(sampling_params, len(prompts))
        with self.replicas[0]._engine():      # validates every prompt; queues nothing
            self.replicas[0]._new_requests(prompts, sampling)
        where = self.assign(prompts, sampling)
        index = [[i for i, r in enumerate(where) if r == k] for k in range(len(self.replicas))]
        with contextlib.ExitStack() as stack:
            streams = {}
            for k, idx in enumerate(index):
                if idx:
                    gen = self.replicas[k].generate_stream([prompts[i] for i in idx],
                                                           [sampling[i] for i in idx])
                    streams[k] = stack.enter_context(contextlib.closing(gen))
            while streams:
                for k in list(streams):
                    ev = next(streams[k], None)
                    if ev is None:
                        del streams[k]
                        continue
                    yield StreamEvent(index[k][ev.request_index], ev.new_token_ids, ev.finished,
                                      ev.output, ev.request_id)

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Outputs in prompt order (as `LLM.generate`)."""
        prompts = _prompt_list(prompts)
        outputs: list = [None] * len(prompts)
        with contextlib.closing(self.generate_stream(prompts, sampling_params)) as events:
            for ev in events:
                if ev.finished:
                    outputs[ev.request_index] = ev.output
        return outputs
