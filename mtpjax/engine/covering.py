"""Serving a step with a larger compiled bucket while its own is not compiled yet.

A step program is keyed (shape, F, mode, ...) with shape = (T, R, M): T bucketed query tokens,
R rows, M block-table width, F the bucketed MTP first-pass length (`ModelRunner.dispatch`). A
program for (T', F') with T' >= T and F' >= F (same R, M, mode and any further key element)
serves a step of (T, F) exactly: the extra T' - T tokens are padding tokens, made the way
`ModelRunner.pack` pads up to its own bucket (token 0, position -1, seq_id 0, outside every
row's cu_q_lens segment: no KV write, no row reads them), and F is only the static length of the
first-pass buffer, whose extra entries are padding as well. Background warm-up relies on this
(`engine/background_warmup.py`): the largest bucket is compiled first, in the "filter" mode
only, and serves every step (greedy ones too, `serves_mode`) until the step's own program is
ready.
"""

from __future__ import annotations

import numpy as np

from mtpjax.speculative.mixed_step import MixedBatch


def covering_program(executables: dict, key: tuple):
    """(key', executable) of the smallest compiled program that can serve a step keyed `key`
    = ((T, R, M), F, mode, passes, ...): T' >= T, F' >= F, passes' >= passes (more draft
    passes draw more drafts than the next step verifies: the runner keeps its record of the
    asked count), the same mode or one that `serves_mode` (a "filter" program serves a
    "greedy" step), everything else equal; the fewest tokens first, then the shortest first
    pass, then the fewest passes, then the step's own mode. None when there is none.
    `executables` may gain entries from another thread meanwhile: this reads a copy
    (`dict.copy` runs without releasing the GIL, so the copy is never taken mid-insert)."""
    (T, R, M), F, mode, rest = key[0], key[1], key[2], key[4:]
    passes = key[3] if len(key) > 3 else None
    best = None
    for cand, compiled in executables.copy().items():
        (T2, R2, M2), F2 = cand[0], cand[1]
        p2 = cand[3] if len(cand) > 3 else None
        if ((R2, M2) == (R, M) and serves_mode(cand[2], mode) and cand[4:] == rest
                and T2 >= T and F2 >= F
                and (p2 == passes or (None not in (p2, passes) and p2 > passes))):
            order = (T2, F2, p2 or 0, cand[2] != mode)
            if best is None or order < best[0]:
                best = (order, cand, compiled)
    return None if best is None else best[1:]


def serves_mode(program_mode: str, step_mode: str) -> bool:
    """Whether a program compiled for `program_mode` gives a `step_mode` step its exact result:
    its own mode, or "filter" for "greedy" (a greedy row is the one-hot argmax in both, the
    batch layout is the same: `sampling.py`). Background warm-up compiles only the "filter"
    program first, so the first request is served after one compile, not two."""
    return program_mode == step_mode or (program_mode, step_mode) == ("filter", "greedy")


def pad_tokens(batch: MixedBatch, num_tokens: int) -> MixedBatch:
    """`batch` (host numpy) with its token arrays padded to `num_tokens` entries by padding
    tokens (token 0, position -1, seq_id 0), as `ModelRunner.pack` pads to its bucket."""
    T = batch.tokens.shape[0]
    if num_tokens < T:
        raise ValueError(f"cannot pad a step of {T} tokens down to num_tokens={num_tokens}")
    extra = num_tokens - T
    return batch.replace(
        tokens=np.concatenate([batch.tokens, np.zeros(extra, batch.tokens.dtype)]),
        positions=np.concatenate([batch.positions, np.full(extra, -1, batch.positions.dtype)]),
        seq_ids=np.concatenate([batch.seq_ids, np.zeros(extra, batch.seq_ids.dtype)]))
