"""Ragged paged attention (prefill chunks + verify segments + decodes in one call)."""
from pallas_kernels.ragged_paged_attention.ragged_paged_attention import (
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = ["ragged_paged_attention", "ragged_paged_attention_reference"]
