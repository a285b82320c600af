"""Grouped matmul of MoE experts (`ragged_dot` semantics) as a Pallas (Triton) kernel."""
from pallas_kernels.grouped_matmul.grouped_matmul import grouped_matmul, tile_layout

__all__ = ["grouped_matmul", "tile_layout"]
