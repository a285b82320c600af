"""Acceptance rule "relaxed" (LOSSY, opt-in): TensorRT-LLM's rule for the thinking phase of
reasoning models. Inside thinking (after `think_start_token_id`, before `think_end_token_id`) a
draft among the target's top-`relaxed_topk` tokens within `relaxed_delta` of the top-1
probability is kept; elsewhere exact match. Its per-slot flag is "inside thinking"."""

from __future__ import annotations

from typing import Sequence

from mtpjax.speculative.accept import accept_relaxed
from mtpjax.speculative.rules.registry import AcceptanceRule, register_acceptance_rule


def thinking_after(tokens: Sequence[int], spec) -> bool:
    """Host side: is a request inside its thinking phase after `tokens`?"""
    start = end = -1
    for i, t in enumerate(tokens):
        if t == spec.think_start_token_id:
            start = i
        elif t == spec.think_end_token_id:
            end = i
    return start > end


class Relaxed(AcceptanceRule):
    name = "relaxed"
    summary = "LOSSY: top-k / delta acceptance inside the thinking phase, exact match elsewhere"
    params = ("relaxed_topk", "relaxed_delta", "think_start_token_id", "think_end_token_id")
    slot_flag = staticmethod(thinking_after)

    def check_params(self, spec):
        topk = spec.relaxed_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
            raise ValueError(f"relaxed_topk must be a positive int, got {topk!r}")
        if not 0.0 <= spec.relaxed_delta <= 1.0:
            raise ValueError(f"relaxed_delta must be in [0, 1], got {spec.relaxed_delta!r}")

    def check_selected(self, spec):
        if spec.think_start_token_id is None or spec.think_end_token_id is None:
            raise ValueError("relaxed acceptance needs think_start_token_id and think_end_token_id")

    def accept(self, spec, x):
        return accept_relaxed(x.logits, x.drafts, x.num_drafts, x.flag, topk=spec.relaxed_topk,
                              delta=spec.relaxed_delta, think_start=spec.think_start_token_id,
                              think_end=spec.think_end_token_id)


register_acceptance_rule(Relaxed())
