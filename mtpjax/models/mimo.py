"""Family "mimo" (Xiaomi MiMo): a Qwen2 target with MiMo's MTP modules.

MiMo's MTP module concatenates (hnorm(h), enorm(e)) in that order and hands its *normed*
hidden state to the next depth; its tensors live under `model.mtp_layers.{k}` with their own
names (the "mimo" layout in checkpoint/hf_keys.py, as vLLM's `mimo_mtp.py` reads them).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from mtpjax.config import FLAG, _hf_value
from mtpjax.models.registry import Family, register_family


def _read(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    return dict(qkv_bias=functools.partial(_hf_value, config)("attention_bias", FLAG, True),
                mtp_concat_order="hidden_embed", mtp_normed_hidden_to_next=True)


def _write(cfg, d: dict[str, Any]) -> None:
    return None       # the MTP order / hand-off are implied by model_type "mimo"


MIMO = register_family(Family("mimo", {"mimo": "MiMoForCausalLM"}, "mimo", _read, _write))
