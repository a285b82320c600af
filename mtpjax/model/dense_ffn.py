"""FFN kind "dense": the SwiGLU MLP of Llama/Qwen, `down(silu(x gate) * (x up))`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.model.kinds import ParamSpec, register_ffn_kind
from mtpjax.model.linear import linear


def swiglu(x, w_gate, w_up, w_down, activation=jax.nn.silu):
    """down(act(x gate) * (x up)): the dense MLP, also DeepSeek's shared experts."""
    return linear(activation(linear(x, w_gate)) * linear(x, w_up), w_down)


def swiglu_fused(x, w_gate_up, w_down, activation=jax.nn.silu):
    """`swiglu` with gate | up concatenated at load (model/fused.py): one GEMM, then split."""
    gate, up = jnp.split(linear(x, w_gate_up), 2, axis=-1)
    return linear(activation(gate) * up, w_down)


class DenseFFN:
    name = "dense"
    hf_rows = {
        "w_gate": ("mlp.gate_proj.weight", True),
        "w_up": ("mlp.up_proj.weight", True),
        "w_down": ("mlp.down_proj.weight", True),
    }
    activation = staticmethod(jax.nn.silu)

    def param_specs(self, cfg) -> dict[str, ParamSpec]:
        E, I = cfg.hidden_size, cfg.intermediate_size
        return {
            "w_gate": ParamSpec((E, I), ("embed", "mlp"), "normal"),
            "w_up": ParamSpec((E, I), ("embed", "mlp"), "normal"),
            "w_down": ParamSpec((I, E), ("mlp", "embed"), "normal"),
        }

    def __call__(self, p: dict, x, cfg, valid, mesh=None):
        """x [N, E] -> [N, E]; a per-token op, so padding rows (valid False) need no mask."""
        if "w_gate_up" in p:
            return swiglu_fused(x, p["w_gate_up"], p["w_down"], self.activation)
        return swiglu(x, p["w_gate"], p["w_up"], p["w_down"], self.activation)


DENSE = register_ffn_kind(DenseFFN())
