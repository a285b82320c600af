"""mtpjax: multi-token-prediction speculative decoding in JAX/Pallas over a paged KV cache."""

from mtpjax.config import ModelConfig, RopeScaling, SamplingParams, SpecConfig
from mtpjax.model import forward, init_params, mtp_forward
from mtpjax.generate import GenerateOutput, NonFiniteParamsWarning, generate

__all__ = ["ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig", "forward", "init_params",
           "mtp_forward", "generate", "GenerateOutput", "NonFiniteParamsWarning"]
# the layer kinds' sub-configs (ModelConfig.mla, ModelConfig.moe)
from mtpjax.model.mla_config import MLAConfig  # noqa: E402
from mtpjax.model.moe_config import MoEConfig  # noqa: E402

__all__ += ["MLAConfig", "MoEConfig"]
__version__ = "0.1.0"

from mtpjax.engine import BlockManager, Sequence  # noqa: E402
from mtpjax.engine.llm import LLM, QueueFullError, RequestOutput, StreamEvent  # noqa: E402
from mtpjax.engine.data_parallel import DataParallelLLM  # noqa: E402

from mtpjax.speculative.adaptive import AdaptiveK  # noqa: E402
from mtpjax.structured import StructuredOutput  # noqa: E402

__all__ += ["BlockManager", "Sequence", "LLM", "DataParallelLLM", "QueueFullError",
            "RequestOutput", "StreamEvent",
            "AdaptiveK", "StructuredOutput"]

# `mtpjax.checkpoint.load_hf(...)` after a plain `import mtpjax` (torch / orbax load lazily there).
from mtpjax import checkpoint  # noqa: E402

__all__ += ["checkpoint"]

from mtpjax.parallel import make_mesh  # noqa: E402

__all__ += ["make_mesh"]

from mtpjax.model.fp8_weight import Fp8Weight  # noqa: E402
from mtpjax.model.quantize import dequantize_params, quantize_fp8  # noqa: E402
from mtpjax.memory_plan import MemoryPlan, memory_plan  # noqa: E402

__all__ += ["Fp8Weight", "quantize_fp8", "dequantize_params", "MemoryPlan", "memory_plan"]

from mtpjax import train  # noqa: E402
from mtpjax.train import LossConfig, Trainer, TrainState, joint_loss  # noqa: E402

__all__ += ["train", "LossConfig", "Trainer", "TrainState", "joint_loss"]

# Modules that are also scripts (`python -m mtpjax.train.finetune`, `python -m
# mtpjax.speculative.acceptance_eval`) load on first use: imported here, runpy would find them
# already in sys.modules when it runs them as __main__, and warn. (Not in __all__: the API
# reference documents them in their modules.)
_LAZY = {"AcceptanceResult": "mtpjax.speculative.acceptance_eval",
         "eval_acceptance": "mtpjax.speculative.acceptance_eval",
         "finetune_mtp": "mtpjax.train.finetune"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mtpjax' has no attribute {name!r}")
