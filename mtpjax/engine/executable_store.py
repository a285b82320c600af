"""Compiled engine steps saved whole, so a second process skips tracing, lowering and compiling.

JAX's persistent compilation cache (`mtpjax/compilation_cache.py`) saves XLA's work, but finding
an entry needs the program's HLO: a warm start still traced and lowered each of the engine's
step programs (56 at the 8B shape, ~1 s each: 64.6 s to the first token, docs/benchmarks.md).
The store keys a step by what determines it instead — the code (a hash of the sources of
`mtpjax` and `pallas_kernels`), the JAX and jaxlib versions, the devices, XLA flags and the
compile options, the step's static arguments and the shapes, dtypes and shardings of its array
arguments — and saves the compiled executable itself (`jax.experimental.serialize_executable`).
A hit is one file read and one load: no Python tracing at all.

On with the persistent cache (same switch, `MTPJAX_COMPILATION_CACHE=0` turns both off), in
the folder beside JAX's cache folder with `_executables` appended (by default
`~/.cache/mtpjax/jax_cache_executables`). A file that fails to load
(another build of jaxlib, a truncated write) is recompiled and replaced, with a warning. The
folder is trusted code, as JAX's cache is: loading runs what is in it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import threading
import warnings
from pathlib import Path

import jax

from mtpjax.compilation_cache import is_opted_out
from mtpjax.step_jit import STEP_COMPILER_OPTIONS

FORMAT = 1                  # bump when the file layout changes
_SOURCES: str | None = None


def source_fingerprint() -> str:
    """sha256 of every .py file of the mtpjax and pallas_kernels packages (once per process):
    any code change gives new keys."""
    global _SOURCES
    if _SOURCES is None:
        import mtpjax
        import pallas_kernels
        h = hashlib.sha256()
        for pkg in (mtpjax, pallas_kernels):
            root = Path(pkg.__file__).parent
            for f in sorted(root.rglob("*.py")):
                h.update(str(f.relative_to(root)).encode())
                h.update(f.read_bytes())
        _SOURCES = h.hexdigest()
    return _SOURCES


def _leaf_signature(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{sharding}"


def step_key(name: str, args: tuple, static: dict) -> str:
    """Hex key of one compiled step: `args` the array arguments (pytrees), `static` the static
    arguments by name (their reprs must be deterministic: frozen dataclasses, ints, strings)."""
    devices = jax.devices()
    parts = [
        f"format={FORMAT}", name, source_fingerprint(), jax.__version__,
        getattr(jax.lib, "__version__", "") or jax.extend.backend.get_backend().platform_version,
        jax.default_backend(), str([(d.platform, d.device_kind, d.id) for d in devices]),
        str(jax.process_count()), os.environ.get("XLA_FLAGS", ""),
        repr(sorted(STEP_COMPILER_OPTIONS.items())),
        f"x64={jax.config.jax_enable_x64}",
        f"precision={jax.config.jax_default_matmul_precision}",
        repr(sorted((k, repr(v)) for k, v in static.items())),
        str(jax.tree.structure(args)),
        "|".join(_leaf_signature(x) for x in jax.tree.leaves(args)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


class ExecutableStore:
    """Loads and saves compiled steps by `step_key` in one folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.hits = self.misses = 0
        self._lock = threading.Lock()          # lookups run on a thread pool

    @classmethod
    def default(cls) -> "ExecutableStore | None":
        """The store beside JAX's compilation cache folder (`<folder>_executables`), or None
        when the cache is off or has no folder (or the store's cannot be made)."""
        cache = jax.config.jax_compilation_cache_dir
        if is_opted_out() or not jax.config.jax_enable_compilation_cache or not cache:
            return None
        folder = os.path.abspath(cache).rstrip(os.sep) + "_executables"
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            return None
        return cls(folder)

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.jaxexec")

    def load(self, key: str):
        """The stored executable (a `jax.stages.Compiled`) or None."""
        from jax.experimental.serialize_executable import deserialize_and_load
        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            return deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:                       # noqa: BLE001 (any failure: recompile)
            warnings.warn(f"compiled step {path} could not be loaded ({type(e).__name__}: "
                          f"{str(e)[:200]}); compiling it again", stacklevel=2)
            return None

    def save(self, key: str, compiled) -> None:
        """Writes atomically (temporary file, then rename); a failure only warns."""
        from jax.experimental.serialize_executable import serialize
        try:
            blob = pickle.dumps(serialize(compiled))
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as e:                       # noqa: BLE001
            warnings.warn(f"compiled step not saved to {self.folder} ({type(e).__name__}: "
                          f"{str(e)[:200]})", stacklevel=2)

    def lookup(self, name: str, arrays: tuple, static: dict):
        """(key, the stored executable or None) of the step keyed by (name, its array
        arguments `arrays`, its static arguments `static`); counts hits and misses. Save a
        miss's compiled step with `save(key, compiled)`; call a Compiled with the array
        arguments only."""
        key = step_key(name, arrays, static)
        compiled = self.load(key)
        with self._lock:
            if compiled is None:
                self.misses += 1
            else:
                self.hits += 1
        return key, compiled
