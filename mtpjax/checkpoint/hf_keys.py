"""Hugging Face state dict -> mtpjax parameter tree, as one key table.

Each rule maps a regex over HF tensor names to a path in the param tree, a stacking index
(layer or MTP module) and a transform (`T`: HF Linear weights are [out, in], ours [in, out]).
Conversion raises on unmapped, missing, duplicate or wrongly shaped tensors, naming them.

MTP modules: MiMo stores them as `model.mtp_layers.{k}.*`; DeepSeek-style checkpoints (and our
own exports for Llama/Qwen families) as `model.layers.{num_layers + k}.*` with enorm / hnorm /
eh_proj / shared_head.norm. Copies of the shared embedding / head inside MTP layers are checked
for shape and ignored.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig
from mtpjax.model.params import ParamSpec, param_specs

_T = lambda a: a.T
_I = lambda a: a

# Decoder-block leaves relative to a block prefix: (HF suffix regex, our leaf, transform).
_BLOCK = [
    (r"input_layernorm\.weight", "attn_norm", _I),
    (r"post_attention_layernorm\.weight", "mlp_norm", _I),
    (r"self_attn\.q_proj\.weight", "wq", _T),
    (r"self_attn\.k_proj\.weight", "wk", _T),
    (r"self_attn\.v_proj\.weight", "wv", _T),
    (r"self_attn\.o_proj\.weight", "wo", _T),
    (r"self_attn\.q_proj\.bias", "bq", _I),
    (r"self_attn\.k_proj\.bias", "bk", _I),
    (r"self_attn\.v_proj\.bias", "bv", _I),
    (r"self_attn\.q_norm\.weight", "q_norm", _I),
    (r"self_attn\.k_norm\.weight", "k_norm", _I),
    (r"mlp\.gate_proj\.weight", "w_gate", _T),
    (r"mlp\.up_proj\.weight", "w_up", _T),
    (r"mlp\.down_proj\.weight", "w_down", _T),
]

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def _rules(cfg: ModelConfig):
    """[(compiled regex, fn(match) -> (path tuple, index | None, transform) | None)]."""
    L = cfg.num_layers
    rules: list[tuple[re.Pattern, Callable]] = [
        (re.compile(r"model\.embed_tokens\.weight"), lambda m: (("embed",), None, _I)),
        (re.compile(r"model\.norm\.weight"), lambda m: (("final_norm",), None, _I)),
        (re.compile(r"lm_head\.weight"), lambda m: (("lm_head",), None, _T)),
    ]
    for suffix, leaf, fn in _BLOCK:
        rules.append((
            re.compile(rf"model\.layers\.(\d+)\.{suffix}"),
            lambda m, leaf=leaf, fn=fn: (
                (("layers", leaf), int(m[1]), fn) if int(m[1]) < L
                else (("mtp", "block", leaf), int(m[1]) - L, fn)),
        ))
        # MiMo: model.mtp_layers.{k}.<block leaf>
        rules.append((re.compile(rf"model\.mtp_layers\.(\d+)\.{suffix}"),
                      lambda m, leaf=leaf, fn=fn: (("mtp", "block", leaf), int(m[1]), fn)))
    mtp_leaves = [
        # DeepSeek layout
        (r"model\.layers\.(\d+)\.enorm\.weight", "enorm", _I),
        (r"model\.layers\.(\d+)\.hnorm\.weight", "hnorm", _I),
        (r"model\.layers\.(\d+)\.eh_proj\.weight", "eh_proj", _T),
        (r"model\.layers\.(\d+)\.shared_head\.norm\.weight", "out_norm", _I),
        # MiMo layout
        (r"model\.mtp_layers\.(\d+)\.token_layernorm\.weight", "enorm", _I),
        (r"model\.mtp_layers\.(\d+)\.hidden_layernorm\.weight", "hnorm", _I),
        (r"model\.mtp_layers\.(\d+)\.input_proj\.weight", "eh_proj", _T),
        (r"model\.mtp_layers\.(\d+)\.final_layernorm\.weight", "out_norm", _I),
    ]
    for pattern, leaf, fn in mtp_leaves:
        offset = L if pattern.startswith(r"model\.layers") else 0
        rules.append((re.compile(pattern),
                      lambda m, leaf=leaf, fn=fn, offset=offset:
                      (("mtp", leaf), int(m[1]) - offset, fn)))
    return rules


_SHARED_COPIES = re.compile(r"model\.layers\.(\d+)\.(embed_tokens|shared_head\.head)\.weight")


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def from_hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, object], dtype=jnp.float32):
    """Converts HF tensors (name -> numpy/torch array) into the mtpjax parameter tree."""
    specs = param_specs(cfg)
    rules = _rules(cfg)
    slots: dict[tuple, dict] = {}    # path -> {index: (name, array)}
    tied_head = None
    unmapped = []
    for name, value in tensors.items():
        if _IGNORED.match(name):
            continue
        arr = _to_numpy(value)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            tied_head = arr           # transformers lists the tied head too; checked below
            continue
        m_copy = _SHARED_COPIES.fullmatch(name)
        if m_copy and int(m_copy[1]) >= cfg.num_layers:
            expect = (cfg.vocab_size, cfg.hidden_size)
            if arr.shape != expect:
                raise ValueError(f"{name}: shape {arr.shape}, expected {expect}")
            continue
        for pattern, target in rules:
            m = pattern.fullmatch(name)
            if m:
                path, index, fn = target(m)
                break
        else:
            unmapped.append(name)
            continue
        try:
            spec = _get(specs, path)
        except KeyError:
            unmapped.append(name)
            continue
        if not isinstance(spec, ParamSpec):
            unmapped.append(name)
            continue
        stacked = index is not None
        count = spec.shape[0] if stacked else None
        if stacked and not 0 <= index < count:
            unmapped.append(name)
            continue
        arr = fn(arr)
        expect = spec.shape[1:] if stacked else spec.shape
        if arr.shape != tuple(expect):
            raise ValueError(f"{name}: shape {arr.shape} (after transpose) does not match "
                             f"{'/'.join(path)} expected {tuple(expect)}")
        entry = slots.setdefault(path, {})
        key = index if stacked else None
        if key in entry:
            raise ValueError(f"duplicate tensors for {'/'.join(path)}"
                             f"{'' if key is None else f'[{key}]'}: {entry[key][0]} and {name}")
        entry[key] = (name, arr)
    if unmapped:
        raise ValueError(f"unmapped tensors (not part of a {cfg.model_type} model with "
                         f"{cfg.num_layers} layers and {cfg.num_mtp_layers} MTP modules): "
                         f"{sorted(unmapped)[:20]}")

    missing = []

    def build(spec: ParamSpec, path):
        entry = slots.get(path, {})
        if spec.axes[0] in ("layers", "mtp"):
            want = range(spec.shape[0])
            absent = [i for i in want if i not in entry]
            if absent:
                missing.append(f"{'/'.join(path)}{absent}")
                return None
            return jnp.asarray(np.stack([entry[i][1] for i in want]), dtype)
        if None not in entry:
            missing.append("/".join(path))
            return None
        return jnp.asarray(entry[None][1], dtype)

    def walk(tree, path=()):
        if isinstance(tree, ParamSpec):
            return build(tree, path)
        return {k: walk(v, path + (k,)) for k, v in tree.items()}

    params = walk(specs)
    if missing:
        raise ValueError(f"missing tensors for: {missing}")
    if tied_head is not None and not np.array_equal(tied_head, slots[("embed",)][None][1]):
        raise ValueError("tie_word_embeddings is set but lm_head.weight differs from "
                         "model.embed_tokens.weight")
    return params


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):          # torch tensor (bf16 has no numpy dtype: go via f32)
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)
