"""mtpjax: multi-token-prediction speculative decoding in JAX/Pallas over a paged KV cache."""

from mtpjax.config import ModelConfig, RopeScaling, SamplingParams, SpecConfig
from mtpjax.model import forward, init_params, mtp_forward
from mtpjax.generate import GenerateOutput, generate

__all__ = ["ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig", "forward", "init_params",
           "mtp_forward", "generate", "GenerateOutput"]
__version__ = "0.1.0"
