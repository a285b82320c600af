"""MLA paged attention (absorbed form, latent cache; decode, verify and prefill in one call)."""
from pallas_kernels.mla_paged_attention.mla_paged_attention import (
    mla_paged_attention,
    mla_paged_attention_reference,
)

__all__ = ["mla_paged_attention", "mla_paged_attention_reference"]
