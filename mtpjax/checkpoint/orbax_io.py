"""mtpjax's own checkpoint folder: the param tree in Orbax, config and tokenizer beside it.

    DIR/mtpjax_checkpoint.json   {"format": "mtpjax-orbax", "version": 1,
                                  "model_config": ModelConfig.to_dict(), "dtypes": {leaf: dtype},
                                  "fp8": {leaf: {"block": [rows, cols]}} (FP8 leaves only)}
    DIR/params/                  the param tree (orbax StandardCheckpointer)
    DIR/hf_config.json           the source config.json, when converted from Hugging Face
    DIR/tokenizer.json, ...      tokenizer / generation files, copied verbatim

`restore` builds the target tree from the saved config (no reliance on Orbax's metadata API)
and restores straight into the requested sharding: every array is written once, on its devices.
An FP8 weight (`Fp8Weight`) is stored as its two arrays, {"fp8_values": float8_e4m3fn,
"fp8_scale": float32}; its dtype entry is the dtype it stands for, its block in "fp8".
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.checkpoint.atomic import atomic_dir
from mtpjax.checkpoint.bundle import Assets, Checkpoint, check_params, flat_items
from mtpjax.checkpoint.errors import CheckpointError, json_object
from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import FP8_DTYPE, Fp8Weight, check_block, scale_grid, shard_like
from mtpjax.model.params import param_specs, tree_from_items, tree_items
from mtpjax.parallel.sharding import mesh_sharding

FORMAT_FILE = "mtpjax_checkpoint.json"
FORMAT = "mtpjax-orbax"
PARAMS_DIR = "params"
HF_CONFIG_FILE = "hf_config.json"
FP8_VALUES, FP8_SCALE = "fp8_values", "fp8_scale"      # an Fp8Weight's two arrays on disk


def is_orbax_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FORMAT_FILE))


def save(path: str, params, cfg: ModelConfig, *, assets: Assets | None = None) -> None:
    """Writes the folder above (all or nothing: a failed save leaves no `path`)."""
    import orbax.checkpoint as ocp
    check_params(params, cfg)
    assets = assets or Assets()
    meta = {"format": FORMAT, "version": 1, "model_config": cfg.to_dict(),
            "dtypes": {p: np.dtype(a.dtype).name for p, a in flat_items(params)}}
    fp8 = {p: {"block": list(a.block)} for p, a in flat_items(params) if isinstance(a, Fp8Weight)}
    if fp8:
        meta["fp8"] = fp8
    stored = tree_from_items((p, {FP8_VALUES: a.values, FP8_SCALE: a.scale}
                              if isinstance(a, Fp8Weight) else a) for p, a in tree_items(params))
    with atomic_dir(path) as tmp:
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(os.path.join(tmp, PARAMS_DIR), stored)
        with open(os.path.join(tmp, FORMAT_FILE), "w") as f:
            json.dump(meta, f, indent=2)
        if assets.hf_config is not None:
            with open(os.path.join(tmp, HF_CONFIG_FILE), "w") as f:
                json.dump(assets.hf_config, f, indent=2)
        assets.write(tmp)


def _is_float_dtype_name(name) -> bool:
    if not isinstance(name, str):
        return False
    try:
        return bool(jnp.issubdtype(jnp.dtype(name), jnp.floating))
    except TypeError:
        return False


def read_meta(path: str) -> tuple[dict, ModelConfig]:
    """(mtpjax_checkpoint.json, its ModelConfig), checked: a damaged file fails here, naming the
    file and the field, rather than as a KeyError inside `restore`."""
    file = os.path.join(path, FORMAT_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {FORMAT_FILE}; expected a folder written by "
                              "mtpjax.checkpoint.save / `mtpjax convert`")
    with open(file, "rb") as f:
        meta = json_object(f.read(), file,
                           "a JSON object with format, version, model_config and dtypes")
    if meta.get("format") != FORMAT or meta.get("version") != 1:
        raise CheckpointError(f"{file}: format {meta.get('format')!r} version "
                              f"{meta.get('version')!r}, expected {FORMAT!r} version 1")
    model_config = meta.get("model_config")
    if not isinstance(model_config, dict):
        raise CheckpointError(f"{file}: model_config must be an object of ModelConfig fields, "
                              f"got {json.dumps(model_config)[:200]}")
    try:
        cfg = ModelConfig.from_dict(model_config)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{file}: model_config: {e}") from None
    dtypes = meta.get("dtypes")
    if not isinstance(dtypes, dict):
        raise CheckpointError(f"{file}: dtypes must be an object {{param path: dtype name}}, "
                              f"got {json.dumps(dtypes)[:200]}")
    for p, _ in flat_items(param_specs(cfg)):
        if p not in dtypes:
            raise CheckpointError(f"{file}: dtypes has no entry for param {p} (expected one per "
                                  "param of the model_config)")
        if not _is_float_dtype_name(dtypes[p]):
            raise CheckpointError(f"{file}: dtypes[{p!r}] is {json.dumps(dtypes[p])}, expected "
                                  "a float dtype name such as \"float32\" or \"bfloat16\"")
    fp8 = meta.get("fp8", {})
    if not isinstance(fp8, dict) or any(p not in dtypes for p in fp8):
        raise CheckpointError(f"{file}: fp8 must be an object {{param path: {{\"block\": "
                              f"[rows, cols]}}}} over params, got {json.dumps(fp8)[:200]}")
    for p, v in fp8.items():
        try:
            check_block(v["block"])
        except (TypeError, KeyError, ValueError):
            raise CheckpointError(f"{file}: fp8[{p!r}] is {json.dumps(v)[:200]}, expected "
                                  "{\"block\": [rows, cols]} of positive ints") from None
    return meta, cfg


def restore(path: str, sharding=None, *, dtype=None, mesh=None) -> Checkpoint:
    """Reads a folder written by `save`.

    sharding: a `jax.sharding.Sharding` for every leaf, or a tree of them shaped like the params
    (None: the default device); arrays are restored straight into it. mesh: a ("data", "model")
    jax.sharding.Mesh instead: the sharding table's shardings (`mtpjax/parallel/sharding.py`).
    dtype: cast on restore (None keeps the saved dtypes).
    """
    import orbax.checkpoint as ocp
    meta, cfg = read_meta(path)
    sharding = mesh_sharding(cfg, sharding, mesh)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def leaf_sharding(p):
        if sharding is None:
            return default
        if isinstance(sharding, jax.sharding.Sharding):
            return sharding
        s = sharding
        for k in p:
            s = s[k]
        return s

    fp8 = meta.get("fp8", {})

    def abstract(p, spec):
        name = "/".join(map(str, p))
        if name in fp8:                 # an Fp8Weight: values and scale, split alike
            block = tuple(fp8[name]["block"])
            w = Fp8Weight(jax.ShapeDtypeStruct(spec.shape, FP8_DTYPE),
                          jax.ShapeDtypeStruct(scale_grid(spec.shape, block), jnp.float32), block)
            s = leaf_sharding(p)
            s = shard_like(w, s) if isinstance(s, jax.sharding.NamedSharding) else Fp8Weight(
                s, s, block)
            return {FP8_VALUES: jax.ShapeDtypeStruct(w.values.shape, FP8_DTYPE, sharding=s.values),
                    FP8_SCALE: jax.ShapeDtypeStruct(w.scale.shape, jnp.float32, sharding=s.scale)}
        return jax.ShapeDtypeStruct(spec.shape, dtype or meta["dtypes"][name],
                                    sharding=leaf_sharding(p))

    # the small files first: a damaged one fails before the arrays are read
    hf_config = None
    hf_config_file = os.path.join(path, HF_CONFIG_FILE)
    if os.path.isfile(hf_config_file):
        with open(hf_config_file, "rb") as f:
            hf_config = json_object(f.read(), hf_config_file,
                                    "a JSON object (the source config.json)")
    assets = Assets.from_dir(path, hf_config)
    target = tree_from_items((p, abstract(p, spec)) for p, spec in tree_items(param_specs(cfg)))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.abspath(os.path.join(path, PARAMS_DIR)), target)
    if fp8:
        def leaf(p):
            name, x = "/".join(map(str, p)), params
            for k in p:
                x = x[k]
            if name not in fp8:
                return x
            return Fp8Weight(x[FP8_VALUES], x[FP8_SCALE], tuple(fp8[name]["block"]),
                             jnp.dtype(dtype or meta["dtypes"][name]).name)

        params = tree_from_items((p, leaf(p)) for p, _ in tree_items(param_specs(cfg)))
    return Checkpoint(cfg, params, assets)
