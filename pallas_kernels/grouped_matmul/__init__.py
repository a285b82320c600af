"""Grouped matmul of MoE experts (`ragged_dot` semantics) as a Pallas (Triton) kernel, and the
routed experts' whole SwiGLU FFN on it (`grouped_swiglu`; `expert_tile_swiglu` for a few
tokens)."""
from pallas_kernels.grouped_matmul.expert_tiles import expert_tile_swiglu
from pallas_kernels.grouped_matmul.grouped_matmul import grouped_matmul, tile_layout
from pallas_kernels.grouped_matmul.routed_ffn import grouped_swiglu

__all__ = ["expert_tile_swiglu", "grouped_matmul", "grouped_swiglu", "tile_layout"]
