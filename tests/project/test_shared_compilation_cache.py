"""The suite's shared persistent compilation cache (tests/shared_compilation_cache.py): every
test compiles through the run's temp folder, a marked test runs with JAX's defaults, and an
entry appears whole or not at all."""

import os
import tempfile

import jax
import jax.numpy as jnp
import pytest
from jax._src import lru_cache

from tests import shared_compilation_cache


def test_a_test_compiles_through_the_runs_temp_folder():
    if shared_compilation_cache.is_switched_off():
        pytest.skip(f"{shared_compilation_cache.ENV_SWITCH} is not 1")
    folder = jax.config.jax_compilation_cache_dir
    assert folder and os.path.basename(folder).startswith("mtpjax-tests-jax-cache-"), folder
    assert os.path.dirname(folder) == tempfile.gettempdir()           # never ~/.cache
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    before = set(os.listdir(folder))
    jax.jit(lambda x: x * 5.5 - 2.25)(jnp.ones(17))        # a program no other test compiles
    assert any(f.endswith("-cache") for f in set(os.listdir(folder)) - before)


@pytest.mark.own_compilation_cache
def test_a_marked_test_runs_with_jaxs_defaults():
    assert jax.config.jax_compilation_cache_dir is None
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0


def test_the_settings_come_back_after_a_marked_test():
    if shared_compilation_cache.is_switched_off():
        pytest.skip(f"{shared_compilation_cache.ENV_SWITCH} is not 1")
    with shared_compilation_cache.jax_defaults():
        assert jax.config.jax_compilation_cache_dir is None
    assert os.path.basename(jax.config.jax_compilation_cache_dir).startswith(
        "mtpjax-tests-jax-cache-")


def test_an_entry_is_written_whole_under_its_name_and_never_replaced(tmp_path):
    if shared_compilation_cache.is_switched_off():
        pytest.skip(f"{shared_compilation_cache.ENV_SWITCH} is not 1 (JAX's own writes)")
    assert getattr(lru_cache.LRUCache.put, "atomic", False), "JAX's in-place write is in use"
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("k", b"first")
    cache.put("k", b"second")                                # JAX's rule: the first stays
    assert os.listdir(tmp_path) == ["k-cache"]               # no temporary file left behind
    assert cache.get("k") == b"first"
