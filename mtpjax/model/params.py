"""The parameter tree: one table of shapes, logical axes and initialisers, derived from the kinds.

Params are a nested dict of arrays. Every decoder layer has its own leaves (a tuple entry per
layer, not one stacked array): a slice of a stacked weight inside the on-device loops is
materialized as a copy on GPU (measured in docs/benchmarks.md), a per-layer buffer is read in
place.

    embed        [V, E]                 token embedding (shared with MTP modules)
    lm_head      [E, V]                 absent when tie_word_embeddings (embed.T is used)
    final_norm   [E]
    layers       L x {attn_norm [E], mlp_norm [E], <attention kind leaves>, <FFN kind leaves>}
    mtp          D x {enorm [E], hnorm [E], eh_proj [2E, E], out_norm [E], block: one layer}

`mtp/out_norm` is DeepSeek's shared_head.norm / MiMo's final_layernorm.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig
from mtpjax.model.kinds import ParamSpec, attention_kind, ffn_kind

__all__ = ["ParamSpec", "param_specs", "layer_specs", "abstract_params", "logical_axes",
           "init_params", "lm_head_weight", "tree_items", "tree_from_items"]


def layer_specs(cfg: ModelConfig, kinds: tuple[str, str]) -> dict[str, ParamSpec]:
    """One decoder layer of (attention kind, FFN kind): its two norms and each kind's leaves."""
    E = cfg.hidden_size
    return {
        "attn_norm": ParamSpec((E,), ("embed",), "ones"),
        "mlp_norm": ParamSpec((E,), ("embed",), "ones"),
        **attention_kind(kinds[0]).param_specs(cfg),
        **ffn_kind(kinds[1]).param_specs(cfg),
    }


def param_specs(cfg: ModelConfig) -> dict:
    """The single declaration of every parameter's shape, logical axes and init."""
    E, V = cfg.hidden_size, cfg.vocab_size
    specs: dict = {
        "embed": ParamSpec((V, E), ("vocab", "embed"), "normal"),
        "final_norm": ParamSpec((E,), ("embed",), "ones"),
        "layers": tuple(layer_specs(cfg, k) for k in cfg.layer_kinds()),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((E, V), ("embed", "vocab"), "normal")
    if cfg.num_mtp_layers:
        specs["mtp"] = tuple({
            "enorm": ParamSpec((E,), ("embed",), "ones"),
            "hnorm": ParamSpec((E,), ("embed",), "ones"),
            "eh_proj": ParamSpec((2 * E, E), ("embed2", "embed"), "normal"),
            "out_norm": ParamSpec((E,), ("embed",), "ones"),
            "block": layer_specs(cfg, cfg.mtp_layer_kind()),
        } for _ in range(cfg.num_mtp_layers))
    return specs


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def tree_items(tree, prefix=()):
    """(path tuple, leaf) of a nested dict/tuple tree in order; tuple entries have int keys."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from tree_items(v, prefix + (k,))
    elif isinstance(tree, (tuple, list)):
        for i, v in enumerate(tree):
            yield from tree_items(v, prefix + (i,))
    else:
        yield prefix, tree


def tree_from_items(items) -> dict:
    """Inverse of `tree_items`: nodes whose keys are ints become tuples."""
    root: dict = {}
    for path, leaf in items:
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = leaf

    def fix(node):
        if not isinstance(node, dict):
            return node
        if node and all(isinstance(k, int) for k in node):
            return tuple(fix(node[i]) for i in range(len(node)))
        return {k: fix(v) for k, v in node.items()}

    return fix(root)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32):
    """`jax.ShapeDtypeStruct` tree of the params (for Orbax restore, sharding, eval_shape)."""
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), param_specs(cfg),
                        is_leaf=_is_spec)


def logical_axes(cfg: ModelConfig):
    """Tree of logical axis-name tuples, same structure as the params."""
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def _stack(entries: tuple) -> dict | tuple:
    """Per-layer spec dicts -> one dict of [n, ...] specs when every entry has the same leaves
    (the layout params had before layers got their own leaves); else the entries unchanged."""
    first = entries[0]
    if any(jax.tree.structure(e, is_leaf=_is_spec) != jax.tree.structure(first, is_leaf=_is_spec)
           or jax.tree.leaves(e, is_leaf=_is_spec) != jax.tree.leaves(first, is_leaf=_is_spec)
           for e in entries):
        return entries
    return jax.tree.map(lambda s: ParamSpec((len(entries), *s.shape), s.axes, s.init), first,
                        is_leaf=_is_spec)


def _unstack(tree, n: int) -> tuple:
    return tuple(jax.tree.map(lambda a: a[i], tree) for i in range(n))


# Above this many elements a leaf is drawn slice by slice along its first axis: drawing it whole
# makes a float32 temporary (plus the random bits) of the full leaf, 30 GB for one of
# DeepSeek-V3's stacked expert weights, which does not fit beside the model on one GPU.
_WHOLE_DRAW_MAX = 1 << 28


def _normal(key: jax.Array, shape: tuple, std: float, dtype) -> jax.Array:
    """normal(0, std) in `dtype`; leaves larger than _WHOLE_DRAW_MAX elements are drawn one
    first-axis slice at a time (other values than a whole draw, same distribution)."""
    if math.prod(shape) <= _WHOLE_DRAW_MAX or len(shape) < 2:
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    keys = jax.random.split(key, shape[0])
    return jax.jit(lambda ks: jax.lax.map(lambda k: _normal(k, shape[1:], std, dtype), ks))(keys)


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, *, std: float = 0.02):
    """Random parameters (normal(0, std) weights, unit norms, zero biases).

    Uniform layers are drawn as one [L, ...] array per leaf and then split, so a seed gives the
    same model it gave when params were stored stacked (tests and notebooks keep their models).
    """
    specs = dict(param_specs(cfg))
    for name in ("layers", "mtp"):
        if name in specs:
            specs[name] = _stack(specs[name])
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(key, len(leaves))
    inits: dict[str, Callable] = {
        "normal": lambda k, s: _normal(k, s.shape, std, dtype),
        "ones": lambda k, s: jnp.ones(s.shape, dtype),
        "zeros": lambda k, s: jnp.zeros(s.shape, dtype),
    }
    params = jax.tree.unflatten(treedef, [inits[s.init](k, s) for k, s in zip(keys, leaves)])
    for name, n in (("layers", cfg.num_layers), ("mtp", cfg.num_mtp_layers)):
        if name in params and isinstance(params[name], dict):
            params[name] = _unstack(params[name], n)
    return params


def lm_head_weight(params) -> jax.Array:
    """[E, V] output projection (tied to the embedding when there is no lm_head)."""
    return params["lm_head"] if "lm_head" in params else params["embed"].T
