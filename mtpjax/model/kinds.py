"""Layer kinds: a decoder layer is an (attention kind, FFN kind) pair.

Each kind is one module that owns everything about itself: its param leaves (shapes, logical
axes, init), its Hugging Face key rows, and its forward. An attention kind also owns its page
layout in the paged KV cache (its *cache kind*). The registries below map a kind name to its
object; a model config names the kinds of its layers (`ModelConfig.layer_kinds`), and the param
table, the key table, the cache and the forward all derive from those names.

Adding a kind: write its module (an object with the attributes of `AttentionKind` or
`FFNKind`), and register it here with one line (or `register_ffn_kind` from outside).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]          # logical axis names, one per dim (for sharding rules)
    init: str                      # "normal" | "ones" | "zeros"


class FFNKind(Protocol):
    name: str
    hf_rows: Mapping[str, tuple[str, bool]]        # leaf -> (HF suffix in the layer, transposed)

    def param_specs(self, cfg) -> dict[str, ParamSpec]: ...
    def __call__(self, p: dict, x, cfg, valid, mesh=None): ...  # x [N, E] -> [N, E]; valid bool[N]


class AttentionKind(Protocol):
    name: str
    hf_rows: Mapping[str, tuple[str, bool]]

    def param_specs(self, cfg) -> dict[str, ParamSpec]: ...
    def init_pages(self, cfg, num_pages: int, page_size: int, dtype) -> Any: ...
    def __call__(self, p: dict, x, positions, cfg, pages, paged) -> tuple[Any, Any]: ...


ATTENTION_KINDS: dict[str, AttentionKind] = {}
FFN_KINDS: dict[str, FFNKind] = {}


def register_attention_kind(kind: AttentionKind) -> AttentionKind:
    ATTENTION_KINDS[kind.name] = kind
    return kind


def register_ffn_kind(kind: FFNKind) -> FFNKind:
    FFN_KINDS[kind.name] = kind
    return kind


def attention_kind(name: str) -> AttentionKind:
    _load_builtin()
    if name not in ATTENTION_KINDS:
        raise ValueError(f"attention kind {name!r} is not registered; known: {sorted(ATTENTION_KINDS)}")
    return ATTENTION_KINDS[name]


def ffn_kind(name: str) -> FFNKind:
    _load_builtin()
    if name not in FFN_KINDS:
        raise ValueError(f"FFN kind {name!r} is not registered; known: {sorted(FFN_KINDS)}")
    return FFN_KINDS[name]


def _load_builtin() -> None:
    # the built-in kinds register themselves on import (lazily: they import this module)
    from mtpjax.model import dense_ffn, gqa, mla, moe  # noqa: F401

