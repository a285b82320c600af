"""Request keys are computed on the host, bit for bit what jax.random gives."""

import jax
import numpy as np
import pytest

from mtpjax import SamplingParams
from mtpjax.sampling import request_key, threefry2x32


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_request_keys_equal_jax_random_keys(seed):
    rng = np.random.default_rng(seed)
    edges = [0, 1, 2**31 - 1, 2**31, 2**32 - 1]
    for base in edges + rng.integers(0, 2**32, 8).tolist():
        for index in [0, 1, 2**31 - 1] + rng.integers(0, 2**31, 4).tolist():
            want = np.asarray(jax.random.fold_in(jax.random.PRNGKey(base), index), np.uint32)
            got = request_key(SamplingParams(), base, index)
            assert got.dtype == np.uint32 and np.array_equal(got, want), (base, index)
    for own in edges + rng.integers(0, 2**32, 8).tolist():
        want = np.asarray(jax.random.PRNGKey(own), np.uint32)
        assert np.array_equal(request_key(SamplingParams(seed=own), 7, 3), want), own


def test_threefry_matches_the_published_known_answer():
    # Random123's known-answer vector for threefry2x32_20 (key and counter all ones)
    got = threefry2x32((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF))
    assert got.tolist() == [0x1CB996FC, 0xBB002BE7]


def test_another_prng_implementation_takes_jax_own_keys():
    before = jax.config.jax_default_prng_impl
    try:
        jax.config.update("jax_default_prng_impl", "rbg")
        for base, index in [(0, 0), (5, 9), (2**32 - 1, 12)]:
            want = np.asarray(jax.random.fold_in(jax.random.PRNGKey(base), index), np.uint32)
            assert np.array_equal(request_key(SamplingParams(), base, index), want)
    finally:
        jax.config.update("jax_default_prng_impl", before)
