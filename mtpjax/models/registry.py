"""Model families: one module per Hugging Face family, found by config.json's `model_type`.

A family owns everything that differs between checkpoint families: which `model_type`s it
claims and the `architectures` name it writes, how its config.json's own keys become
`ModelConfig` fields (`read_hf`) and back (`write_hf`), where its MTP modules live in the
checkpoint (`mtp_layout`, one of `checkpoint.hf_keys.MTP_LAYOUTS`), and what a config of it must
satisfy beyond the generic checks (`check`). What all families share (the Llama-style keys:
vocab_size, hidden_size, num_attention_heads, rope, ...) is read and written by
`ModelConfig.from_hf` and `checkpoint.hf_export.hf_config_dict` themselves. The tensor names
come from the layer kinds (`model/kinds.py`) and the MTP layout, so a family adds no key table
of its own.

Adding a family: one module under `mtpjax/models/` that calls `register_family` (every module
of the package is imported on first use; docs/models.md, "Adding a model family").
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping


def _no_check(cfg) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architectures: Mapping[str, str]     # model_type it claims -> HF `architectures` entry
    mtp_layout: str                      # "deepseek" | "mimo" (checkpoint/hf_keys.py)
    # (config.json dict, model_type) -> ModelConfig fields beyond the shared Llama-style ones
    read_hf: Callable[[Mapping[str, Any], str], dict[str, Any]]
    # (cfg, config.json dict being written) -> None: adds / overrides the family's own keys
    write_hf: Callable[[Any, dict[str, Any]], None]
    # cfg -> None, raises ValueError naming what this family cannot hold
    check: Callable[[Any], None] = _no_check

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.architectures)


FAMILIES: dict[str, Family] = {}            # model_type -> its family


def register_family(family: Family) -> Family:
    for model_type in family.model_types:
        other = FAMILIES.get(model_type)
        if other is not None and other.name != family.name:
            raise ValueError(f"model_type {model_type!r} is already claimed by family "
                             f"{other.name!r}")
        FAMILIES[model_type] = family
    return family


def supported_model_types() -> tuple[str, ...]:
    _load_builtin()
    return tuple(FAMILIES)


def family_for(model_type: Any) -> Family:
    """The family claiming `model_type`; ValueError listing the supported ones otherwise."""
    _load_builtin()
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: "
                         f"{tuple(FAMILIES)}")
    return FAMILIES[model_type]


# Listed first so that `supported_model_types` (and error messages) name the common families
# first; any other module of this package is a family too and is imported after them.
_FIRST = ("llama", "mimo", "deepseek")
_NOT_FAMILIES = ("registry",)


def _load_builtin() -> None:
    # the families register themselves on import (lazily: they import mtpjax.config)
    import importlib
    import pkgutil

    import mtpjax.models as package
    found = sorted(m.name for m in pkgutil.iter_modules(package.__path__)
                   if m.name not in _NOT_FAMILIES)
    for name in (*_FIRST, *(n for n in found if n not in _FIRST)):
        importlib.import_module(f"mtpjax.models.{name}")
