"""Hugging Face tensor names <-> the mtpjax parameter tree, as one key table.

`key_table(cfg)` lists, for a model config, every Hugging Face tensor name with its `Slot`: the
leaf of the param tree (a path such as ("layers", 3, "wq")) and whether it is transposed (HF Linear weights are [out, in], ours [in, out]). It is built from
`param_specs(cfg)`, so the table holds exactly the leaves the model has (biases only with
`qkv_bias`, q/k norms only with `qk_norm`, no `lm_head` when tied). Loading (`validate` then
`assemble`, used by both the in-memory `from_hf_state_dict` and the streaming `load_hf`) and
exporting (`hf_export`) read the same table; there is no second copy of the rules.

MTP modules are stored in one of two layouts (`MTP_LAYOUTS`), picked by the family
(`Family.mtp_layout`, mtpjax/models/) unless given:

- "mimo" (vLLM `mimo_mtp.py`): `model.mtp_layers.{k}.{token_layernorm, hidden_layernorm,
  input_proj, final_layernorm}` plus the decoder block's own names under the same prefix.
- "deepseek" (vLLM `deepseek_mtp.py`): `model.layers.{num_layers + k}.{enorm, hnorm, eh_proj,
  shared_head.norm}` plus the block, and copies of the shared `embed_tokens` and
  `shared_head.head` inside every MTP layer.

Copies of shared tensors (those DeepSeek copies; `lm_head.weight` of a tied model, which
transformers lists) are optional when loading, must equal the leaf they duplicate, and are
written again on export.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.checkpoint import fp8
from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.safetensors_io import DTYPE_NAMES, DTYPES
from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import Fp8Weight
from mtpjax.model.kinds import attention_kind, ffn_kind
from mtpjax.model.params import param_specs, tree_from_items, tree_items
from mtpjax.models.registry import family_for

# The decoder layer's own leaves; the rest of a layer's rows come from its kinds (`hf_rows`).
LAYER_NORM_ROWS: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
}


def layer_rows(kinds: tuple[str, str]) -> dict[str, tuple[str, bool]]:
    """Leaf -> (HF suffix under the layer prefix, transposed) for a layer of `kinds`."""
    return {**LAYER_NORM_ROWS, **attention_kind(kinds[0]).hf_rows, **ffn_kind(kinds[1]).hf_rows}


def _layer_slots(kinds: tuple[str, str], prefix: str, path: tuple, specs: dict) -> dict[str, Slot]:
    """HF name -> Slot for one decoder layer: its rows, plus one row per expert of a leaf that
    stacks experts (a kind's `hf_expert_rows`, suffixes with `{e}`)."""
    slots = {f"{prefix}.{suffix}": Slot((*path, leaf), t)
             for leaf, (suffix, t) in layer_rows(kinds).items() if leaf in specs}
    for leaf, (suffix, t) in getattr(ffn_kind(kinds[1]), "hf_expert_rows", {}).items():
        for e in range(specs[leaf].shape[0]):
            slots[f"{prefix}.{suffix.format(e=e)}"] = Slot((*path, leaf), t, (e,))
    return slots


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint family keeps MTP module k."""

    name: str
    prefix: str                  # formatted with i = the module's absolute index
    after_target_layers: bool    # i = num_layers + k (DeepSeek) rather than k (MiMo)
    leaves: Mapping[str, tuple[str, bool]]   # our mtp leaf -> (HF suffix, transposed)
    copies: Mapping[str, str]    # HF suffix -> the shared leaf it duplicates ("embed" | "lm_head")

    def module_prefix(self, cfg: ModelConfig, k: int) -> str:
        return self.prefix.format(i=cfg.num_layers + k if self.after_target_layers else k)


MTP_LAYOUTS: dict[str, MtpLayout] = {
    "mimo": MtpLayout(
        "mimo", "model.mtp_layers.{i}", False,
        {"enorm": ("token_layernorm.weight", False), "hnorm": ("hidden_layernorm.weight", False),
         "eh_proj": ("input_proj.weight", True), "out_norm": ("final_layernorm.weight", False)},
        {}),
    "deepseek": MtpLayout(
        "deepseek", "model.layers.{i}", True,
        {"enorm": ("enorm.weight", False), "hnorm": ("hnorm.weight", False),
         "eh_proj": ("eh_proj.weight", True), "out_norm": ("shared_head.norm.weight", False)},
        {"embed_tokens.weight": "embed", "shared_head.head.weight": "lm_head"}),
}

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in the param tree."""

    path: tuple                  # keys into the param tree (ints index the layer tuples)
    transpose: bool
    index: tuple = ()            # position inside the leaf (an expert's row of a stacked leaf)

    def describe(self) -> str:
        """"layers/wq[3]": the leaf's name, then the layer / MTP module index (and the expert)."""
        names = [k for k in self.path if not isinstance(k, int)]
        index = "".join(f"[{k}]" for k in self.path if isinstance(k, int))
        expert = "".join(f" expert {e}" for e in self.index)
        return "/".join(names) + index + expert


@dataclasses.dataclass(frozen=True)
class KeyTable:
    cfg: ModelConfig
    layout: MtpLayout
    slots: dict[str, Slot]       # every tensor of the tree, grouped by leaf in tree order
    copies: dict[str, Slot]      # optional duplicates of a shared leaf
    specs: dict                  # param_specs(cfg)

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as Hugging Face stores it."""
        slot = self.slots.get(name) or self.copies[name]
        shape = _get(self.specs, slot.path).shape[len(slot.index):]
        return tuple(reversed(shape)) if slot.transpose else tuple(shape)


def _get(tree, path):
    for p in path:
        tree = tree[p]
    return tree


def mtp_layout_for(cfg: ModelConfig, mtp_layout: str | None = None) -> MtpLayout:
    name = mtp_layout or family_for(cfg.model_type).mtp_layout
    if name not in MTP_LAYOUTS:
        raise CheckpointError(f"MTP layout {name!r} is not one of {sorted(MTP_LAYOUTS)}")
    return MTP_LAYOUTS[name]


def key_table(cfg: ModelConfig, mtp_layout: str | None = None) -> KeyTable:
    """Every Hugging Face tensor name of a `cfg` model -> its Slot, plus the optional copies."""
    layout = mtp_layout_for(cfg, mtp_layout)
    specs = param_specs(cfg)
    slots: dict[str, Slot] = {}
    copies: dict[str, Slot] = {}
    head = ("lm_head",) if "lm_head" in specs else ("embed",)
    slots["model.embed_tokens.weight"] = Slot(("embed",), False)
    for i, kinds in enumerate(cfg.layer_kinds()):
        slots.update(_layer_slots(kinds, f"model.layers.{i}", ("layers", i), specs["layers"][i]))
    slots["model.norm.weight"] = Slot(("final_norm",), False)
    if "lm_head" in specs:
        slots["lm_head.weight"] = Slot(("lm_head",), True)
    for k in range(cfg.num_mtp_layers):
        pre = layout.module_prefix(cfg, k)
        for leaf, (suffix, t) in layout.leaves.items():
            slots[f"{pre}.{suffix}"] = Slot(("mtp", k, leaf), t)
        slots.update(_layer_slots(cfg.mtp_layer_kind(), pre, ("mtp", k, "block"),
                                  specs["mtp"][k]["block"]))
    named = {s.path for s in slots.values()}
    for path, _ in tree_items(specs):        # a leaf added to a kind without a name there
        if path not in named:
            raise AssertionError(f"no Hugging Face name for param {'/'.join(map(str, path))}")
    if cfg.tie_word_embeddings:
        copies["lm_head.weight"] = Slot(("embed",), False)
    for k in range(cfg.num_mtp_layers):
        for suffix, leaf in layout.copies.items():
            path = ("embed",) if leaf == "embed" else head
            copies[f"{layout.module_prefix(cfg, k)}.{suffix}"] = Slot(path, path == ("lm_head",))
    return KeyTable(cfg, layout, slots, copies, specs)


def _listing(items: list[str], limit: int = 12) -> str:
    more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
    return "".join(f"\n    {s}" for s in items[:limit]) + more


def validate(table: KeyTable, tensors: Mapping[str, tuple[tuple[int, ...], str]],
             source: str = "checkpoint") -> None:
    """Checks names, shapes and dtypes (name -> (shape, safetensors dtype name)) before any data
    is read; raises one CheckpointError naming every offending tensor."""
    unexpected, shapes, dtypes = [], [], []
    for name, (shape, dtype) in tensors.items():
        if _IGNORED.fullmatch(name):
            continue
        slot = table.slots.get(name) or table.copies.get(name)
        if slot is None:
            unexpected.append(name)
            continue
        want = table.hf_shape(name)
        if tuple(shape) != want:
            shapes.append(f"{name}: shape {list(shape)}, expected {list(want)} "
                          f"(-> {slot.describe()})")
        if dtype not in FLOAT_DTYPES:
            dtypes.append(f"{name}: dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
    missing = [f"{n} (-> {s.describe()})" for n, s in table.slots.items() if n not in tensors]
    parts = [(missing, "missing tensors"), (sorted(unexpected), "unexpected tensors"),
             (shapes, "wrong shape"), (dtypes, "wrong dtype")]
    if any(items for items, _ in parts):
        cfg = table.cfg
        head = (f"{source} does not match a {cfg.model_type} model with {cfg.num_layers} layers "
                f"and {cfg.num_mtp_layers} MTP modules ({table.layout.name} MTP layout):")
        raise CheckpointError(head + "".join(f"\n  {label}:{_listing(items)}"
                                             for items, label in parts if items)
                              + _absent_mtp_hint(table, tensors))


def _absent_mtp_hint(table: KeyTable, tensors: Mapping) -> str:
    """When the only missing tensors are whole MTP modules (k .. D-1), what was found and how to
    load it: transformers' save_pretrained of a DeepSeek-V3 keeps the config's
    num_nextn_predict_layers but writes no MTP layer."""
    cfg = table.cfg
    missing = [(n, s) for n, s in table.slots.items() if n not in tensors]
    if not missing or any(s.path[0] != "mtp" for _, s in missing):
        return ""
    have = sorted({s.path[1] for n, s in table.slots.items() if s.path[0] == "mtp"
                   and n in tensors})
    first = min(s.path[1] for _, s in missing)       # modules first .. D-1 must be absent
    if have and have[-1] >= first:
        return ""                                    # a module partly there: damage, not this
    where = ", ".join(f"{table.layout.module_prefix(cfg, k)}.*"
                      for k in range(first, cfg.num_mtp_layers))
    found = (f"the tensors of MTP modules 0..{first - 1} only" if first else
             "no MTP module's tensors")
    how = ("as a target model only (no speculative decoding)" if first == 0 else
           f"with its {first} MTP module{'s' if first > 1 else ''}")
    return (f"\n  The config declares {cfg.num_mtp_layers} MTP module"
            f"{'s' if cfg.num_mtp_layers > 1 else ''} (num_mtp_layers; config.json's "
            f"num_nextn_predict_layers), but the checkpoint has {found} (nothing under "
            f"{where}); transformers' save_pretrained, for one, writes no MTP layers. To load it "
            f"{how}, pass num_mtp_layers={first} (load_hf / load_pretrained(path, "
            f"num_mtp_layers={first}), `mtpjax generate --num-mtp-layers {first}`) or set "
            f"\"num_nextn_predict_layers\": {first} in its config.json.")


def assemble(table: KeyTable, tensors: Mapping[str, tuple[tuple[int, ...], str]],
             read: Callable[[str], np.ndarray], dtype=None, *,
             place: Callable[[tuple, np.ndarray], object] = lambda path, a: jax.device_put(a),
             on_tensor: Callable[[str], None] | None = None):
    """Builds the param tree leaf by leaf from a validated checkpoint.

    Each leaf is one preallocated numpy buffer; its tensors are read one at a time (`read(name)`)
    and copied in, then `place(path, buffer)` turns it into the output leaf (default: a device
    array) before the next leaf starts. Host memory therefore holds one leaf buffer and one
    tensor beyond what `place` keeps. dtype None keeps the stored dtype (promoted across a leaf's
    tensors). `read` may return an `Fp8Weight` (an FP8 tensor kept FP8): its leaf becomes one,
    standing for the leaf's dtype.
    """
    specs = table.specs
    fills: dict[tuple, list[tuple[str, Slot]]] = {}
    copies: dict[tuple, list[tuple[str, Slot]]] = {}
    for name, slot in table.slots.items():
        fills.setdefault(slot.path, []).append((name, slot))
    for name, slot in table.copies.items():
        if name in tensors:
            copies.setdefault(slot.path, []).append((name, slot))
    out = []
    for path, spec in tree_items(specs):
        entries = fills[path]
        leaf_dtype = np.dtype(dtype if dtype is not None else functools.reduce(
            jnp.promote_types, [DTYPES[tensors[name][1]] for name, _ in entries]))
        buf = np.empty(spec.shape, leaf_dtype)
        for name, slot in entries:
            arr = read(name)
            if isinstance(arr, Fp8Weight):         # kept FP8: values and scales, filled alike
                buf = fp8.fill(buf, slot.index, arr.T if slot.transpose else arr)
            else:
                buf[slot.index] = arr.T if slot.transpose else arr
            del arr
            if on_tensor is not None:
                on_tensor(name)
        for name, slot in copies.get(path, []):    # must equal what was loaded
            arr = read(name)
            arr = arr.T if slot.transpose else arr
            if not fp8.same_leaf(arr, buf, leaf_dtype):
                raise CheckpointError(f"{name} differs from the {'/'.join(path)} it duplicates "
                                      "(shared weights must be equal)")
            del arr
            if on_tensor is not None:
                on_tensor(name)
        out.append((path, place(path, buf)))
        del buf
    return tree_from_items(out)


def _meta(value) -> tuple[tuple[int, ...], str]:
    if hasattr(value, "detach"):              # torch tensor
        dtype = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                 "torch.float64": "F64"}.get(str(value.dtype), str(value.dtype))
        return tuple(value.shape), dtype
    value = np.asarray(value)
    return tuple(value.shape), DTYPE_NAMES.get(value.dtype, str(value.dtype))


def _to_numpy(value) -> np.ndarray:
    if hasattr(value, "detach"):          # torch tensor (bf16 has no numpy dtype: go via f32)
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def from_hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, object], dtype=jnp.float32, *,
                       mtp_layout: str | None = None):
    """HF tensors held in memory (name -> numpy / torch array) -> the mtpjax parameter tree."""
    table = key_table(cfg, mtp_layout)
    meta = {name: _meta(v) for name, v in tensors.items()}
    validate(table, meta, "state dict")
    return assemble(table, meta, lambda name: _to_numpy(tensors[name]), dtype)
