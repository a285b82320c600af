"""Acceptance rule "rejection": lossless speculative (rejection) sampling; for an all-greedy
batch the exact-match form, which gives the same tokens without a softmax or a draw."""

from __future__ import annotations

from mtpjax.sampling import GREEDY_MODES, filtered_probs
from mtpjax.speculative.accept import accept_rejection, draft_token_probs, rejection_when_greedy
from mtpjax.speculative.rules.registry import AcceptanceRule, register_acceptance_rule


class Rejection(AcceptanceRule):
    name = "rejection"
    summary = "lossless rejection sampling (greedy requests: exact match)"
    offered_by_server = True

    def accept(self, spec, x):
        sp = x.sampling
        if sp.mode in GREEDY_MODES:
            # every p is one-hot, where rejection sampling is exact match (the same output);
            # drafts drawn in this step have q(d) > 0 by construction (apply_acceptance)
            draft_q = None if x.own_drafts else draft_token_probs(x.draft_probs, x.drafts)
            return (*rejection_when_greedy(x.logits, x.drafts, x.num_drafts, draft_q), x.flag)
        p = filtered_probs(x.logits, sp.temperature, sp.top_k, sp.top_p, sp.mode, sp.min_p)
        return (*accept_rejection(p, x.draft_probs, x.drafts, x.num_drafts, x.keys), x.flag)


register_acceptance_rule(Rejection())
