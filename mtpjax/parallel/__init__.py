"""Several devices with jax.sharding: the ("data", "model") mesh, the sharding table from logical
axes to mesh axes, placement of params and state, the per-device kernels under shard_map, the
DP-attention layout for MLA + MoE models (dp_attention.py, dp_expert_parallel.py,
dp_generate.py), and multi-process helpers. See docs/parallel.md."""

from mtpjax.parallel.mesh import AXES, check_mesh, make_mesh, replicated
from mtpjax.parallel.sharding import (RULES, param_shardings, partition_spec, pin,
                                      state_shardings)
from mtpjax.parallel.placement import create_sharded, replicate, shard_params, sharded_inputs
from mtpjax.parallel.distributed import initialize, to_host
from mtpjax.parallel import kernels  # noqa: F401,E402  registers the attention mesh layer
from mtpjax.parallel import expert_parallel  # noqa: F401,E402  registers the expert-parallel MoE
from mtpjax.parallel import dp_expert_parallel  # noqa: F401,E402  registers the DP-attention MoE

__all__ = ["AXES", "RULES", "check_mesh", "create_sharded", "initialize", "make_mesh",
           "param_shardings", "partition_spec", "pin", "replicate", "replicated", "shard_params",
           "sharded_inputs", "state_shardings", "to_host"]
