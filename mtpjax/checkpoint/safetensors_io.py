"""The safetensors format, one tensor at a time, and Hugging Face's sharded-folder convention.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the tensor bytes (offsets relative to the end of the header). Reading the header alone
gives every name, dtype and shape, so a checkpoint is validated before any data is read; each
tensor is then read into its own buffer (`read_tensor`), and files are written tensor by tensor
(`write_file`), so neither direction ever holds a whole file. bfloat16 / float8 use `ml_dtypes`
(a JAX dependency): no torch at runtime.

A sharded folder has `model.safetensors.index.json` (`{"weight_map": {name: file}}`); an
unsharded one a single `model.safetensors`. `scan_folder` reads every header, checks the index
against them, and rejects a tensor stored twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from typing import Callable, Iterable, Mapping

import ml_dtypes
import numpy as np

from mtpjax.checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES: dict[str, np.dtype] = {name: np.dtype(t) for name, t in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_}.items()}
DTYPE_NAMES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are (from its file's header)."""

    name: str
    dtype: str                   # safetensors dtype name ("F32", "BF16", ...)
    shape: tuple[int, ...]
    file: str
    start: int                   # absolute byte offset of the data in `file`
    nbytes: int

    @property
    def np_dtype(self) -> np.dtype:
        return DTYPES[self.dtype]


def read_header(file: str) -> list[TensorInfo]:
    """Every tensor of one file, checked against the file size (a truncated file fails here)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated file ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"{file}: truncated file (header of {n} bytes, file {size})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: unreadable safetensors header (not a JSON object)")
    infos = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            dtype, shape = str(entry["dtype"]), tuple(int(s) for s in entry["shape"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: malformed header entry for tensor {name}") from None
        if dtype in DTYPES and (end - begin) != math.prod(shape) * DTYPES[dtype].itemsize:
            raise CheckpointError(f"{file}: tensor {name} has {end - begin} bytes for {dtype} "
                                  f"{list(shape)}")
        if 8 + n + end > size:
            raise CheckpointError(f"{file}: truncated file: tensor {name} ends at byte "
                                  f"{8 + n + end}, the file has {size}")
        infos.append(TensorInfo(name, dtype, shape, file, 8 + n + begin, end - begin))
    return infos


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor, read into a fresh buffer (the only copy held)."""
    if info.dtype not in DTYPES:
        raise CheckpointError(f"{info.file}: tensor {info.name} has unsupported dtype {info.dtype}")
    arr = np.empty(info.shape, info.np_dtype)
    with open(info.file, "rb") as f:
        f.seek(info.start)
        got = f.readinto(memoryview(arr.reshape(-1).view(np.uint8)))
    if got != info.nbytes:
        raise CheckpointError(f"{info.file}: truncated file while reading tensor {info.name} "
                              f"({got} of {info.nbytes} bytes)")
    return arr


def scan_folder(path: str) -> dict[str, TensorInfo]:
    """name -> TensorInfo for a Hugging Face folder (sharded with its index, or not)."""
    index_path = os.path.join(path, INDEX_FILE)
    weight_map: Mapping[str, str] | None = None
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                weight_map = json.load(f)["weight_map"]
            except (ValueError, KeyError, TypeError):
                raise CheckpointError(f"{index_path}: no readable weight_map") from None
        files = sorted(set(weight_map.values()))
        for fname in files:
            if not os.path.isfile(os.path.join(path, fname)):
                first = next(n for n, v in weight_map.items() if v == fname)
                raise CheckpointError(f"{path}: shard {fname} (holding {first} in {INDEX_FILE}) "
                                      "is missing")
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
    found: dict[str, TensorInfo] = {}
    for fname in files:
        for info in read_header(os.path.join(path, fname)):
            if info.name in found:
                raise CheckpointError(
                    f"tensor {info.name} is stored twice: in {os.path.basename(found[info.name].file)} "
                    f"and in {fname}")
            found[info.name] = info
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name in found and os.path.basename(found[name].file) != fname:
                raise CheckpointError(f"{INDEX_FILE} puts tensor {name} in {fname}, but it is in "
                                      f"{os.path.basename(found[name].file)}")
        for name, fname in weight_map.items():
            if name not in found:
                raise CheckpointError(f"tensor {name} is missing from {fname} "
                                      f"(listed in {INDEX_FILE})")
        unlisted = sorted(set(found) - set(weight_map))
        if unlisted:
            raise CheckpointError(f"tensor {unlisted[0]} is in "
                                  f"{os.path.basename(found[unlisted[0]].file)} but not in "
                                  f"{INDEX_FILE} ({len(unlisted)} such)")
    return found


# ---- writing -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TensorSource:
    """A tensor to write: its name, shape and dtype up front, its data on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fetch: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def write_file(file: str, tensors: Iterable[TensorSource],
               on_tensor: Callable[[TensorSource], None] | None = None) -> None:
    """Writes one safetensors file, fetching and writing one tensor at a time."""
    tensors = list(tensors)
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        dt = np.dtype(t.dtype)
        if dt not in DTYPE_NAMES:
            raise CheckpointError(f"tensor {t.name}: dtype {dt} cannot be stored in safetensors")
        header[t.name] = {"dtype": DTYPE_NAMES[dt], "shape": list(t.shape),
                          "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)              # data starts 8-byte aligned
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors:
            arr = np.ascontiguousarray(t.fetch(), dtype=t.dtype)
            if arr.shape != tuple(t.shape):
                raise CheckpointError(f"tensor {t.name}: got shape {arr.shape}, declared {t.shape}")
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
            if on_tensor is not None:
                on_tensor(t)


def write_folder(path: str, tensors: Iterable[TensorSource], max_shard_bytes: int | None = None,
                 on_tensor: Callable[[TensorSource], None] | None = None) -> list[str]:
    """Shards of at most `max_shard_bytes` (a bigger tensor gets its own) plus
    `model.safetensors.index.json`, or one `model.safetensors` when everything fits (or no limit
    is given), as transformers does. Returns the file names written."""
    tensors = list(tensors)
    shards: list[list[TensorSource]] = [[]]
    size = 0
    for t in tensors:
        if max_shard_bytes is not None and shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    n = len(shards)
    if n == 1:
        write_file(os.path.join(path, SINGLE_FILE), tensors, on_tensor)
        return [SINGLE_FILE]
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for fname, shard in zip(names, shards):
        write_file(os.path.join(path, fname), shard, on_tensor)
        weight_map.update({t.name: fname for t in shard})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors)},
                   "weight_map": weight_map}, f, indent=2)
    return names + [INDEX_FILE]
