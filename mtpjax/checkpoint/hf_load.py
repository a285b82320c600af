"""Loading a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer.

Streaming: every safetensors header is read and the whole checkpoint validated against the key
table (missing / unexpected / duplicate / wrong shape / wrong dtype / truncated) before any
tensor data is read; then the params are built leaf by leaf (`hf_keys.assemble`), reading one
tensor at a time. Each leaf goes to its device (and sharding) as soon as it is complete. Peak host
memory: the output plus one leaf buffer and one tensor on CPU; with the output on an accelerator,
just the leaf buffer and the tensor.

Block-scaled FP8 checkpoints (config.json `quantization_config`, DeepSeek-V3) stay FP8 by default:
each quantized weight becomes an `Fp8Weight` (its e4m3 values and float32 block scales,
transposed into our layout together; model/fp8_weight.py). `fp8="dequantize"` instead turns each
into float32 as it is read (`fp8.py`). The pairing of weights and scales is checked from the
headers first, like everything else.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import jax

from mtpjax.checkpoint import fp8 as fp8_format
from mtpjax.checkpoint.bundle import Assets, Checkpoint
from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.hf_keys import assemble, key_table, validate
from mtpjax.checkpoint.safetensors_io import read_tensor, scan_folder
from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import Fp8Weight, shard_like
from mtpjax.parallel.sharding import mesh_sharding

CONFIG_FILE = "config.json"

# progress(done_bytes, total_bytes, tensor_name), called after each tensor.
Progress = Callable[[int, int, str], None]


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_hf_config(path: str, **overrides) -> tuple[dict, ModelConfig]:
    """(config.json as a dict, the ModelConfig read from it)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    with open(file) as f:
        try:
            hf_config = json.load(f)
        except ValueError as e:
            raise CheckpointError(f"{file}: not valid JSON ({e})") from None
    try:
        cfg = ModelConfig.from_hf(hf_config, **overrides)
    except KeyError as e:
        raise CheckpointError(f"{file}: missing key {e}") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: {e}") from None
    return hf_config, cfg


def _placer(sharding):
    """path, numpy leaf -> device leaf. Waits for each transfer, so the host buffer is free
    before the next leaf is read (an async device_put would keep them all alive)."""
    def place(path, a):
        s = sharding
        if s is not None and not isinstance(s, jax.sharding.Sharding):
            for p in path:
                s = s[p]
        if isinstance(a, Fp8Weight) and isinstance(s, jax.sharding.NamedSharding):
            s = shard_like(a, s)              # the scale grid split like the values
        return jax.block_until_ready(jax.device_put(a, s))
    return place


def load_hf(path: str, dtype=None, *, sharding=None, mesh=None, mtp_layout: str | None = None,
            progress: Progress | None = None, fp8: str | None = None,
            **config_overrides) -> Checkpoint:
    """Reads a Hugging Face folder into a `Checkpoint` (cfg, params, assets with the tokenizer).

    dtype: of the params (None keeps the stored dtype). sharding: a `jax.sharding.Sharding` for
    every leaf or a tree of them shaped like the params (None: default device). mesh: a
    ("data", "model") jax.sharding.Mesh: each leaf goes straight into its sharding from the table
    (`mtpjax/parallel/sharding.py`; give sharding or mesh, not both). mtp_layout:
    "mimo" | "deepseek", default by family.
    fp8: for an FP8 checkpoint, "keep" (the default: its weights load as `Fp8Weight`, standing
    for dtype, default bfloat16) or "dequantize" (float32 arrays, or dtype).
    config_overrides: ModelConfig fields that replace what config.json says.
    """
    if fp8 not in (None, "keep", "dequantize"):
        raise ValueError(f"fp8={fp8!r}: expected 'keep' or 'dequantize'")
    hf_config, cfg = read_hf_config(path, **config_overrides)
    assets = Assets.from_dir(path, hf_config)     # checked before any tensor is read
    sharding = mesh_sharding(cfg, sharding, mesh)
    quant = fp8_format.from_hf_config(hf_config, os.path.join(path, CONFIG_FILE))
    keep = quant is not None and fp8 != "dequantize"
    infos = scan_folder(path)
    table = key_table(cfg, mtp_layout)
    # FP8 weights reach validation as the F32 they dequantize to, their scales not at all.
    meta, scales = fp8_format.split_scales(quant, {n: (i.shape, i.dtype) for n, i in infos.items()},
                                           path)
    validate(table, meta, path)
    if keep:                   # kept weights stand for bfloat16 (DeepSeek's activations) or dtype
        meta = {n: (m[0], "BF16") if n in scales else m for n, m in meta.items()}

    def nbytes(name):
        return infos[name].nbytes + (infos[scales[name]].nbytes if name in scales else 0)

    total = sum(nbytes(n) for n in (*table.slots, *table.copies) if n in infos)
    done = 0

    def read_one(name):
        try:
            return read_tensor(infos[name])
        except OSError as e:
            raise CheckpointError(f"{infos[name].file}: cannot read tensor {name}: {e}") from None

    def read(name):
        if name not in scales:
            return read_one(name)
        if keep:
            return fp8_format.kept(read_one(name), read_one(scales[name]), quant.block)
        return fp8_format.dequantize(read_one(name), read_one(scales[name]), quant.block)

    def on_tensor(name):
        nonlocal done
        done += nbytes(name)
        if progress is not None:
            progress(done, total, name)

    params = assemble(table, meta, read, dtype, place=_placer(sharding),
                      on_tensor=on_tensor)
    return Checkpoint(cfg, params, assets)
