"""Checkpoint conversion: Hugging Face tensors -> mtpjax parameter trees."""

from mtpjax.checkpoint.hf_keys import from_hf_state_dict

__all__ = ["from_hf_state_dict"]
