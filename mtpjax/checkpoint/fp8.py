"""Block-scaled FP8 checkpoints (DeepSeek-V3's format), dequantized as they are read.

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. Each quantized weight `X.weight`
[R, C] is stored as F8_E4M3 beside a float32 `X.weight_scale_inv` [ceil(R/128), ceil(C/128)]
(the last row / column of blocks may be partial); the weight is

    W[i, j] = float32(X[i, j]) * scale_inv[i // 128, j // 128]

Other tensors (norms, embeddings, lm_head, the MoE router) are stored unquantized. `split_scales`
pairs every weight with its scale from the headers alone, so loading validates the pairing
before any data is read, and hands the key table the weights as "F32" (what dequantizing gives)
without the scales; `dequantize` then turns one tensor into float32 when it is read
(load_hf(fp8="dequantize")), or `kept` pairs the stored values with their scale as an
`Fp8Weight` (load_hf's default: the model runs on FP8 weights, model/fp8_weight.py).
Any positive block size is read (export writes the params' own); released checkpoints use 128.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from mtpjax.checkpoint.errors import CheckpointError
from mtpjax.checkpoint.safetensors_io import DTYPE_NAMES, DTYPES

SCALE_SUFFIX = "_scale_inv"                    # "X.weight" -> "X.weight_scale_inv"
DEQUANTIZED_DTYPE = "F32"
SCALE_DTYPES = ("F32", "BF16", "F16")
FMT_DTYPES = {"e4m3": "F8_E4M3"}               # quantization_config fmt -> safetensors dtype
DEFAULT_BLOCK = (128, 128)                     # what released checkpoints use


@dataclasses.dataclass(frozen=True)
class BlockFp8:
    """A supported `quantization_config`."""

    block: tuple[int, int]       # (rows, cols) of one scale block
    weight_dtype: str            # safetensors dtype of the quantized weights ("F8_E4M3")


def from_hf_config(hf_config: Mapping, source: str = "config.json") -> BlockFp8 | None:
    """config.json's quantization_config -> BlockFp8; None without one. Raises for anything
    other than block-scaled e4m3 FP8 with 128x128 blocks and dynamic activations."""
    q = hf_config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise CheckpointError(f"{source}: quantization_config is not an object: {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{source}: quantization_config quant_method {method!r} is not "
                              "supported; supported: 'fp8' (block-scaled, as DeepSeek-V3 ships)")
    fmt = q.get("fmt", "e4m3")
    if fmt not in FMT_DTYPES:
        raise CheckpointError(f"{source}: quantization_config fmt {fmt!r} is not supported; "
                              f"supported: {tuple(FMT_DTYPES)}")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise CheckpointError(f"{source}: quantization_config activation_scheme {act!r} is not "
                              "supported (static activation scales); supported: 'dynamic'")
    raw = q.get("weight_block_size")
    try:
        block = tuple(int(b) for b in raw)
        ok = len(block) == 2 and min(block) > 0 and all(int(b) == b for b in raw)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{source}: quantization_config weight_block_size {raw!r} is not supported; "
            f"expected two positive ints [rows, cols] such as {list(DEFAULT_BLOCK)} "
            "(per-tensor FP8 has no block size)")
    return BlockFp8(block, FMT_DTYPES[fmt])


def to_hf_config(block: tuple[int, int], base: Mapping | None = None) -> dict:
    """The quantization_config export writes for weights in `block` (Hugging Face's [out, in]
    orientation), keeping the other keys of the source's (`base`)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            **(base or {}), "weight_block_size": [int(b) for b in block]}


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """[ceil(R / block_rows), ceil(C / block_cols)] for a weight [R, C]."""
    return tuple(math.ceil(n / b) for n, b in zip(shape, block))


def split_scales(quant: BlockFp8 | None, tensors: Mapping[str, tuple[tuple[int, ...], str]],
                 source: str = "checkpoint") -> tuple[dict, dict[str, str]]:
    """name -> (shape, safetensors dtype) of a whole checkpoint -> (the same without the scales
    and with every quantized weight as "F32", {quantized weight: its scale's name}).

    Raises one CheckpointError naming every quantized weight without its scale, scale of the
    wrong shape or dtype, scale without its weight, and FP8 tensor the config does not explain.
    """
    scales = {n: n[:-len(SCALE_SUFFIX)] for n in tensors if n.endswith(SCALE_SUFFIX)}
    fp8 = [n for n, (_, dtype) in tensors.items() if dtype.startswith("F8_")]
    if quant is None:
        if scales or fp8:
            name = (fp8 or sorted(scales))[0]
            raise CheckpointError(
                f"{source}: tensor {name} ({tensors[name][1]}) is FP8-quantized, but config.json "
                "has no quantization_config")
        return dict(tensors), {}
    errors = []
    for name in fp8:
        shape, dtype = tensors[name]
        if name in scales:
            continue                                   # reported below, as a scale
        if dtype != quant.weight_dtype:
            errors.append(f"{name}: dtype {dtype}, but quantization_config says "
                          f"{quant.weight_dtype}")
        elif len(shape) != 2:
            errors.append(f"{name}: {dtype} with shape {list(shape)}; block-scaled weights are 2-D")
        elif name + SCALE_SUFFIX not in tensors:
            errors.append(f"{name}: {dtype} without its scale {name + SCALE_SUFFIX} (expected "
                          f"shape {list(scale_shape(shape, quant.block))})")
    paired = {}
    for name, weight in sorted(scales.items()):
        shape, dtype = tensors[name]
        if weight not in tensors:
            errors.append(f"{name}: scale of {weight}, which the checkpoint does not have")
            continue
        wshape, wdtype = tensors[weight]
        if wdtype != quant.weight_dtype:
            errors.append(f"{name}: scale of {weight}, which is stored as {wdtype}, not "
                          f"{quant.weight_dtype}")
            continue
        if len(wshape) != 2:
            continue                                   # reported above, as the weight
        want = scale_shape(wshape, quant.block)
        if tuple(shape) != want:
            errors.append(f"{name}: shape {list(shape)}, expected {list(want)} (blocks of "
                          f"{list(quant.block)} over {weight} {list(wshape)})")
        elif dtype not in SCALE_DTYPES:
            errors.append(f"{name}: dtype {dtype}, expected one of {', '.join(SCALE_DTYPES)}")
        else:
            paired[weight] = name
    if errors:
        more = f"\n  ... and {len(errors) - 12} more" if len(errors) > 12 else ""
        raise CheckpointError(f"{source} does not match its FP8 quantization_config "
                              f"(blocks of {list(quant.block)}):"
                              + "".join(f"\n  {e}" for e in errors[:12]) + more)
    weights = {n: (shape, DEQUANTIZED_DTYPE if n in paired else dtype)
               for n, (shape, dtype) in tensors.items() if n not in scales}
    return weights, paired


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """FP8 weight [R, C] and its scale_inv [ceil(R/br), ceil(C/bc)] -> float32 [R, C]: each
    element times its block's scale, one float32 multiply (a row of blocks at a time, so nothing
    of the weight's size is held beyond the output)."""
    br, bc = block
    want = scale_shape(weight.shape, block)
    if weight.ndim != 2 or scale_inv.shape != want:
        raise CheckpointError(f"scale_inv shape {list(scale_inv.shape)}, expected {list(want)} "
                              f"for a weight {list(weight.shape)}")
    out = weight.astype(np.float32)
    scale = np.asarray(scale_inv, np.float32)
    for i in range(scale.shape[0]):
        rows = out[i * br:(i + 1) * br]
        rows *= np.repeat(scale[i], bc)[:weight.shape[1]]
    return out


def kept(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], dtype="bfloat16"):
    """FP8 weight [R, C] and its scale_inv, as stored -> an `Fp8Weight` of the two (host arrays,
    Hugging Face's orientation; the key table transposes it like any weight). Scales become
    float32. dtype: what the weight stands for (its dequantized dtype)."""
    from mtpjax.model.fp8_weight import Fp8Weight
    want = scale_shape(weight.shape, block)
    if weight.ndim != 2 or scale_inv.shape != want:
        raise CheckpointError(f"scale_inv shape {list(scale_inv.shape)}, expected {list(want)} "
                              f"for a weight {list(weight.shape)}")
    return Fp8Weight(weight, np.asarray(scale_inv, np.float32), tuple(block),
                     np.dtype(dtype).name)


def fill(buf, index: tuple, w):
    """buf[index] = w for a leaf buffer being assembled, where w is an `Fp8Weight` (a tensor
    kept FP8): the first such tensor turns the leaf's numpy buffer (its shape and dtype) into an
    Fp8Weight of two numpy buffers, values and scales, filled alike. Returns the buffer."""
    from mtpjax.model.fp8_weight import Fp8Weight, scale_grid
    if not isinstance(buf, Fp8Weight):
        buf = Fp8Weight(np.empty(buf.shape, w.values.dtype),
                        np.empty(scale_grid(buf.shape, w.block), np.float32), w.block,
                        np.dtype(buf.dtype).name)
    elif buf.block != w.block:
        raise CheckpointError(f"FP8 blocks {list(w.block)} and {list(buf.block)} in one leaf")
    buf.values[index] = w.values
    buf.scale[index] = w.scale
    return buf


def same_leaf(a, buf, dtype) -> bool:
    """Does a copy of a shared tensor (e.g. DeepSeek's MTP copy of lm_head) equal the leaf it
    duplicates? Both FP8: values and scales bit for bit."""
    from mtpjax.model.fp8_weight import Fp8Weight
    if isinstance(a, Fp8Weight) or isinstance(buf, Fp8Weight):
        return (isinstance(a, Fp8Weight) and isinstance(buf, Fp8Weight) and a.block == buf.block
                and np.array_equal(a.values.view(np.uint8), buf.values.view(np.uint8))
                and np.array_equal(a.scale, buf.scale))
    return np.array_equal(a.astype(dtype), buf)


def dequantize_state_dict(tensors: Mapping[str, object], quant: BlockFp8 | None = None) -> dict:
    """In-memory HF tensors (numpy, or torch with its float8 dtypes) of an FP8 checkpoint -> the
    same dict with each quantized weight dequantized to a float32 numpy array and the scales
    dropped, ready for `from_hf_state_dict`. quant: default 128x128 blocks of e4m3."""
    quant = quant or BlockFp8(DEFAULT_BLOCK, FMT_DTYPES["e4m3"])
    meta = {n: (tuple(v.shape), _dtype_name(v)) for n, v in tensors.items()}
    weights, paired = split_scales(quant, meta, "state dict")
    return {n: dequantize(_numpy(tensors[n]), _numpy(tensors[paired[n]], np.float32), quant.block)
            if n in paired else tensors[n] for n in weights}


_TORCH_DTYPES = {"torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                 "torch.float64": "F64", "torch.float8_e4m3fn": "F8_E4M3",
                 "torch.float8_e5m2": "F8_E5M2"}


def _dtype_name(value) -> str:
    if hasattr(value, "detach"):              # torch tensor
        return _TORCH_DTYPES.get(str(value.dtype), str(value.dtype))
    dtype = np.asarray(value).dtype
    return DTYPE_NAMES.get(dtype, str(dtype))


def _numpy(value, dtype=None) -> np.ndarray:
    """numpy array of a numpy / torch tensor (torch float8 through its bytes: its .numpy()
    refuses them, as it does bfloat16)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        name = _dtype_name(value)
        if name.startswith("F8_"):
            import torch
            value = value.view(torch.uint8).numpy().view(DTYPES[name])
        else:
            value = value.float().numpy()
    return np.asarray(value, dtype)


def export_sources(name: str, hf_shape: tuple[int, ...], leaf, index: tuple, transpose: bool,
                   dtype=None) -> tuple[list, tuple[int, int] | None]:
    """What export writes for tensor `name` of an `Fp8Weight` leaf (`index`: its expert, if the
    leaf stacks them; `transpose`: Hugging Face stores it [out, in]). dtype None: the values as
    F8_E4M3 and `name + "_scale_inv"` as F32, bit for bit what the leaf holds, with the block in
    Hugging Face's orientation; else the dequantized weight in dtype (block None)."""
    import jax

    from mtpjax.checkpoint.safetensors_io import TensorSource
    from mtpjax.model.fp8_weight import Fp8Weight

    def part(a):
        a = np.asarray(jax.device_get(a[index] if index else a))
        return a.T if transpose else a

    if dtype is not None:
        out = np.dtype(dtype)

        def fetch_dequantized():
            w = Fp8Weight(leaf.values[index] if index else leaf.values,
                          leaf.scale[index] if index else leaf.scale, leaf.block, out.name)
            a = np.asarray(jax.device_get(w.dequantize()))
            return a.T if transpose else a

        return [TensorSource(name, hf_shape, out, fetch_dequantized)], None
    block = tuple(reversed(leaf.block)) if transpose else tuple(leaf.block)
    return [TensorSource(name, hf_shape, np.dtype(leaf.values.dtype), lambda: part(leaf.values)),
            TensorSource(name + SCALE_SUFFIX, scale_shape(hf_shape, block), np.dtype(np.float32),
                         lambda: part(leaf.scale))], block


def export_block(blocks: set, source_config: Mapping | None) -> dict:
    """The quantization_config for the FP8 tensors export wrote in `blocks` (one block size:
    config.json has one weight_block_size); a CheckpointError otherwise."""
    if len(blocks) != 1:
        raise CheckpointError(
            f"FP8 weights in blocks {sorted(list(b) for b in blocks)} (Hugging Face's [out, in] "
            "orientation): a checkpoint's quantization_config has one weight_block_size; "
            "per-output-channel scales differ per matrix. Quantize with one block size, or "
            "export dequantized (export_hf(..., dtype=jnp.bfloat16))")
    base = (source_config or {}).get("quantization_config")
    return to_hf_config(next(iter(blocks)), base if isinstance(base, Mapping) else None)
