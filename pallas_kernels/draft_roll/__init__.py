"""draft_roll: fused per-segment shift of MTP draft inputs (tokens, positions, hidden)."""
from pallas_kernels.draft_roll.draft_roll import draft_roll, draft_roll_reference

__all__ = ["draft_roll", "draft_roll_reference"]
