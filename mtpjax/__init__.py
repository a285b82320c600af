"""mtpjax: multi-token-prediction speculative decoding in JAX/Pallas over a paged KV cache."""

from mtpjax.config import ModelConfig, RopeScaling, SamplingParams, SpecConfig
from mtpjax.model import forward, init_params, mtp_forward
from mtpjax.generate import GenerateOutput, NonFiniteParamsWarning, generate

__all__ = ["ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig", "forward", "init_params",
           "mtp_forward", "generate", "GenerateOutput", "NonFiniteParamsWarning"]
__version__ = "0.1.0"

from mtpjax.engine import BlockManager, Sequence  # noqa: E402
from mtpjax.engine.llm import LLM, QueueFullError, RequestOutput, StreamEvent  # noqa: E402
from mtpjax.engine.data_parallel import DataParallelLLM  # noqa: E402

from mtpjax.speculative.adaptive import AdaptiveK  # noqa: E402

__all__ += ["BlockManager", "Sequence", "LLM", "DataParallelLLM", "QueueFullError",
            "RequestOutput", "StreamEvent",
            "AdaptiveK"]

# `mtpjax.checkpoint.load_hf(...)` after a plain `import mtpjax` (torch / orbax load lazily there).
from mtpjax import checkpoint  # noqa: E402

__all__ += ["checkpoint"]

from mtpjax.parallel import make_mesh  # noqa: E402

__all__ += ["make_mesh"]

from mtpjax.speculative.acceptance_eval import AcceptanceResult, eval_acceptance  # noqa: E402
from mtpjax import train  # noqa: E402
from mtpjax.train import LossConfig, Trainer, TrainState, finetune_mtp, joint_loss  # noqa: E402

__all__ += ["AcceptanceResult", "eval_acceptance", "train", "LossConfig", "Trainer", "TrainState",
            "finetune_mtp", "joint_loss"]
