"""Acceptance rule "greedy": exact match with the target's argmax for every request, sampled
ones included (TensorRT-LLM's strict rule)."""

from __future__ import annotations

from mtpjax.speculative.accept import accept_greedy
from mtpjax.speculative.rules.registry import AcceptanceRule, register_acceptance_rule


class Greedy(AcceptanceRule):
    name = "greedy"
    summary = "exact match with the target's argmax, for every request"
    offered_by_server = True

    def accept(self, spec, x):
        return (*accept_greedy(x.logits, x.drafts, x.num_drafts), x.flag)


register_acceptance_rule(Greedy())
