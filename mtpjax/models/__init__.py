"""Model families (config.json `model_type` -> how its checkpoints are read and written)."""

from mtpjax.models.registry import Family, family_for, register_family, supported_model_types

__all__ = ["Family", "family_for", "register_family", "supported_model_types"]
