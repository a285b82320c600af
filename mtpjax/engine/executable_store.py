"""Compiled engine steps saved whole, so a second process skips tracing, lowering and compiling.

JAX's persistent compilation cache (`mtpjax/compilation_cache.py`) saves XLA's work, but finding
an entry needs the program's HLO: a warm start still traced and lowered each of the engine's
step programs (56 at the 8B shape, ~1 s each: 64.6 s to the first token, docs/benchmarks.md).
The store keys a step by what determines it instead — the code (a hash of the sources of
`mtpjax` and `pallas_kernels`), the JAX and jaxlib versions, the devices, XLA flags, every JAX
setting that can change a traced program or its random streams (`jax_threefry_partitionable`,
x64, matmul precision, ...), the compile options, the step's static arguments and the shapes,
dtypes and shardings of its array arguments — and saves the compiled executable itself
(`jax.experimental.serialize_executable`). A hit is one file read and one load: no tracing.

What may enter the store, and what is trusted from it:

- An entry is written only after its bytes were loaded back *and run*: the engine's warm-up
  deserializes the executable it just compiled and makes its dry run with that copy
  (`ModelRunner.warmup`). XLA:CPU cannot re-serialize an executable that JAX's persistent cache
  served (the copy loads, then fails at its first call with `NOT_FOUND: Function ... not
  found`); such a step runs from the compile and is not stored.
- An entry holds the text that its key hashes (`step_identity`) and a digest of its payload;
  one whose identity is not the requested step's (a file copied or renamed onto another key),
  whose payload is damaged, or that fails to load or to run is deleted and compiled again,
  with one warning per process.

On with the persistent cache (same switch, `MTPJAX_COMPILATION_CACHE=0` turns both off), in
the folder beside JAX's cache folder with `_executables` appended (by default
`~/.cache/mtpjax/jax_cache_executables`). The folder is trusted code, as JAX's cache is:
loading runs what is in it (the checks above catch accidents, not an attacker).
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

FORMAT = 2                  # bump when the file layout changes (2: identity + digest, verified)
_SOURCES: str | None = None

# JAX settings that cannot change a traced program, its compile or its random bits: where the
# caches live, logging and debugging output, transfer guards, timeouts. Every other
# `jax.config` value is part of the key, so a setting added by a later JAX is keyed by default.
_SETTINGS_NOT_IN_KEY = (
    "compilation_cache", "persistent_cache", "raise_persistent_cache_errors",
    "explain_cache_misses", "log_compiles", "logging_level", "debug_log_modules",
    "compiler_detailed_logging_min_ops", "pprint_use_color", "traceback", "tracer_error",
    "dump_ir", "include_debug_info_in_dumps", "captured_constants", "transfer_guard",
    "timeout", "check_proxy_envs", "distributed_debug", "source_url_schema",
    "log_checkpoint_residuals", "hlo_source_file_canonicalization_regex",
)


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


def program_settings() -> str:
    """The JAX settings of this process that can change a step's program or random streams."""
    values = jax.config.values
    return repr(sorted((k, repr(v)) for k, v in values.items()
                       if not any(s in k for s in _SETTINGS_NOT_IN_KEY)))


def _leaf_signature(x) -> str:
    sharding = getattr(x, "sharding", None)
    return f"{getattr(x, 'shape', ())}:{getattr(x, 'dtype', type(x).__name__)}:{sharding}"


def step_identity(name: str, args: tuple, static: dict) -> str:
    """Everything that determines one compiled step, as text: `args` the array arguments
    (pytrees), `static` the static arguments by name (their reprs must be deterministic:
    frozen dataclasses, ints, strings)."""
    devices = jax.devices()
    parts = [
        f"format={FORMAT}", name, source_fingerprint(), jax.__version__,
        getattr(jax.lib, "__version__", "") or jax.extend.backend.get_backend().platform_version,
        jax.default_backend(), str([(d.platform, d.device_kind, d.id) for d in devices]),
        str(jax.process_count()), os.environ.get("XLA_FLAGS", ""),
        repr(sorted(STEP_COMPILER_OPTIONS.items())),
        program_settings(),
        repr(sorted((k, repr(v)) for k, v in static.items())),
        str(jax.tree.structure(args)),
        "|".join(_leaf_signature(x) for x in jax.tree.leaves(args)),
    ]
    return "\n".join(parts)


def step_key(name: str, args: tuple, static: dict) -> str:
    """Hex key of one compiled step (the sha256 of its `step_identity`)."""
    return hashlib.sha256(step_identity(name, args, static).encode()).hexdigest()


def load_kernel_runtimes() -> None:
    """Makes the Mosaic GPU kernels' runtime library findable before an executable holding them
    is deserialized. Importing `jax.experimental.mosaic.gpu` names the library
    (MOSAIC_GPU_RUNTIME_LIB_PATH) for the kernels' custom call; a process that loads a stored
    step before tracing any Mosaic kernel has not imported it, and the load fails ("Symbols
    not found: mosaic_gpu_init_tma_desc, mosaic_gpu_launch_kernel", seen on an H200 with the
    V2-Lite step's MLA kernels), so the step was compiled again."""
    try:
        import jax.experimental.mosaic.gpu  # noqa: F401
    except ImportError:             # a jaxlib without Mosaic GPU holds no such kernels
        pass


class ExecutableStore:
    """Loads and saves compiled steps by `step_key` in one folder."""

    def __init__(self, folder: str):
        self.folder = folder
        self.hits = self.misses = 0
        self.refused: list[str] = []            # entries deleted this process, with why
        self.unstored = 0                       # compiles whose loaded-back copy failed to run
        self._warned = False
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

    def refuse(self, key: str, why: str) -> None:
        """Deletes the entry `key` (it failed to load or to run: `why`) so the step is compiled
        and stored again; warns once per process, naming the first such entry."""
        path = self._path(key)
        try:
            os.remove(path)
        except OSError:
            pass
        with self._lock:
            self.refused.append(f"{path}: {why}")
            first = not self._warned
            self._warned = True
        if first:
            warnings.warn(f"compiled step {path} could not be loaded ({why}); it and any other "
                          f"such entry of {self.folder} are compiled again and replaced",
                          stacklevel=3)

    def load(self, key: str, identity: str):
        """The stored executable (a `jax.stages.Compiled`) of the step whose `step_identity`
        is `identity`, or None (no entry, or one refused: see `refuse`)."""
        from jax.experimental.serialize_executable import deserialize_and_load
        path = self._path(key)
        if not os.path.exists(path):
            return None
        load_kernel_runtimes()
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT:
                raise ValueError(f"not a format-{FORMAT} entry")
            if entry["identity"] != identity:
                raise ValueError("it holds another step's program")
            if hashlib.sha256(entry["payload"]).hexdigest() != entry["digest"]:
                raise ValueError("its payload does not match its digest")
            return deserialize_and_load(entry["payload"], entry["in_tree"], entry["out_tree"])
        except Exception as e:                       # noqa: BLE001 (any failure: recompile)
            self.refuse(key, f"{type(e).__name__}: {str(e)[:200]}")
            return None

    def serialized(self, compiled):
        """(entry bytes minus identity, a copy of `compiled` loaded back from them) or None
        when this backend cannot serialize it (a warning says why). Run the copy before
        `save`: only bytes that loaded and ran are kept."""
        from jax.experimental.serialize_executable import deserialize_and_load, serialize
        try:
            payload, in_tree, out_tree = serialize(compiled)
            return (payload, in_tree, out_tree), deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:                       # noqa: BLE001
            warnings.warn(f"compiled step not saved to {self.folder} ({type(e).__name__}: "
                          f"{str(e)[:200]})", stacklevel=2)
            return None

    def save(self, key: str, identity: str, serialized) -> None:
        """Writes the entry for `key` from `serialized(...)`'s bytes atomically (temporary
        file, then rename); a failure only warns."""
        payload, in_tree, out_tree = serialized
        entry = dict(format=FORMAT, identity=identity, payload=payload, in_tree=in_tree,
                     out_tree=out_tree, digest=hashlib.sha256(payload).hexdigest())
        try:
            blob = pickle.dumps(entry)
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as e:                       # noqa: BLE001
            warnings.warn(f"compiled step not saved to {self.folder} ({type(e).__name__}: "
                          f"{str(e)[:200]})", stacklevel=2)

    def lookup(self, name: str, arrays: tuple, static: dict):
        """(key, identity, the stored executable or None) of the step named `name` with array
        arguments `arrays` and static arguments `static`; counts hits and misses. Call a
        Compiled with the array arguments only."""
        identity = step_identity(name, arrays, static)
        key = hashlib.sha256(identity.encode()).hexdigest()
        compiled = self.load(key, identity)
        with self._lock:
            if compiled is None:
                self.misses += 1
            else:
                self.hits += 1
        return key, identity, compiled

    def count_refused_hit(self) -> None:
        """A hit that failed its first run (and was refused) becomes a miss."""
        with self._lock:
            self.hits -= 1
            self.misses += 1
