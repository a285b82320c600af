"""Speculative decoding core: acceptance rules, draft-input roll, draft loop, and the one device
step (`mixed_step`) that the engine and `generate` both run."""

from mtpjax.speculative.accept import accept_greedy, accept_rejection, accept_relaxed, accept_synthetic
from mtpjax.speculative.mixed_step import MixedBatch, SlotState, mixed_step
from mtpjax.speculative.roll import roll_draft_inputs, roll_window

__all__ = ["accept_greedy", "accept_rejection", "accept_relaxed", "accept_synthetic",
           "roll_draft_inputs", "roll_window", "MixedBatch", "SlotState", "mixed_step"]
