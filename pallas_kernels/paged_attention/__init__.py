"""Paged attention for decode / MTP verify batches (uniform Q per request)."""
from pallas_kernels.paged_attention.paged_attention import (
    paged_attention,
    paged_attention_reference,
)

__all__ = ["paged_attention", "paged_attention_reference"]
