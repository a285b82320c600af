"""Acceptance rule "coupled": lossless and reproducible. Target and drafter sample position p
with the same key, fold_in(request key, p); a draft is kept iff it equals the target's own
sample, so a request's tokens are those of plain seeded sampling whatever K or the drafts."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.sampling import GREEDY_MODES, filtered_probs, position_keys
from mtpjax.speculative.accept import accept_coupled, rejection_when_greedy
from mtpjax.speculative.rules.registry import AcceptanceRule, register_acceptance_rule


class Coupled(AcceptanceRule):
    name = "coupled"
    summary = "lossless; drafts share the target's per-position keys (seeded outputs reproduce)"
    offered_by_server = True
    drafts_share_target_keys = True

    def accept(self, spec, x):
        sp, key_positions = x.sampling, x.key_positions
        K1 = x.logits.shape[1]
        pos = key_positions[:, None] + jnp.arange(K1, dtype=key_positions.dtype)[None, :]
        pkeys = jax.vmap(position_keys, in_axes=(None, 1), out_axes=1)(sp.keys, pos)  # [B,K+1,2]
        if sp.mode in GREEDY_MODES:  # one-hot p: the target's own sample is its argmax
            return (*rejection_when_greedy(x.logits, x.drafts, x.num_drafts), x.flag)
        p = filtered_probs(x.logits, sp.temperature, sp.top_k, sp.top_p, sp.mode, sp.min_p)
        return (*accept_coupled(p, x.drafts, x.num_drafts, pkeys), x.flag)


register_acceptance_rule(Coupled())
