"""Model runner: packs a SchedulerOutput into a padded, bucketed ragged batch, runs the jitted
mixed step (state donated), and returns each request's committed tokens.

`dispatch` enqueues a step and starts the copy of its one result array to the host; `collect`
waits for it. Decode rows need nothing from earlier results (the device keeps each slot's seq_len,
pending token and drafts), so the engine can dispatch step t+1 before collecting step t.

Buckets: rows are always `max_num_seqs` (+1 scratch slot for padding rows), tokens and the MTP
first pass are padded to powers of two, block tables to a fixed width, so only a handful of
programs are ever compiled.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.cache import init_cache
from mtpjax.config import ModelConfig, SamplingParams, SpecConfig
from mtpjax.engine.covering import covering_program, pad_tokens
from mtpjax.engine.scheduler import SchedulerOutput
from mtpjax.generate import MIN_TOKEN_BUCKET, bucket_size
from mtpjax.model.backend import resolve_backend
from mtpjax.model.fused import fuse_projections as fuse, fusion_groups
from mtpjax.parallel import check_mesh, create_sharded, replicate, shard_params
from mtpjax.parallel.sharding import pin, pin_replicated
from mtpjax.engine.penalty_history import PenaltyHistory
from mtpjax.sampling import (FEATURE_MODES, LOGIT_BIAS_SLOTS, PENALTY_FIELDS, PENALTY_MODES,
                             SAMPLING_MODES, SamplingArrays, feature_arrays, penalty_arrays,
                             request_key, sampling_mode, top_p_array)
from mtpjax.speculative.draft import draft_shape
from mtpjax.speculative.draft_vocab import attach as attach_draft_vocab
from mtpjax.speculative.mixed_step import (KIND_CHUNK, KIND_DECODE, KIND_LAST_CHUNK, KIND_PAD,
                                           KIND_RESUME, MixedBatch, SlotState, mixed_step)
from mtpjax.speculative.rules.registry import acceptance_rule
from mtpjax.step_jit import step_jit
from mtpjax.structured.bitmask import bitmask_width
from mtpjax.structured.matcher import batch_step_masks


def pack_host(batch: MixedBatch) -> np.ndarray:
    """MixedBatch of numpy arrays -> one flat int32 array (one host->device transfer per step;
    floats and PRNG keys travel bit-cast). A batch in a FEATURE_MODES mode appends its logit
    processors (min_p, logit_bias); any other batch has exactly the layout it had before them."""
    per_token = np.stack([batch.tokens, batch.positions, batch.seq_ids])             # [3, T]
    per_row = np.concatenate([
        batch.cu_q_lens[1:, None], batch.kv_lens[:, None], batch.slots[:, None],
        batch.kinds[:, None], batch.thinking[:, None].astype(np.int32), batch.hist_from[:, None],
        batch.sampling.top_k[:, None], batch.num_drafts[:, None],
        batch.want_logprobs[:, None].astype(np.int32), batch.next_tokens],
        axis=1).astype(np.int32)                                                     # [R, 10+K]
    floats = np.stack([batch.sampling.temperature, batch.sampling.top_p], 1).astype(np.float32)
    keys = np.ascontiguousarray(batch.sampling.keys, np.uint32)                       # [R, 2]
    parts = [per_token.ravel(), per_row.ravel(),
             np.ascontiguousarray(batch.block_tables, np.int32).ravel(),
             floats.view(np.int32).ravel(), keys.view(np.int32).ravel()]
    sp = batch.sampling
    if sp.mode in FEATURE_MODES:                                     # [R, 1 + 2 * SLOTS]
        fl = np.concatenate([np.asarray(sp.min_p, np.float32)[:, None],
                             np.asarray(sp.bias_vals, np.float32)], 1)
        parts += [np.concatenate([fl.view(np.int32), np.asarray(sp.bias_ids, np.int32)],
                                 1).ravel()]
    if sp.mode in PENALTY_MODES:                                     # [R, 3] penalties
        pen = np.stack([np.asarray(getattr(sp, f), np.float32) for f in PENALTY_FIELDS], 1)
        parts += [pen.view(np.int32).ravel()]
    if sp.token_bitmask is not None:       # structured output: [R, K+1, W], always last
        parts.append(np.ascontiguousarray(sp.token_bitmask, np.int32).ravel())
    return np.concatenate(parts)


def unpack_device(flat, *, num_tokens: int, num_rows: int, max_blocks: int,
                  sampling_mode: str = "filter", bitmask_shape=None) -> MixedBatch:
    """Inverse of pack_host, inside the jitted step (static slices and bit-casts are free).
    bitmask_shape (J, W): the batch carries structured-output bitmasks [R, J, W] (last)."""
    T, R, M = num_tokens, num_rows, max_blocks
    S = LOGIT_BIAS_SLOTS
    sizes = [3 * T, None, R * M, 2 * R, 2 * R]
    if sampling_mode in FEATURE_MODES:
        sizes.append(R * (1 + 2 * S))
    if sampling_mode in PENALTY_MODES:
        penalties_at = len(sizes)
        sizes.append(R * len(PENALTY_FIELDS))
    if bitmask_shape is not None:
        sizes.append(R * bitmask_shape[0] * bitmask_shape[1])
    sizes[1] = flat.shape[0] - sum(x for x in sizes if x is not None)
    parts, off = [], 0
    for n in sizes:
        parts.append(flat[off:off + n])
        off += n
    per_token = parts[0].reshape(3, T)
    per_row = parts[1].reshape(R, -1)
    tables = parts[2].reshape(R, M)
    floats = jax.lax.bitcast_convert_type(parts[3].reshape(R, 2), jnp.float32)
    keys = jax.lax.bitcast_convert_type(parts[4].reshape(R, 2), jnp.uint32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), per_row[:, 0]])   # column 0: segment ends
    extra = {}
    if sampling_mode in FEATURE_MODES:
        feats = parts[5].reshape(R, 1 + 2 * S)
        fl = jax.lax.bitcast_convert_type(feats[:, :1 + S], jnp.float32)
        extra = dict(min_p=fl[:, 0], bias_vals=fl[:, 1:], bias_ids=feats[:, 1 + S:])
    if sampling_mode in PENALTY_MODES:
        pen = jax.lax.bitcast_convert_type(parts[penalties_at].reshape(R, len(PENALTY_FIELDS)),
                                           jnp.float32)
        extra.update({f: pen[:, i] for i, f in enumerate(PENALTY_FIELDS)})
    if bitmask_shape is not None:
        extra["token_bitmask"] = parts[-1].reshape((R,) + tuple(bitmask_shape))
    return MixedBatch(
        tokens=per_token[0], positions=per_token[1], seq_ids=per_token[2],
        cu_q_lens=cu, kv_lens=per_row[:, 1], block_tables=tables, slots=per_row[:, 2],
        kinds=per_row[:, 3], thinking=per_row[:, 4].astype(bool), hist_from=per_row[:, 5],
        next_tokens=per_row[:, 9:], num_drafts=per_row[:, 7],
        want_logprobs=per_row[:, 8].astype(bool),
        sampling=SamplingArrays(temperature=floats[:, 0], top_k=per_row[:, 6],
                                top_p=floats[:, 1], keys=keys, mode=sampling_mode, **extra))


@step_jit(static_argnames=("cfg", "spec", "first_pass_len", "backend", "shape", "logprobs",
                           "sampling_mode", "structured", "draft_passes"),
          donate_argnames=("state",))
def _step(params, cfg, spec, state, flat_inputs, *, first_pass_len, backend, shape, logprobs=0,
          sampling_mode="filter", structured=False, draft_passes=None):
    """structured (static): the batch has a structured-output row; its inputs end with the
    token bitmasks and its result with each row's new drafts (the host builds the next step's
    masks along them). A batch without one compiles exactly the program it did before.
    draft_passes (static): draft passes for the next step (`mixed_step`); None = K."""
    T, R, M = shape
    K = draft_shape(spec)[0]
    batch = unpack_device(flat_inputs, num_tokens=T, num_rows=R, max_blocks=M,
                          sampling_mode=sampling_mode,
                          bitmask_shape=(K + 1, bitmask_width(cfg.vocab_size)) if structured
                          else None)
    out = mixed_step(params, cfg, spec, state, batch, first_pass_len=first_pass_len,
                     backend=backend, logprobs=logprobs,
                     draft_passes=None if draft_passes == K else draft_passes)
    state, acc, num = out[:3]
    parts = [acc, num[:, None]]
    if logprobs:          # [R, J] + [R, J*n] + [R, J*n], floats bit-cast: still one array
        lp = out[3]
        f2i = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32).reshape(R, -1)  # noqa: E731
        parts += [f2i(lp.chosen), f2i(lp.top_values), lp.top_ids.reshape(R, -1)]
    if structured and K:                                           # [R, K] drafts, last
        parts.append(state.drafts[batch.slots])
    result = jnp.concatenate(parts, axis=1)                        # one array to read back
    return pin(state, cfg, backend.mesh), pin_replicated(result, backend.mesh)


class ModelRunner:
    def __init__(self, params, cfg: ModelConfig, spec: SpecConfig | None, *, num_pages: int,
                 page_size: int, max_num_seqs: int, max_blocks_per_seq: int, seed: int = 0,
                 attention_impl="auto", cache_dtype=None, max_logprobs: int = 0, mesh=None,
                 draft_vocab=None, executable_store=None, fuse_projections: bool | str = False,
                 min_token_bucket: int = MIN_TOKEN_BUCKET):
        self.params, self.cfg, self.spec = params, cfg, spec
        # the smallest step bucket (T and F): 8 keeps the compiled programs few; 1 lets a
        # batch-1 decode run unpadded
        self.min_bucket = min_token_bucket
        self.max_logprobs = max_logprobs              # n compiled into the step (0: no logprobs)
        self.K, self.W = draft_shape(spec)
        self.max_num_seqs = max_num_seqs
        self.page_size = page_size
        self.max_blocks = max_blocks_per_seq
        self.mesh = check_mesh(mesh)            # None: one device; else the sharding table's
        self.backend = resolve_backend(attention_impl, mesh=self.mesh)
        if self.mesh is not None:
            self.params = params = shard_params(params, cfg, self.mesh)
        groups = fusion_groups(fuse_projections)
        if groups:                  # after placement: the table describes the unfused tree
            self.params = params = fuse(params, cfg, groups)
        # draft_vocab: checked host ids int32[N] (draft_vocab.resolve_ids) or None
        self.params = params = attach_draft_vocab(params, draft_vocab, self.mesh)
        self.seed = seed
        self.num_pages, self.dtype = num_pages, cache_dtype or params["embed"].dtype
        self.num_slots = max_num_seqs + 1                 # last slot: scratch for padding rows
        # (shape, F, sampling mode, draft passes) -> compiled step, filled by warmup;
        # ExecutableStore or None
        self.executables: dict = {}
        self.warming = None            # a running BackgroundWarmup (engine/background_warmup.py)
        # draft passes warm-up compiles (K; every 0..K when the engine adapts k: `LLM`)
        self.warm_passes: tuple[int, ...] = (self.K,)
        # sampling modes warm-up compiles (background warm-up's first program: "filter" only)
        self.warm_modes: tuple[str, ...] = SAMPLING_MODES
        # seq_id -> drafts the request's slot holds for its next verify (the passes of the
        # last step that drafted for it): a row never verifies more (`verify_counts`)
        self.drafted: dict[int, int] = {}
        self.compiled_keys: set = set()      # programs run at least once (their compile done)
        self.last_step_compiled = False      # did the last dispatch compile or pad up?
        self.num_compiles = 0                # dispatches that traced and compiled a step
        self.last_program = None             # the last dispatch's program (see dispatch)
        self.store = executable_store
        self.load_seconds = 0.0          # warmup's wait for the store's loads
        # the penalties' per-slot token history (device), made when a penalty batch first runs
        self.penalties = PenaltyHistory(cfg.vocab_size, self.num_slots, self.mesh)
        self.reset_state()

    def reset_state(self) -> None:
        """A fresh paged cache and slot state, every slot free. Also how the engine recovers when
        a step's donated state never came back (an exception between dispatch and return)."""
        self.state = None                                 # free the old buffers first
        make = lambda: SlotState.create(  # noqa: E731
            self.cfg, self.spec, init_cache(self.cfg, self.num_pages, self.page_size, self.dtype),
            self.num_slots, self.dtype)
        self.state = make() if self.mesh is None else create_sharded(make, self.cfg, self.mesh)
        self.penalties.reset()
        self.release_all()

    # ---- slots ---------------------------------------------------------------------------------
    def release_all(self) -> None:
        """Frees every slot (engine recovery: no request keeps device draft state)."""
        self.free_slots = list(range(self.max_num_seqs))
        self.slot_of: dict[int, int] = {}                 # seq_id -> slot
        self.hist_from: dict[int, int] = {}               # seq_id -> first self-computed position
        self.keys: dict[int, np.ndarray] = {}             # seq_id -> uint32[2] PRNG key (host)
        self.drafted = {}

    def release(self, seq_id: int) -> None:
        """Frees a finished or preempted request's slot (its device draft state is dropped)."""
        slot = self.slot_of.pop(seq_id, None)
        self.hist_from.pop(seq_id, None)
        self.keys.pop(seq_id, None)
        self.drafted.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _slot(self, req) -> int:
        sid = req.seq_id
        if sid not in self.slot_of:
            if not self.free_slots:
                raise RuntimeError("no free engine slot: more running requests than max_num_seqs")
            self.slot_of[sid] = self.free_slots.pop(0)
            self.hist_from[sid] = req.start_position
            # once per residency, not per step
            self.keys[sid] = request_key(req.seq.sampling_params or SamplingParams(), self.seed,
                                         req.seq.seq_id)
        return self.slot_of[sid]

    # ---- packing -------------------------------------------------------------------------------
    def verify_counts(self, out: SchedulerOutput, ks) -> list[int]:
        """ks (drafts each scheduled request would verify) clipped, for decodes, to the drafts
        its slot holds: the last step that drafted for it may have run fewer passes."""
        return [k if req.is_prefill else min(k, self.drafted.get(req.seq_id, self.K))
                for req, k in zip(out.requests, ks)]

    def pack(self, out: SchedulerOutput, num_drafts=None) -> tuple[MixedBatch, int]:
        """Host (numpy) MixedBatch for one scheduled step, and the first-pass bucket.
        num_drafts: drafts each request's decode verifies this step (default: its
        SamplingParams.num_speculative_tokens, else K), at most the drafts its slot holds
        (`verify_counts`; more would verify drafts that were never drawn)."""
        K, R = self.K, self.max_num_seqs
        reqs = out.requests
        if len(reqs) > R:
            raise ValueError(f"step has {len(reqs)} requests, more than max_num_seqs={R}")
        row_ks = [self._row_k(req, i, num_drafts) for i, req in enumerate(reqs)]
        for req, k in zip(reqs, row_ks):           # before any slot is taken
            held = self.drafted.get(req.seq.seq_id, K)
            if not req.is_prefill and k > held:
                raise ValueError(f"request {req.seq.seq_id} would verify {k} drafts, but its "
                                 f"last step drew {held} (ModelRunner.verify_counts clips)")
        q = [self._query_tokens(req, k) for req, k in zip(reqs, row_ks)]
        T = bucket_size(sum(q), self.min_bucket)
        tokens = np.zeros(T, np.int32)
        positions = np.full(T, -1, np.int32)
        seq_ids = np.zeros(T, np.int32)
        cu = np.zeros(R + 1, np.int32)
        kv_lens = np.zeros(R, np.int32)
        tables = np.zeros((R, self.max_blocks), np.int32)
        slots = np.full(R, self.num_slots - 1, np.int32)
        kinds = np.full(R, KIND_PAD, np.int32)
        next_tokens = np.full((R, K + 1), -1, np.int32)
        thinking = np.zeros(R, bool)
        hist_from = np.zeros(R, np.int32)
        temp = np.zeros(R, np.float32)
        top_k = np.zeros(R, np.int32)
        top_p = np.ones(R, np.float32)
        keys = np.zeros((R, 2), np.uint32)
        row_k = np.zeros(R, np.int32)
        want_lp = np.zeros(R, bool)
        row_sps = [None] * R                   # for the logit processors (padding rows: None)
        off = 0
        first_pass = 0
        for i, req in enumerate(reqs):
            seq, n = req.seq, q[i]
            s = req.start_position
            seq_ids[off:off + n] = i
            if req.is_prefill:
                positions[off:off + n] = np.arange(s, s + n)
                tokens[off:off + n] = req.token_ids
                kinds[i] = (KIND_LAST_CHUNK if req.is_last_chunk else
                            KIND_RESUME if getattr(req, "is_resume", False) else KIND_CHUNK)
                after = seq.token_ids[s + n:s + n + K + 1]
                next_tokens[i, :len(after)] = after
                first_pass += max(self.W, n)
                flag_after = (None if self.spec is None else
                              acceptance_rule(self.spec.acceptance).slot_flag)
                if flag_after is not None:   # the rule's per-slot flag (relaxed: thinking)
                    # a resume row's flag includes its pending token (a decode's state does)
                    upto = s + n + (1 if kinds[i] == KIND_RESUME else 0)
                    thinking[i] = flag_after(seq.token_ids[:upto], self.spec)
                kv_lens[i] = s + n
            else:
                # positions, tokens and kv_len come from the slot's device state
                positions[off:off + n] = 0
                kinds[i] = KIND_DECODE
                first_pass += n if self.decode_tokens else self.W
            off += n
            cu[i + 1] = off
            if len(seq.block_table) > self.max_blocks:
                raise ValueError(f"request {seq.seq_id} holds {len(seq.block_table)} blocks, more "
                                 f"than the runner's max_blocks_per_seq={self.max_blocks}")
            tables[i, :len(seq.block_table)] = seq.block_table
            new_residency = seq.seq_id not in self.slot_of
            slots[i] = self._slot(req)
            hist_from[i] = self.hist_from[seq.seq_id]
            sp = seq.sampling_params or SamplingParams()
            if new_residency and sp.has_penalties:   # its history, once per residency
                self.penalties.seed(int(slots[i]), seq.token_ids, seq.num_prompt_tokens)
            row_sps[i] = sp
            temp[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, top_p_array(sp.top_p)
            keys[i] = self.keys[seq.seq_id]
            row_k[i] = row_ks[i]
            want_lp[i] = sp.logprobs is not None
        cu[len(reqs) + 1:] = off
        sampling = self._sampling(temp, top_k, top_p, keys, row_sps)
        if any(getattr(req.seq, "grammar", None) is not None for req in reqs):
            sampling = sampling.replace(token_bitmask=self._grammar_masks(reqs, kinds, row_k))
        batch = MixedBatch(
            tokens=tokens, positions=positions, seq_ids=seq_ids, cu_q_lens=cu, kv_lens=kv_lens,
            block_tables=tables, slots=slots, kinds=kinds, next_tokens=next_tokens,
            thinking=thinking, hist_from=hist_from, num_drafts=row_k, want_logprobs=want_lp,
            sampling=sampling)
        return batch, bucket_size(first_pass, self.min_bucket)

    @property
    def decode_tokens(self) -> int | None:
        """A decode row's most query tokens when rows are packed as wide as the drafts they
        verify (chain drafting: K + 1 = W), else None (every decode row K + 1 tokens, W
        first-pass entries: multi_layer, or no speculation)."""
        return self.K + 1 if self.K and self.spec.method == "chain" else None

    def _row_k(self, req, i: int, num_drafts) -> int:
        """Drafts row i verifies (prefill rows: what their SamplingParams ask, unused)."""
        if num_drafts is not None:
            return int(num_drafts[i])
        sp = req.seq.sampling_params or SamplingParams()
        return self.K if sp.num_speculative_tokens is None else sp.num_speculative_tokens

    def _query_tokens(self, req, k: int) -> int:
        """Row tokens: a chunk's own; a decode's k + 1 when decode rows are ragged (its
        verify and first pass then cost only the drafts it checks), else K + 1."""
        if req.is_prefill or not self.decode_tokens:
            return req.num_query_tokens
        return min(max(k, 0), self.K) + 1

    def _grammar_masks(self, reqs, kinds, row_k) -> np.ndarray:
        """Structured output: the step's token bitmasks int32[R, K+1, W], all ones except
        where a grammar row samples (a decode's verify window along its drafts, a last chunk's
        first token). A decode verifies only its drafts the grammar accepts (row_k is lowered
        in place): the rest could never be committed, whatever the acceptance rule. Its drafts
        are those the previous step returned (`record_drafts`): the engine reads a step with
        a grammar row back before it schedules the next one."""
        K = self.K
        masks = np.full((self.max_num_seqs, K + 1, bitmask_width(self.cfg.vocab_size)), -1,
                        np.int32)
        rows, items = [], []
        for i, req in enumerate(reqs):
            g = getattr(req.seq, "grammar", None)
            if g is None or kinds[i] not in (KIND_DECODE, KIND_LAST_CHUNK):
                continue
            completion = req.seq.completion_token_ids
            drafts = []
            if kinds[i] == KIND_DECODE and K:
                if g.drafts_at != len(completion):
                    raise RuntimeError(f"request {req.seq.seq_id}: its drafts were read after "
                                       f"{g.drafts_at} completion tokens, it has "
                                       f"{len(completion)}; a step with a grammar row must be "
                                       "read back before the next is scheduled")
                drafts = g.drafts[:row_k[i]]
            rows.append(i)
            items.append((g, completion, drafts))
        if items:                      # every grammar row's masks in one batched fill per depth
            got, n_valid = batch_step_masks(items, K + 1)
            for r, (i, n) in enumerate(zip(rows, n_valid.tolist())):
                masks[i] = got[r]
                if kinds[i] == KIND_DECODE:
                    row_k[i] = min(row_k[i], n)
        return masks

    def record_drafts(self, out: SchedulerOutput, result) -> None:
        """After a structured step's readback: each grammar request's drafts for its next
        verify step (the result's last K columns)."""
        if not self.K:
            return
        drafts = np.asarray(result)[:, -self.K:]
        for i, req in enumerate(out.requests):
            g = getattr(req.seq, "grammar", None)
            if g is not None:
                g.drafts = drafts[i].copy()
                g.drafts_at = req.seq.num_completion_tokens

    @staticmethod
    def _sampling(temp, top_k, top_p, keys, row_sps) -> SamplingArrays:
        """The batch's SamplingArrays (numpy) in the mode its rows need (`sampling_mode`); the
        logit processors' arrays only in a mode that reads them."""
        mode = sampling_mode(temp, row_sps)
        extra = {}
        if mode in FEATURE_MODES:
            extra = dict(zip(("min_p", "bias_ids", "bias_vals"), feature_arrays(row_sps)))
        if mode in PENALTY_MODES:
            extra.update(zip(PENALTY_FIELDS, penalty_arrays(row_sps)))
        return SamplingArrays(temperature=temp, top_k=top_k, top_p=top_p, keys=keys, mode=mode,
                              **extra)

    def device_inputs(self, batch: MixedBatch, for_call: bool = False):
        """The packed batch as one array on the device(s), and the static shape (T, R, M) to
        unpack it. for_call: the array is only passed to the step (not lowered, nor looked
        up in the store), so on one device it stays numpy: the step's call moves it in C++,
        where `jax.device_put` cost ~50 us more host time per step (CPU-timed), and a batch-1
        step is bound by host work."""
        shape = (batch.tokens.shape[0], batch.kinds.shape[0], batch.block_tables.shape[1])
        flat = pack_host(batch)
        if self.mesh is not None:
            return replicate(flat, self.mesh), shape
        return (flat if for_call else jax.device_put(flat)), shape

    def dispatch(self, out: SchedulerOutput, num_drafts=None, passes: int | None = None
                 ) -> jax.Array:
        """Enqueues one step; returns its result array (int32[R, K+2], then the logprobs when
        max_logprobs > 0) already copying to host. num_drafts: as for `pack`. passes: draft
        passes for the next step (0..K, chain only; default K), each a compiled variant; the
        requests that draft this step may verify at most that many drafts next. The step holds
        no device-side branch, so this returns as soon as it is enqueued."""
        passes = self.K if passes is None else int(passes)
        if passes != self.K and (not 0 <= passes <= self.K or self.spec.method != "chain"):
            raise ValueError(f"draft passes must be 0..K={self.K} (chain drafting; otherwise "
                             f"K), got passes={passes}")
        batch, F = self.pack(out, num_drafts)
        mode = batch.sampling.mode        # pack's pick: its layout holds what the mode reads
        structured = batch.sampling.token_bitmask is not None    # compiled on first use
        compiled = None
        own_key = ((batch.tokens.shape[0], batch.kinds.shape[0], batch.block_tables.shape[1]),
                   F, mode, passes)
        if not structured:
            batch, F, compiled, _ = self._compiled_for(batch, F, mode, passes)
        inputs, shape = self.device_inputs(batch, for_call=True)
        key = (shape, F, mode, passes, structured)
        # a step that compiled, or ran a program other than its own (while warming: a larger
        # bucket, more draft passes, or a "filter" program serving a greedy step), took longer
        # than its own program will (adaptive K's step times skip it)
        compiles = compiled is None and key not in self.compiled_keys
        self.num_compiles += compiles
        self.last_step_compiled = compiles or (
            compiled is not None and compiled is not self.executables.get(own_key))
        self.compiled_keys.add(key)
        # the program this step runs (a covering one while warming): a step whose program
        # differs from the one before it may pay for the switch (adaptive K's timing)
        self.last_program = key if compiled is None else id(compiled)
        if compiled is not None:                 # warmed up: no tracing, not even a cache lookup
            self.state, result = compiled(self.params, self.state, inputs)
        elif mode in PENALTY_MODES:              # the step carries the token history too
            state, result = _step(self.params, self.cfg, self.spec,
                                  self.state.replace(history=self.penalties.take()), inputs,
                                  **self._static(F, shape, mode, passes),
                                  **(dict(structured=True) if structured else {}))
            self.penalties.put(state.history)
            self.state = state.replace(history=None)
        else:
            extra = dict(structured=True) if structured else {}
            self.state, result = _step(self.params, self.cfg, self.spec, self.state, inputs,
                                       **self._static(F, shape, mode, passes), **extra)
        for req, kind in zip(out.requests, batch.kinds):
            if kind in (KIND_DECODE, KIND_LAST_CHUNK, KIND_RESUME):     # rows that drafted
                self.drafted[req.seq_id] = passes
        result.copy_to_host_async()                        # the step's only device->host copy
        return result

    def _compiled_for(self, batch: MixedBatch, F: int, mode: str, passes: int):
        """(batch, F, executable, passes it runs) to run a packed step with: its own bucket's
        program; else, while background warm-up has not compiled that one yet, the smallest
        compiled larger bucket's (or one with more draft passes) with the batch padded up to
        it (`engine/covering.py`: same tokens); else (batch, F, None, passes): `_step`
        compiles it (also a bucket whose background compile failed, once the warm-up is
        over)."""
        shape = (batch.tokens.shape[0], batch.kinds.shape[0], batch.block_tables.shape[1])
        compiled = self.executables.get((shape, F, mode, passes))
        if compiled is not None or self.warming is None or self.warming.done():
            return batch, F, compiled, passes
        found = covering_program(self.executables, (shape, F, mode, passes))
        if found is None:
            return batch, F, None, passes
        ((T_cover, _, _), F_cover, _, passes_cover, *_), compiled = found
        return pad_tokens(batch, T_cover), F_cover, compiled, passes_cover

    def _static(self, F: int, shape: tuple, mode: str, passes: int | None = None) -> dict:
        """The step's static keyword arguments (cfg and spec are positional)."""
        return dict(first_pass_len=F, backend=self.backend, shape=shape,
                    logprobs=self.max_logprobs, sampling_mode=mode,
                    draft_passes=self.K if passes is None else passes)

    def warmup(self, buckets, on_compiled=None, threads: int = 1, load_threads: int = 1) -> None:
        """Compiles the step for every (T, F) in `buckets` (`engine.warmup.step_buckets`) and
        every sampling mode in `warm_modes` (default `sampling.SAMPLING_MODES`) before
        serving, so no step compiles mid-serving; `dispatch` then calls these executables
        directly. With an executable store (`self.store`, `engine/executable_store.py`) a
        program compiled by an earlier process is loaded instead of traced; loads run on a
        pool of `load_threads` threads. The rest are lowered here and compiled on a pool of
        `threads` threads (then stored).
        Each bucket gets a dry run on an all-padding batch: every row is a KIND_PAD row in the
        scratch slot at position -1, so it writes no KV and changes no real slot (the donated
        state comes back with the same meaning). on_compiled(T, F, seconds) after each bucket
        (its wait for load or compile plus the dry runs, over the modes), in order."""
        import time
        from concurrent.futures import ThreadPoolExecutor

        empty, _ = self.pack(SchedulerOutput([], [], self.K))
        progs = []                    # (T, F, shape, (mode, passes), inputs, static kwargs)
        for T, F in buckets:
            batch = empty.replace(tokens=np.zeros(T, np.int32), seq_ids=np.zeros(T, np.int32),
                                  positions=np.full(T, -1, np.int32))
            inputs, shape = self.device_inputs(batch)
            progs += [(T, F, shape, (m, p), inputs, self._static(F, shape, m, p))
                      for p in self.warm_passes for m in self.warm_modes]
        with ThreadPoolExecutor(max(threads, 1)) as pool, \
                ThreadPoolExecutor(max(load_threads, 1)) as loads:
            def lookup(inputs, kw):
                return self.store.lookup("engine_step", (self.params, self.state, inputs),
                                         dict(cfg=self.cfg, spec=self.spec, **kw))
            found = [loads.submit(lookup, p[4], p[5]) if self.store is not None else None
                     for p in progs]
            t_load = time.perf_counter()
            results = [fut.result() if fut is not None else (None, None, None) for fut in found]
            self.load_seconds = time.perf_counter() - t_load     # waiting for the store's loads

            def compile_later(inputs, kw):
                lowered = _step.lower(self.params, self.cfg, self.spec, self.state, inputs, **kw)
                return pool.submit(lowered.compile).result if threads > 1 else lowered.compile
            # per program: a function -> its executable (a load, or a compile on the pool)
            pending = [(lambda hit=hit: hit) if hit is not None else compile_later(p[4], p[5])
                       for p, (_, _, hit) in zip(progs, results)]
            per_bucket: dict = {}
            for (T, F, shape, m, inputs, kw), (key, identity, hit), get in \
                    zip(progs, results, pending):
                t0 = time.perf_counter()
                compiled = self._ready(get(), inputs, kw, key, identity, loaded=hit is not None)
                self.executables[(shape, F, *m)] = compiled
                per_bucket[(T, F)] = per_bucket.get((T, F), 0.0) + time.perf_counter() - t0
                if on_compiled is not None and m == (self.warm_modes[-1], self.warm_passes[-1]):
                    on_compiled(T, F, per_bucket[(T, F)])
        request_key(SamplingParams(), self.seed, 0)      # any eager ops it runs compile now

    def background_programs(self, buckets) -> list:
        """What background warm-up (`engine/background_warmup.py`) makes off the serving
        thread: per (T, F) in `buckets`, draft passes in `warm_passes` and mode in
        `SAMPLING_MODES`, (T, F, key, lookup, lower): key is the `self.executables` key
        `warmup` registers; lookup() -> the store's
        (key, identity, stored executable or None), or None without a store; lower() -> the
        step lowered, to compile. Both see only the shapes, dtypes and shardings of the params
        and the state, taken now: the serving thread keeps donating the state, and the
        closures keep no reference to the runner or its device arrays."""
        def abstract(x):
            if not hasattr(x, "sharding"):
                return x
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                        weak_type=getattr(x, "weak_type", False))
        params, state = jax.tree.map(abstract, self.params), jax.tree.map(abstract, self.state)
        cfg, spec, store = self.cfg, self.spec, self.store
        empty, _ = self.pack(SchedulerOutput([], [], self.K))
        programs = []
        for T, F in buckets:
            batch = empty.replace(tokens=np.zeros(T, np.int32), seq_ids=np.zeros(T, np.int32),
                                  positions=np.full(T, -1, np.int32))
            inputs, shape = self.device_inputs(batch)
            for p in self.warm_passes:
                for m in SAMPLING_MODES:
                    kw = self._static(F, shape, m, p)

                    def lookup(inputs=inputs, kw=kw):
                        return None if store is None else store.lookup(
                            "engine_step", (params, state, inputs),
                            dict(cfg=cfg, spec=spec, **kw))

                    def lower(inputs=inputs, kw=kw):
                        return _step.lower(params, cfg, spec, state, inputs, **kw)
                    programs.append((T, F, (shape, F, m, p), lookup, lower))
        return programs

    def _dry_run(self, compiled, inputs) -> None:
        self.state, result = compiled(self.params, self.state, inputs)
        jax.block_until_ready(result)

    def _ready(self, compiled, inputs, kw, key, identity, loaded: bool):
        """The executable to serve one warmed-up program with, after its dry run on `inputs`.
        With a store, what runs the dry run is what the store holds: a loaded entry, or the
        fresh compile loaded back from its own bytes (saved only once that ran). A copy that
        fails to run is refused (deleted, one warning) and the compile serves instead, after
        a fresh state (the failed call may have consumed the donated one; warm-up runs before
        any request, so nothing is lost)."""
        if self.store is None:
            self._dry_run(compiled, inputs)
            return compiled
        if loaded:
            try:
                self._dry_run(compiled, inputs)
                return compiled
            except Exception as e:                   # noqa: BLE001 (any failure: recompile)
                self.store.refuse(key, f"its first run failed: {type(e).__name__}: "
                                       f"{str(e)[:200]}")
                self.store.count_refused_hit()
                self.reset_state()
                compiled = _step.lower(self.params, self.cfg, self.spec, self.state, inputs,
                                       **kw).compile()
        serialized = self.store.serialized(compiled)
        if serialized is not None:
            bytes_, copy = serialized
            try:
                self._dry_run(copy, inputs)
                self.store.save(key, identity, bytes_)
                return copy
            except Exception:                        # noqa: BLE001
                # e.g. XLA:CPU re-serializing a step that JAX's persistent cache served: the
                # copy loads but cannot run; the compile itself runs, unstored
                self.store.unstored += 1
                self.reset_state()
        self._dry_run(compiled, inputs)
        return compiled

    def collect(self, out: SchedulerOutput, result: jax.Array) -> list[list[int]]:
        """Waits for a dispatched step; each scheduled request's committed tokens (before the
        scheduler's stop / max_tokens truncation)."""
        result = np.asarray(result)
        J = self.K + 1
        return [result[i, :result[i, J]].tolist() for i in range(len(out.requests))]

    def logprobs(self, result: jax.Array, rows: list[int]) -> tuple:
        """The step's logprob arrays for the scheduled requests `rows` (their indices in the
        step), copied out of its result so a request keeps only the rows that asked: (chosen
        f32[A, J], top ids int32[A, J, n], top values f32[A, J, n]), A = len(rows), J = K + 1,
        n = max_logprobs. Three array copies per step, no per-request Python
        (`TokenLogprobs.append_step` keeps them with the request's row)."""
        J, n = self.K + 1, self.max_logprobs
        sel = np.asarray(result)[np.asarray(rows, np.int64)]
        return (sel[:, J + 1:2 * J + 1].view(np.float32),
                sel[:, 2 * J + 1 + J * n:2 * J + 1 + 2 * J * n].reshape(-1, J, n),
                sel[:, 2 * J + 1:2 * J + 1 + J * n].view(np.float32).reshape(-1, J, n))
