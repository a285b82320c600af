"""One JAX persistent compilation cache shared by every process of a pytest run.

The suite is dominated by XLA:CPU compiles of tiny models, and conftest drops every compiled
program after each module (`jax.clear_caches()`, for the workers' memory mappings), so the same
program used to be compiled again in every later module that needs it, and in each xdist worker.
With JAX's persistent cache in a folder of the run's own, a program is compiled once per run and
loaded from disk afterwards. Tracing and lowering still happen (the cache is keyed by the
lowered program), so spies inside traced functions still see their calls.

The controller (or the lone process without xdist) makes a fresh folder in the system's temp
folder, never ~/.cache, and removes it at the end; xdist workers get its path through
`workerinput`. Off unless `MTPJAX_TEST_SHARED_CACHE=1`: on the 2-core CI machine a clean-clone
run took 31.0 min of pytest with it and 29.7 without (its writes cost more than its hits save,
the suite's tiny models rarely repeat a program across modules). A test that counts compiles or
gives JAX a cache folder of its own is marked `own_compilation_cache`: it runs with JAX's cache
settings at their defaults (no folder) and the run's settings come back after it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import jax
from jax._src import lru_cache
from jax.experimental.compilation_cache import compilation_cache as jax_cc

ENV_SWITCH = "MTPJAX_TEST_SHARED_CACHE"
WORKERINPUT_KEY = "mtpjax_shared_compilation_cache"
MARKER = "own_compilation_cache"
MARKER_HELP = (f"{MARKER}: runs without the run's shared persistent compilation cache (JAX's "
               "cache settings at their defaults), for tests that count compiles or set a "
               "cache folder of their own")

# JAX's defaults for every setting `use` changes: what a marked test runs with.
_JAX_DEFAULTS = {"jax_compilation_cache_dir": None,
                 "jax_persistent_cache_min_compile_time_secs": 1.0,
                 "jax_persistent_cache_min_entry_size_bytes": 0}
_active: dict = {}


def is_switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "0").strip().lower() not in ("1", "true", "yes", "on")


def make_folder() -> str:
    return tempfile.mkdtemp(prefix="mtpjax-tests-jax-cache-")


def _apply(settings: dict) -> None:
    for name, value in settings.items():
        jax.config.update(name, value)
    jax_cc.reset_cache()                  # JAX reads the folder once, at its first compile


def use(folder: str) -> None:
    """Every compile of this process goes through the cache in `folder`, however short."""
    _install_atomic_writes()
    _active.clear()
    _active.update({"jax_compilation_cache_dir": folder,
                    "jax_persistent_cache_min_compile_time_secs": 0.0,
                    "jax_persistent_cache_min_entry_size_bytes": -1})
    _apply(_active)


@contextlib.contextmanager
def jax_defaults():
    """JAX's cache settings at their defaults for the block; the run's settings after it."""
    if not _active:
        yield
        return
    _apply(_JAX_DEFAULTS)
    try:
        yield
    finally:
        _apply(_active)


def remove(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _install_atomic_writes() -> None:
    """Both workers read and write one folder; JAX writes an entry in place, so the other could
    read half of it (a warning and a compile). Written to a temporary file and renamed instead."""
    put = lru_cache.LRUCache.put
    if getattr(put, "atomic", False):
        return

    def atomic_put(self, key: str, value: bytes) -> None:
        if self.eviction_enabled:                       # JAX's own file lock guards the folder
            return put(self, key, value)
        path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
        if path.exists():
            return
        fd, tmp = tempfile.mkstemp(dir=str(self.path), prefix=".partial-")
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        os.replace(tmp, path)
    atomic_put.atomic = True
    lru_cache.LRUCache.put = atomic_put
