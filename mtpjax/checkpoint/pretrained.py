"""Any checkpoint folder: open it (`load_pretrained`) or convert it to the other format (`convert`).

Two folder kinds: a Hugging Face one (config.json + safetensors) and mtpjax's Orbax one
(mtpjax_checkpoint.json + params/). `load_pretrained` tells them apart and checks a speculative
config against the checkpoint's MTP modules before reading any weight.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

from mtpjax.checkpoint.atomic import check_free
from mtpjax.checkpoint.bundle import Checkpoint
from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.hf_export import export_hf
from mtpjax.checkpoint.hf_keys import mtp_layout_for
from mtpjax.checkpoint.hf_load import is_hf_folder, load_hf, read_hf_config
from mtpjax.checkpoint.orbax_io import FORMAT_FILE, is_orbax_folder, read_meta, restore, save
from mtpjax.config import ModelConfig, SpecConfig


def folder_kind(path: str) -> str:
    """"orbax" | "hf"; raises for anything else."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path} is not a folder")
    if is_orbax_folder(path):
        return "orbax"
    if is_hf_folder(path):
        return "hf"
    raise CheckpointError(f"{path} is neither a Hugging Face model folder (config.json) nor an "
                          f"mtpjax Orbax folder ({FORMAT_FILE})")


def _check_spec(path: str, cfg: ModelConfig, spec: SpecConfig | None) -> None:
    if spec is None:
        return
    if cfg.num_mtp_layers == 0:
        raise CheckpointError(
            f"{path}: this {cfg.model_type} checkpoint has no MTP modules (config.json has no "
            "num_nextn_predict_layers), so it loads as a target model only; speculative decoding "
            f"(method {spec.method!r}, K={spec.num_speculative_tokens}) needs MTP modules. "
            "Pass spec=None, or use a checkpoint with MTP layers (e.g. MiMo).")
    try:
        spec.check_model(cfg)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def load_pretrained(path: str, dtype=None, *, spec: SpecConfig | None = None, sharding=None,
                    mesh=None, fp8: str | None = None, **config_overrides) -> Checkpoint:
    """A Hugging Face or Orbax folder -> Checkpoint (cfg, params, tokenizer, eos id).

    spec: checked against the checkpoint's MTP modules before any weight is read.
    config_overrides: ModelConfig fields replacing config.json's (Hugging Face folders only).
    mesh: a ("data", "model") Mesh: every leaf goes straight into its table sharding.
    fp8: FP8 weights "keep" (the default) or "dequantize" (docs/fp8.md); an Orbax folder's FP8
    weights are dequantized after the restore.
    """
    if folder_kind(path) == "orbax":
        if config_overrides:
            raise CheckpointError(f"{path}: an Orbax folder's config is fixed; config overrides "
                                  f"({sorted(config_overrides)}) apply to Hugging Face folders")
        if fp8 not in (None, "keep", "dequantize"):
            raise ValueError(f"fp8={fp8!r}: expected 'keep' or 'dequantize'")
        _check_spec(path, read_meta(path)[1], spec)
        ckpt = restore(path, sharding, dtype=dtype, mesh=mesh)
        if fp8 == "dequantize":
            from mtpjax.model.quantize import dequantize_params
            ckpt = dataclasses.replace(ckpt, params=dequantize_params(ckpt.params))
        return ckpt
    _check_spec(path, read_hf_config(path, **config_overrides)[1], spec)
    return load_hf(path, dtype, sharding=sharding, mesh=mesh, fp8=fp8, **config_overrides)


@dataclasses.dataclass(frozen=True)
class ConversionSummary:
    src: str
    dst: str
    to: str                      # "orbax" | "hf"
    model_type: str
    num_layers: int
    num_mtp_layers: int
    mtp_layout: str | None
    num_tensors: int             # Hugging Face tensors read or written
    num_bytes: int
    seconds: float

    def line(self) -> str:
        what = ("HF -> Orbax" if self.to == "orbax" else "Orbax -> HF")
        mtp = (f"{self.num_mtp_layers} MTP layers ({self.mtp_layout} layout)" if self.num_mtp_layers
               else "no MTP layers")
        return (f"converted {self.src} -> {self.dst} ({what}): {self.model_type}, "
                f"{self.num_tensors} tensors, {self.num_bytes / 1e6:.2f} MB, {self.num_layers} "
                f"target layers, {mtp}, in {self.seconds:.1f}s")


def convert(src: str, dst: str, *, to: str = "orbax", dtype=None, max_shard_size=None,
            progress: Callable[[int, int, str], None] | None = None) -> ConversionSummary:
    """HF folder -> Orbax folder (to="orbax") or back (to="hf"); dst is written all or nothing."""
    if to not in ("orbax", "hf"):
        raise ValueError(f"to must be 'orbax' or 'hf', got {to!r}")
    want = "hf" if to == "orbax" else "orbax"
    kind = folder_kind(src)
    if kind != want:
        label = {"hf": "a Hugging Face", "orbax": "an Orbax"}
        raise CheckpointError(f"{src} is {label[kind]} folder; converting to {to} needs "
                              f"{label[want]} folder")
    check_free(dst)                     # before the (long) read, not only before writing
    t0 = time.perf_counter()
    count = [0, 0]

    def tick(done, total, name):
        count[0] += 1
        count[1] = done
        if progress is not None:
            progress(done, total, name)

    if to == "orbax":
        ckpt = load_hf(src, dtype, progress=tick)
        save(dst, ckpt.params, ckpt.cfg, assets=ckpt.assets)
    else:
        ckpt = restore(src, dtype=dtype)
        export_hf(dst, ckpt.params, ckpt.cfg, assets=ckpt.assets, max_shard_size=max_shard_size,
                  progress=tick)
    cfg = ckpt.cfg
    return ConversionSummary(src, dst, to, cfg.model_type, cfg.num_layers, cfg.num_mtp_layers,
                             mtp_layout_for(cfg).name if cfg.num_mtp_layers else None,
                             count[0], count[1], time.perf_counter() - t0)
