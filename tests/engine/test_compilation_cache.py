"""The persistent compilation cache: on in the documented folder, off with
MTPJAX_COMPILATION_CACHE=0, and never over a folder the user already gave JAX."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cc

from mtpjax.compilation_cache import MIN_COMPILE_TIME_SECS, enable_compilation_cache

# JAX's cache settings start at their defaults here, not the suite's shared cache.
pytestmark = pytest.mark.own_compilation_cache


@pytest.fixture
def jax_cache_config():
    """Puts JAX's cache settings back as they were (conftest runs the tests with the cache off)."""
    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {k: getattr(jax.config, k) for k in keys}
    yield
    for k, v in saved.items():
        jax.config.update(k, v)
    jax_cc.reset_cache()


def test_opt_out_leaves_jax_alone(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv("MTPJAX_COMPILATION_CACHE", "0")
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path / "cache"))
    assert enable_compilation_cache() is None
    assert jax.config.jax_compilation_cache_dir is None
    assert not (tmp_path / "cache").exists()


def test_a_folder_the_user_set_wins(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv("MTPJAX_COMPILATION_CACHE", "1")
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path / "ours"))
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "theirs"))
    assert enable_compilation_cache() == str(tmp_path / "theirs")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "theirs")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0    # JAX's, untouched
    assert not (tmp_path / "ours").exists()


def test_on_by_default_in_mtpjax_cache_dir_and_written(monkeypatch, tmp_path, jax_cache_config):
    monkeypatch.setenv("MTPJAX_COMPILATION_CACHE", "1")
    monkeypatch.setenv("MTPJAX_CACHE_DIR", str(tmp_path / "cache"))
    jax.jit(lambda x: x + 1)(jnp.ones(3))      # a compile before: the cache still turns on
    assert enable_compilation_cache() == str(tmp_path / "cache")
    assert enable_compilation_cache() == str(tmp_path / "cache")                # idempotent
    assert jax.config.jax_persistent_cache_min_compile_time_secs == MIN_COMPILE_TIME_SECS
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)    # store even this one
    jax.jit(lambda x: x * 3 - 1)(jnp.ones(5))
    assert any((tmp_path / "cache").iterdir())
