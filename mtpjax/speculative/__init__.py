"""Speculative decoding core: acceptance rules, draft-input roll, draft loop, verify step."""

from mtpjax.speculative.accept import accept_greedy, accept_rejection, accept_relaxed, accept_synthetic
from mtpjax.speculative.roll import roll_draft_inputs, roll_window
from mtpjax.speculative.step import SpecState, spec_prefill, spec_step

__all__ = ["accept_greedy", "accept_rejection", "accept_relaxed", "accept_synthetic",
           "roll_draft_inputs", "roll_window", "SpecState", "spec_prefill", "spec_step"]
