"""The engine's per-slot token history for repetition / presence / frequency penalties.

A dense int32[S, V] array on the device (one entry per engine slot and token id: the token's
count in the output, | PROMPT_FLAG when it is in the prompt; `mtpjax.logit_processors`). Why
dense and device-resident, at V ~ 130k and S = 33 (17 MB):

- The host cannot give a step its history: with asynchronous scheduling it packs step t+1
  before it has read step t's tokens. The device can: each penalty step adds its own committed
  tokens to its rows (`mixed_step`), so the history is always exact, whatever the host knows.
- A step uploads nothing per token: the host sends a request's history once per residency
  (`seed`: its first step in a slot, i.e. the first prefill chunk, or the re-prefill after a
  preemption, from the prompt and every committed token, which both survive), as a sparse list
  of distinct ids padded to a power of two, scattered into the slot's row.
- A row of it is what the step's penalties read: one gather [B, V] per step, broadcast over the
  verify window, with the drafts as a sparse correction at their ids (logit_processors).

Made on the first penalty step (an engine whose requests use no penalties never allocates it),
and handed to exactly the steps of a penalty mode (`SlotState.history`); no other step's
program reads or carries it. A non-penalty request's slot row may hold stale counts: it is
rewritten when a penalty request next takes the slot, and read before that only with the
penalties off (which change no value).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.generate import bucket_size
from mtpjax.logit_processors import PROMPT_FLAG
from mtpjax.parallel import replicate


@functools.partial(jax.jit, donate_argnums=(0,))
def _seed_rows(history, slots, ids, vals):
    """history int32[S, V] with rows `slots` int32[n] replaced by their sparse entries: ids
    int32[n, L] (V: none), vals int32[n, L]. A slot S (padding) changes nothing."""
    history = history.at[slots].set(0, mode="drop")
    return history.at[slots[:, None], ids].add(vals, mode="drop")


def sparse_history(token_ids, num_prompt_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Host side: (distinct ids int32[U], history entries int32[U]) of a request whose first
    num_prompt_tokens token_ids are its prompt."""
    toks = np.asarray(token_ids, np.int64)
    ids, counts = np.unique(toks[num_prompt_tokens:], return_counts=True)
    prompt = np.unique(toks[:num_prompt_tokens])
    all_ids = np.union1d(ids, prompt)
    vals = np.zeros(all_ids.shape, np.int64)
    vals[np.searchsorted(all_ids, ids)] += counts
    vals[np.searchsorted(all_ids, prompt)] |= PROMPT_FLAG
    return all_ids.astype(np.int32), vals.astype(np.int32)


class PenaltyHistory:
    """The device history array of a ModelRunner and the rows waiting to be seeded."""

    def __init__(self, vocab_size: int, num_slots: int, mesh=None):
        self.V, self.S, self.mesh = vocab_size, num_slots, mesh
        self.array = None                      # int32[S, V] once a penalty step has run
        self._todo: dict[int, tuple] = {}      # slot -> (ids, vals), seeded before the next step

    def reset(self) -> None:
        """Drops the array (engine recovery: every slot is released)."""
        self.array, self._todo = None, {}

    def seed(self, slot: int, token_ids, num_prompt_tokens: int) -> None:
        """A penalty request takes `slot`: its row becomes the request's history (applied at
        the next `take`, in device order before the step that needs it)."""
        self._todo[slot] = sparse_history(token_ids, num_prompt_tokens)

    def take(self) -> jax.Array:
        """The array for a penalty step (donated to it; give the step's back with `put`)."""
        if self.array is None:
            zeros = np.zeros((self.S, self.V), np.int32)
            self.array = jnp.asarray(zeros) if self.mesh is None else replicate(zeros, self.mesh)
        if self._todo:
            n = bucket_size(len(self._todo), 1)
            L = bucket_size(max(len(ids) for ids, _ in self._todo.values()), 8)
            slots = np.full(n, self.S, np.int32)
            ids = np.full((n, L), self.V, np.int32)
            vals = np.zeros((n, L), np.int32)
            for i, (slot, (row_ids, row_vals)) in enumerate(self._todo.items()):
                slots[i], ids[i, :len(row_ids)], vals[i, :len(row_vals)] = slot, row_ids, row_vals
            self.array = _seed_rows(self.array, slots, ids, vals)
            self._todo = {}
        array, self.array = self.array, None
        return array

    def put(self, array: jax.Array) -> None:
        self.array = array
