"""Acceptance statistics, accumulated on device and finalised on the host.

Vocabulary (docs/spec_decoding.md): num_accepted counts the bonus token (1..K+1). acceptance
rate = accepted drafts / proposed drafts. mean acceptance length = committed tokens / verify
steps (per request). per-position acceptance[i] = P(draft i+1 accepted). Never mixed up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SpecStats:
    steps: jax.Array              # int32[]      loop iterations (batched verify steps)
    request_steps: jax.Array      # int32[]      sum over steps of live requests (verify steps)
    proposed: jax.Array           # int32[]      drafts proposed to the target
    accepted: jax.Array           # int32[]      drafts the acceptance rule kept (before stop/max truncation)
    committed: jax.Array          # int32[]      tokens committed by verify steps (after truncation)
    per_position: jax.Array       # int32[K]     times draft i was accepted
    histogram: jax.Array          # int32[K+2]   histogram of committed num_accepted (0 unused)

    @classmethod
    def zeros(cls, K: int) -> "SpecStats":
        z = jnp.zeros((), jnp.int32)
        return cls(z, z, z, z, z, jnp.zeros((K,), jnp.int32), jnp.zeros((K + 2,), jnp.int32))

    def update(self, live, num_accepted, num_committed, num_drafts=None) -> "SpecStats":
        """live bool[B]; num_accepted int32[B] (rule's 1..K+1); num_committed int32[B];
        num_drafts int32[B] drafts each request verified (per-request K), None: K."""
        K = self.per_position.shape[0]
        w = live.astype(jnp.int32)
        drafts_kept = (num_accepted - 1) * w
        proposed = K * jnp.sum(w) if num_drafts is None else jnp.sum(num_drafts * w)
        return SpecStats(
            steps=self.steps + jnp.any(live).astype(self.steps.dtype),   # not a step of padding only
            request_steps=self.request_steps + jnp.sum(w),
            proposed=self.proposed + proposed,
            accepted=self.accepted + jnp.sum(drafts_kept),
            committed=self.committed + jnp.sum(num_committed * w),
            per_position=self.per_position + jnp.sum(
                (jnp.arange(K)[None, :] < drafts_kept[:, None]).astype(jnp.int32), axis=0),
            histogram=self.histogram.at[jnp.clip(num_committed, 0, K + 1)].add(w),
        )

    def finalize(self, prefill_tokens: int) -> dict:
        s = jax.tree.map(np.asarray, self)
        req = max(int(s.request_steps), 1)
        prop = max(int(s.proposed), 1)
        return {
            "draft_steps": int(s.steps),
            "verify_steps": int(s.request_steps),
            "proposed_draft_tokens": int(s.proposed),
            "accepted_draft_tokens": int(s.accepted),
            "acceptance_rate": int(s.accepted) / prop,
            "committed_tokens": int(s.committed),
            "prefill_tokens": prefill_tokens,
            "generated_tokens": int(s.committed) + prefill_tokens,
            "mean_acceptance_length": int(s.committed) / req,
            "per_position_acceptance": (s.per_position / req).tolist(),
            "num_accepted_histogram": s.histogram.tolist(),
        }
