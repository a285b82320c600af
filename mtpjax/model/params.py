"""The parameter tree: one table of shapes, logical axes and initialisers, declared once.

Params are a nested dict of arrays. Target decoder layers are stacked on a leading `layers`
axis (scanned with `lax.scan`); the D MTP modules are stacked on a leading `mtp` axis.

    embed        [V, E]                 token embedding (shared with MTP modules)
    lm_head      [E, V]                 absent when tie_word_embeddings (embed.T is used)
    final_norm   [E]
    layers/      one decoder block, each leaf with a leading [L] axis (see `_block_specs`)
    mtp/enorm    [D, E]                 norm of the token embedding
    mtp/hnorm    [D, E]                 norm of the previous depth's hidden state
    mtp/eh_proj  [D, 2E, E]             projection of the concatenation
    mtp/out_norm [D, E]                 shared_head.norm (DeepSeek) / final_layernorm (MiMo)
    mtp/block/   one decoder block per module, each leaf with a leading [D] axis
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]          # logical axis names, one per dim (for sharding rules)
    init: str                      # "normal" | "ones" | "zeros"


def _block_specs(cfg: ModelConfig, n: int, stack_axis: str) -> dict[str, ParamSpec]:
    E, I, HD = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    NH, KV = cfg.num_heads, cfg.num_kv_heads
    s = lambda *shape: (n, *shape)
    a = lambda *axes: (stack_axis, *axes)
    specs = {
        "attn_norm": ParamSpec(s(E), a("embed"), "ones"),
        "mlp_norm": ParamSpec(s(E), a("embed"), "ones"),
        "wq": ParamSpec(s(E, NH * HD), a("embed", "q_heads"), "normal"),
        "wk": ParamSpec(s(E, KV * HD), a("embed", "kv_heads"), "normal"),
        "wv": ParamSpec(s(E, KV * HD), a("embed", "kv_heads"), "normal"),
        "wo": ParamSpec(s(NH * HD, E), a("q_heads", "embed"), "normal"),
        "w_gate": ParamSpec(s(E, I), a("embed", "mlp"), "normal"),
        "w_up": ParamSpec(s(E, I), a("embed", "mlp"), "normal"),
        "w_down": ParamSpec(s(I, E), a("mlp", "embed"), "normal"),
    }
    if cfg.qkv_bias:
        specs["bq"] = ParamSpec(s(NH * HD), a("q_heads"), "zeros")
        specs["bk"] = ParamSpec(s(KV * HD), a("kv_heads"), "zeros")
        specs["bv"] = ParamSpec(s(KV * HD), a("kv_heads"), "zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ParamSpec(s(HD), a("head_dim"), "ones")
        specs["k_norm"] = ParamSpec(s(HD), a("head_dim"), "ones")
    return specs


def param_specs(cfg: ModelConfig) -> dict:
    """The single declaration of every parameter's shape, logical axes and init."""
    E, V, D = cfg.hidden_size, cfg.vocab_size, cfg.num_mtp_layers
    specs: dict = {
        "embed": ParamSpec((V, E), ("vocab", "embed"), "normal"),
        "final_norm": ParamSpec((E,), ("embed",), "ones"),
        "layers": _block_specs(cfg, cfg.num_layers, "layers"),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"), "normal")
    if D:
        specs["mtp"] = {
            "enorm": ParamSpec((D, E), ("mtp", "embed"), "ones"),
            "hnorm": ParamSpec((D, E), ("mtp", "embed"), "ones"),
            "eh_proj": ParamSpec((D, 2 * E, E), ("mtp", "embed2", "embed"), "normal"),
            "out_norm": ParamSpec((D, E), ("mtp", "embed"), "ones"),
            "block": _block_specs(cfg, D, "mtp"),
        }
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
    """`jax.ShapeDtypeStruct` tree of the params (for Orbax restore, sharding, eval_shape)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg),
                        is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig):
    """Tree of logical axis-name tuples, same structure as the params."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, *, std: float = 0.02):
    """Random parameters (normal(0, std) weights, unit norms, zero biases)."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    inits: dict[str, Callable] = {
        "normal": lambda k, s: (std * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype),
        "ones": lambda k, s: jnp.ones(s.shape, dtype),
        "zeros": lambda k, s: jnp.zeros(s.shape, dtype),
    }
    return jax.tree.unflatten(treedef, [inits[s.init](k, s) for k, s in zip(keys, leaves)])


def lm_head_weight(params) -> jax.Array:
    """[E, V] output projection (tied to the embedding when there is no lm_head)."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T
