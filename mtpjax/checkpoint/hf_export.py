"""Exporting params to a Hugging Face folder (safetensors, config.json, tokenizer), so MTP heads
trained or edited in JAX can be served by other engines.

Tensor names come from the same key table as loading (`hf_keys.key_table`), MTP modules in the
family's layout (MiMo: `model.mtp_layers.{k}`; others: DeepSeek's `model.layers.{L + k}` with
its copies of the shared embedding and head). Each tensor is fetched from the device and
written on its own, so host memory holds one tensor at a time. `load_hf(export_hf(x)) == x`
bit for bit; a config that config.json cannot express is refused rather than silently changed.
Tensors are written in the params' dtype (or `dtype`); FP8 weights (`Fp8Weight`) as DeepSeek-V3
ships them (F8_E4M3 + float32 `weight_scale_inv`, a quantization_config with their block size),
so an FP8 checkpoint loaded and exported comes back byte for byte. A model loaded with
fp8="dequantize" exports unquantized, without the source's `quantization_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Callable

import jax
import numpy as np

from mtpjax.checkpoint import fp8
from mtpjax.checkpoint.atomic import atomic_dir
from mtpjax.checkpoint.bundle import Assets, check_params
from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.hf_keys import key_table
from mtpjax.checkpoint.hf_load import CONFIG_FILE
from mtpjax.checkpoint.safetensors_io import TensorSource, write_folder
from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import Fp8Weight
from mtpjax.models.registry import family_for

# Keys this module owns; anything else in the source config.json is kept as it was.
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
# Dropped from the source config.json: it would describe tensors that are not there unless the
# params hold FP8 weights, and then export_hf writes it again for them (`fp8.export_block`).
_DROPPED_KEYS = ("quantization_config",)


def hf_config_dict(cfg: ModelConfig, base: dict | None = None, torch_dtype: str | None = None) -> dict:
    """config.json for `cfg`, keeping the other keys of `base` (the source config.json): the
    Llama-style keys every family shares here, the family's own keys by its module
    (mtpjax/models/)."""
    family = family_for(cfg.model_type)
    d = {k: v for k, v in (base or {}).items()
         if k not in _ROPE_KEYS + _DROPPED_KEYS and k != "num_nextn_predict_layers"}
    rs = cfg.rope_scaling
    d.update(
        architectures=[family.architectures[cfg.model_type]], model_type=cfg.model_type,
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_position_embeddings,
        attention_bias=cfg.qkv_bias, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_scaling=None if rs.rope_type == "default" else
        {k: v for k, v in dataclasses.asdict(rs).items() if v is not None},
    )
    family.write_hf(cfg, d)
    if cfg.num_mtp_layers:
        d["num_nextn_predict_layers"] = cfg.num_mtp_layers
    if torch_dtype is not None:       # transformers 5 writes "dtype", older versions "torch_dtype"
        for key in {"torch_dtype"} | ({"dtype"} & d.keys()):
            d[key] = torch_dtype
    back = ModelConfig.from_hf(d)
    if back != cfg:
        raise CheckpointError(f"this ModelConfig cannot be written as a {cfg.model_type} config.json "
                              f"(it would read back with different {_differing_fields(cfg, back)})")
    return d


def _differing_fields(a, b, prefix: str = "") -> list[str]:
    """Names of the fields where dataclasses a and b differ, into sub-configs ("moe.n_group")."""
    out = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y:
            continue
        if dataclasses.is_dataclass(x) and type(x) is type(y):
            out += _differing_fields(x, y, f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def parse_size(size) -> int | None:
    """1000, "20KB", "5GB", "2GiB" -> bytes (HF's max_shard_size convention); None stays None."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read size {size!r}; use e.g. 500MB or 5GB")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index((m[2] or " ").upper()))


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in name.split(".")]


def export_hf(path: str, params, cfg: ModelConfig, *, assets: Assets | None = None, dtype=None,
              max_shard_size=None, mtp_layout: str | None = None,
              progress: Callable[[int, int, str], None] | None = None) -> list[str]:
    """Writes a Hugging Face folder at `path` (all or nothing); returns the files written.

    assets: the source config.json (its other keys are kept) and tokenizer files.
    dtype: of the written tensors (None keeps each leaf's: FP8 weights as F8_E4M3 with their
    `weight_scale_inv` and a quantization_config, DeepSeek-V3's layout; a dtype writes them
    dequantized). max_shard_size: bytes or "5GB"; None writes one model.safetensors.
    """
    check_params(params, cfg)
    assets = assets or Assets()
    table = key_table(cfg, mtp_layout)
    # transformers does not store the head of a tied model; the DeepSeek copies are stored.
    entries = {**table.slots, **{n: s for n, s in table.copies.items() if n != "lm_head.weight"}}
    sources, fp8_blocks = [], set()
    for name in sorted(entries, key=_natural):
        slot = entries[name]
        leaf = params
        for p in slot.path:
            leaf = leaf[p]
        if isinstance(leaf, Fp8Weight):     # FP8 as FP8 + weight_scale_inv (dtype: dequantized)
            srcs, block = fp8.export_sources(name, table.hf_shape(name), leaf, slot.index,
                                             slot.transpose, dtype)
            sources += srcs
            fp8_blocks |= {block} - {None}
            continue
        out_dtype = np.dtype(dtype if dtype is not None else leaf.dtype)

        def fetch(leaf=leaf, slot=slot, out_dtype=out_dtype):
            a = np.asarray(jax.device_get(leaf[slot.index] if slot.index else leaf))
            return (a.T if slot.transpose else a).astype(out_dtype, copy=False)

        sources.append(TensorSource(name, table.hf_shape(name), out_dtype, fetch))
    total = sum(s.nbytes for s in sources)
    done = 0

    def on_tensor(src):
        nonlocal done
        done += src.nbytes
        if progress is not None:
            progress(done, total, src.name)

    torch_dtype = np.dtype(dtype if dtype is not None else params["embed"].dtype).name
    hf_config = hf_config_dict(cfg, assets.hf_config, torch_dtype)
    if fp8_blocks:
        hf_config["quantization_config"] = fp8.export_block(fp8_blocks, assets.hf_config)
    with atomic_dir(path) as tmp:
        files = write_folder(tmp, sources, parse_size(max_shard_size), on_tensor)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(hf_config, f, indent=2)
        assets.write(tmp)
    return files + [CONFIG_FILE] + sorted(assets.files)
