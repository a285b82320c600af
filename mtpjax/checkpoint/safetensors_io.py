"""The safetensors format, one tensor at a time, and Hugging Face's sharded-folder convention.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`,
then the tensor bytes (offsets relative to the end of the header). Reading the header alone
gives every name, dtype and shape, so a checkpoint is validated before any data is read; each
tensor is then read into its own buffer (`read_tensor`), and files are written tensor by tensor
(`write_file`), so neither direction ever holds a whole file. bfloat16 / float8 use `ml_dtypes`
(a JAX dependency): no torch at runtime, and no `safetensors` package either: `read_header`
checks a header as that library does (the tensors, sorted by offset, tile the data section
exactly), so a damaged header fails by name instead of reading some other bytes as a tensor.

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

from mtpjax.checkpoint.errors import CheckpointError, json_object

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


# Bits per element of every dtype name the format defines (the `safetensors` library rejects any
# other name); only those in DTYPES can be read, the others still size-check their headers.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
    "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64,
    "U64": 64}
# The `safetensors` library's limit: a larger length is a damaged file, not a big header.
MAX_HEADER_BYTES = 100_000_000


class _Pairs(list):
    """A JSON object as its (key, value) pairs, so a key given twice is seen (a dict keeps the
    last one silently)."""


def _dup(pairs) -> str | None:
    seen = set()
    for k, _ in pairs:
        if k in seen:
            return k
        seen.add(k)
    return None


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _parse_header(file: str, raw: bytes) -> list[tuple[str, dict]]:
    """The header's (tensor name, entry) pairs, in file order; `__metadata__` checked and
    dropped. Every entry is an object with a known dtype, a shape and two offsets (not yet
    checked against each other)."""
    try:
        top = json.loads(raw.decode("utf-8"), object_pairs_hook=_Pairs)
    except ValueError as e:              # UnicodeDecodeError and JSONDecodeError alike
        raise CheckpointError(f"{file}: unreadable safetensors header ({e})") from None
    if not isinstance(top, _Pairs):
        raise CheckpointError(f"{file}: unreadable safetensors header (expected a JSON object "
                              f"of tensors, got a {type(top).__name__})")
    dup = _dup(top)
    if dup is not None:
        what = "__metadata__" if dup == "__metadata__" else f"tensor {dup}"
        raise CheckpointError(f"{file}: damaged safetensors header: {what} appears twice "
                              "(expected each name once)")
    out = []
    for name, entry in top:
        if name == "__metadata__":
            if entry is not None and not (isinstance(entry, _Pairs) and _dup(entry) is None and all(
                    isinstance(v, str) for _, v in entry)):
                raise CheckpointError(f"{file}: damaged safetensors header: __metadata__ must "
                                      "map names to strings (each once), got "
                                      f"{json.dumps(_plain(entry))}")
            continue
        where = f"{file}: damaged safetensors header: tensor {name}"
        if not isinstance(entry, _Pairs):
            raise CheckpointError(f"{where}: expected an object with dtype, shape and "
                                  f"data_offsets, got {json.dumps(_plain(entry))}")
        dup = _dup(entry)
        if dup is not None:
            raise CheckpointError(f"{where}: field {dup} appears twice")
        entry = dict(entry)
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
        if missing:
            raise CheckpointError(f"{where}: no {', '.join(missing)}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPE_BITS:
            raise CheckpointError(f"{where}: dtype {json.dumps(_plain(dtype))} is not a "
                                  f"safetensors dtype (one of {', '.join(DTYPE_BITS)})")
        if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
            raise CheckpointError(f"{where}: shape must be a list of ints >= 0, got "
                                  f"{json.dumps(_plain(shape))}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(_is_count(o) for o in offsets)):
            raise CheckpointError(f"{where}: data_offsets must be two ints >= 0 [begin, end], "
                                  f"got {json.dumps(_plain(offsets))}")
        out.append((name, entry))
    return out


def _plain(x):
    """A parsed JSON value with its objects back as dicts (for messages)."""
    if isinstance(x, _Pairs):
        return {k: _plain(v) for k, v in x}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def read_header(file: str) -> list[TensorInfo]:
    """Every tensor of one file. The header is validated as the `safetensors` library does:
    known dtypes, each tensor's byte count equal to its dtype and shape, and the tensors, sorted
    by offset, tiling the data section from its first byte to the end of the file without gap or
    overlap; stricter than it, a name given twice is refused too (JSON would keep the last one).
    So a damaged header fails here, naming the file and the tensor, instead of reading another
    tensor's bytes (or the header's) as this one."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file}: truncated file ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise CheckpointError(f"{file}: not a safetensors file, or a damaged one: its first "
                                  f"8 bytes give a header of {n} bytes, over the format's limit "
                                  f"of {MAX_HEADER_BYTES}")
        if n > size - 8:
            raise CheckpointError(f"{file}: truncated file (header of {n} bytes, file {size})")
        raw = f.read(n)
    entries = _parse_header(file, raw)
    data_bytes = size - 8 - n
    spans = []
    for name, entry in entries:
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        where = f"{file}: damaged safetensors header: tensor {name}"
        if end < begin:
            raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8:
            raise CheckpointError(f"{where}: {dtype} {list(shape)} is {bits} bits, not whole "
                                  "bytes")
        if end - begin != bits // 8:
            raise CheckpointError(f"{file}: tensor {name} has {end - begin} bytes for {dtype} "
                                  f"{list(shape)}, expected {bits // 8}")
        spans.append((begin, end, name))
    # As the library does: sorted by offsets, each tensor starts where the one before ends.
    pos, prev = 0, None
    for begin, end, name in sorted(spans, key=lambda s: s[:2]):
        where = f"{file}: damaged safetensors header: tensor {name}: data_offsets [{begin}, {end}]"
        if begin < pos:
            raise CheckpointError(f"{where} overlap tensor {prev[2]}'s [{prev[0]}, {prev[1]}] "
                                  f"(expected it to start at {pos}, where {prev[2]} ends)")
        if begin > pos:
            after = f"after tensor {prev[2]}" if prev else "at the start of the data"
            raise CheckpointError(f"{where} leave bytes [{pos}, {begin}) of the data unused "
                                  f"({after}; expected the tensors to cover the data without "
                                  "gaps)")
        pos, prev = end, (begin, end, name)
    if pos > data_bytes:
        raise CheckpointError(f"{file}: truncated file: tensor {prev[2]} ends at byte "
                              f"{8 + n + pos}, the file has {size}")
    if pos < data_bytes:
        last = f"the last tensor, {prev[2]}," if prev else "the header (no tensors)"
        raise CheckpointError(f"{file}: damaged safetensors file: {data_bytes - pos} bytes after "
                              f"the end of {last} at byte {8 + n + pos} (expected the tensors to "
                              f"end at the end of the file, byte {size})")
    return [TensorInfo(name, e["dtype"], tuple(e["shape"]), file, 8 + n + e["data_offsets"][0],
                       e["data_offsets"][1] - e["data_offsets"][0]) for name, e in entries]


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


def read_index(index_path: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> shard file name), checked."""
    with open(index_path, "rb") as f:
        index = json_object(f.read(), index_path, "a JSON object with a weight_map")
    if "weight_map" not in index:
        raise CheckpointError(f"{index_path}: no weight_map (expected {{\"weight_map\": "
                              "{tensor name: shard file name}})")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: weight_map must be an object {{tensor name: shard "
                              f"file name}}, got {json.dumps(weight_map)[:200]}")
    for name, fname in weight_map.items():
        # a file name of this folder: shards are compared by name with the files they are in
        if not (isinstance(fname, str) and fname and os.path.basename(fname) == fname
                and fname not in (".", "..")):
            raise CheckpointError(f"{index_path}: weight_map[{name!r}] must be the file name of "
                                  f"a shard in this folder, got {json.dumps(fname)}")
    return weight_map


def scan_folder(path: str) -> dict[str, TensorInfo]:
    """name -> TensorInfo for a Hugging Face folder (sharded with its index, or not)."""
    index_path = os.path.join(path, INDEX_FILE)
    weight_map: Mapping[str, str] | None = None
    if os.path.isfile(index_path):
        weight_map = read_index(index_path)
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
