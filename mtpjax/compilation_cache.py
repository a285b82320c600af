"""JAX's persistent compilation cache, on by default for `mtpjax.LLM` and `mtpjax.generate`.

A compiled step of an 8B model takes seconds to build; with the cache a second process loads it
from disk instead. `enable_compilation_cache()` runs when an `LLM` is built and when `generate`
is called (never at `import mtpjax`), and then:

- does nothing when `MTPJAX_COMPILATION_CACHE=0` (also `false`, `no`, `off`) is set, or when
  `jax_enable_compilation_cache` is off;
- leaves everything as it is when JAX already has a cache folder (`jax_compilation_cache_dir`,
  e.g. from `JAX_COMPILATION_CACHE_DIR` or `jax.config.update`): the user's setting wins;
- otherwise sets the folder to `$MTPJAX_CACHE_DIR`, else `~/.cache/mtpjax/jax_cache`, and lowers
  `jax_persistent_cache_min_compile_time_secs` from JAX's 1 s to `MIN_COMPILE_TIME_SECS` (unless
  changed from the default) so that the engine's smaller step buckets are stored too.

The folder is trusted code (JAX loads executables from it): do not share it with other users.
"""

from __future__ import annotations

import os

import jax

ENV_SWITCH = "MTPJAX_COMPILATION_CACHE"
ENV_DIR = "MTPJAX_CACHE_DIR"
MIN_COMPILE_TIME_SECS = 0.2
_JAX_DEFAULT_MIN_COMPILE_TIME_SECS = 1.0
_OFF = ("0", "false", "no", "off")


def default_cache_dir() -> str:
    """`$MTPJAX_CACHE_DIR`, else `~/.cache/mtpjax/jax_cache`."""
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "mtpjax",
                                                   "jax_cache")


def is_opted_out() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in _OFF


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on (see the module docstring); returns the folder
    in use, or None when the cache is off. `path` replaces `default_cache_dir()`. Idempotent."""
    if is_opted_out() or not jax.config.jax_enable_compilation_cache:
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = os.path.abspath(os.path.expanduser(path or default_cache_dir()))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None                      # read-only home etc.: run without the cache
    jax.config.update("jax_compilation_cache_dir", path)
    if jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_TIME_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    return path
