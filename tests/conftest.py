import dataclasses

import jax
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from mtpjax import ModelConfig  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    base = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, num_mtp_layers=1)
    return dataclasses.replace(base, **overrides)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
