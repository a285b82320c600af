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

Batch use: `generate` / `generate_stream` (requests assigned per call, by prompt + max new
tokens). Online use: `add_request` (to the replica with the fewest unfinished requests), `step`
(every replica with work, in turn), `abort`, `get_output` — as `LLM`'s, with Sequences as
handles since request ids are per replica. `generate_stream`'s events (and their outputs) carry
a DataParallelLLM-wide id, `replica id * d + replica`, which `abort` accepts too. One process:
replicas use its local devices.

Outputs equal a single engine's for greedy requests and for sampled ones with an explicit
`SamplingParams(seed=...)` (a request's key depends only on its seed); a sampled request without
a seed gets a key from its replica's seed and request id, as in any engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax
import numpy as np

from mtpjax.config import SamplingParams
from mtpjax.engine.intake import prompt_list
from mtpjax.engine.llm import LLM, RequestOutput, StreamEvent, collect_outputs, load_for_engine
from mtpjax.parallel.mesh import make_mesh
from mtpjax.engine.sequence import Sequence
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
        devices = list(jax.local_devices() if devices is None else devices)
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
        self._held: list[list] = [[] for _ in self.replicas]    # add_request's open requests
        self._replica_of: dict[int, int] = {}                    # id(Sequence) -> replica

    @classmethod
    def from_pretrained(cls, path: str, spec=None, *, data_parallel: int,
                        tensor_parallel: int = 1, dtype=None, devices=None,
                        **llm_kwargs) -> "DataParallelLLM":
        """Replicas over a Hugging Face or Orbax folder, read once (as `LLM.from_pretrained`:
        the folder's tokenizer, eos id and draft vocabulary unless given)."""
        params, cfg, llm_kwargs = load_for_engine(path, spec, dtype, None, llm_kwargs)
        return cls(params, cfg, spec, data_parallel=data_parallel,
                   tensor_parallel=tensor_parallel, devices=devices, **llm_kwargs)

    # ---- online use: one request at a time (a server's loop) -----------------------------------
    def add_request(self, prompt, sampling_params: SamplingParams | None = None):
        """Queues one request on the replica with the fewest unfinished requests (ties: the
        lowest) and returns its Sequence (ids are per replica: pass the Sequence itself to
        abort / get_output). Errors as `LLM.add_request`; nothing changes on error."""
        r = min(range(len(self.replicas)),
                key=lambda i: (sum(not q.is_finished for q in self._held[i]), i))
        seq = self.replicas[r].add_request(prompt, sampling_params)
        self._held[r].append(seq)
        self._replica_of[id(seq)] = r
        return seq

    def step(self) -> list:
        """One step of every replica that holds requests; (Sequence, new tokens) pairs as
        `LLM.step` (a finished Sequence appears once, then is forgotten here too)."""
        out = []
        for r, replica in enumerate(self.replicas):
            if self._held[r]:
                out += replica.step()
        for seq, _ in out:
            if seq.is_finished:
                self._forget(seq)
        return out

    def abort(self, request) -> RequestOutput:
        """Stops a request as `LLM.abort` does: a Sequence from `add_request`, or the id a
        `generate_stream` event (or its output) carries. Unknown or finished requests raise
        ValueError and nothing changes."""
        if isinstance(request, Sequence):
            out = self._replica(request).abort(request)
            self._forget(request)
            return out
        if isinstance(request, bool) or not isinstance(request, (int, np.integer)) \
                or request < 0:
            raise ValueError(f"abort takes a Sequence (from add_request) or a request id >= 0 "
                             f"(from a generate_stream event), got {request!r}")
        d = len(self.replicas)
        r, rid = int(request) % d, int(request) // d
        try:
            out = self.replicas[r].abort(rid)
        except ValueError as e:
            raise ValueError(f"cannot abort request {request} (replica {r}'s request {rid}): "
                             f"{e}") from None
        for seq in self._held[r]:
            if seq.seq_id == rid:
                self._forget(seq)
                break
        return dataclasses.replace(out, request_id=self._global_id(r, out.request_id))

    def _global_id(self, replica: int, request_id: int) -> int:
        """A replica's request id as a DataParallelLLM-wide one (unique across replicas)."""
        return request_id * len(self.replicas) + replica

    def get_output(self, seq) -> RequestOutput:
        return self._replica(seq).get_output(seq)

    def has_unfinished_requests(self) -> bool:
        return any(self._held)

    def _replica(self, seq) -> LLM:
        r = self._replica_of.get(id(seq))
        if r is None:
            raise ValueError(f"{seq!r} is not a request this DataParallelLLM holds (pass the "
                             "Sequence add_request returned; ids are per replica)")
        return self.replicas[r]

    def _forget(self, seq) -> None:
        r = self._replica_of.pop(id(seq), None)
        if r is not None:
            self._held[r] = [q for q in self._held[r] if q is not seq]

    # ---- bookkeeping ----------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps of the busiest replica (replicas step side by side)."""
        return max(r.num_steps for r in self.replicas)

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.replicas)

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
        `prompts`, `request_id` (also the output's) is a DataParallelLLM-wide id that `abort`
        takes: `replica id * d + replica`. Closing the generator early closes
        every replica's stream (their unfinished requests are aborted)."""
        prompts = prompt_list(prompts)
        with self.replicas[0]._engine():      # validates every prompt; queues nothing
            self.replicas[0]._new_requests(prompts, sampling_params)
        sampling = as_sampling_list(sampling_params, len(prompts))
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
                    gid = self._global_id(k, ev.request_id)
                    out = ev.output if ev.output is None else \
                        dataclasses.replace(ev.output, request_id=gid)
                    yield StreamEvent(index[k][ev.request_index], ev.new_token_ids, ev.finished,
                                      out, gid)

    def generate(self, prompts, sampling_params=None, *, progress: bool = False
                 ) -> list[RequestOutput]:
        """Outputs in prompt order (as `LLM.generate`)."""
        prompts = prompt_list(prompts)
        return collect_outputs(self.generate_stream(prompts, sampling_params), len(prompts),
                               progress)
