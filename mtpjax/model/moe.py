"""FFN kind "moe": a DeepSeek-style mixture of experts (routed SwiGLU experts + always-on shared ones).

Routing (which experts each token gets, with which weights) is a rule of its own, named by
`cfg.moe.routing` (`model/moe_routing.py`: softmax greedy, softmax group-limited, sigmoid +
correction bias group-limited); `route` here is that module's.

Experts run as grouped matmuls (`grouped_swiglu`: Pallas kernels on one GPU, gate and up in one
launch; `jax.lax.ragged_dot` elsewhere) over the N*k (token, expert) pairs sorted by expert, so
each expert's weights multiply only its own tokens: never all experts on all tokens, never an
[N, n_experts, hidden] activation. Padding tokens (valid False) are routed nowhere:
they sort behind every expert's group, take no part in any matmul group and add nothing.

The shared experts are a dense SwiGLU (XLA) added to the routed sum, except at batch-1 decode
sizes on one GPU (`takes_fused_kernel`), where the fused routed kernel runs them as extra
pairs in its one launch (`moe_experts`; `MTPJAX_FUSED_SHARED=0` keeps them in XLA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.model.backend import SplitTokens
from mtpjax.model.dense_ffn import swiglu, swiglu_fused
from mtpjax.model.grouped_matmul import (expert_tile_swiglu, fused_moe_ffn, fused_moe_tokens,
                                         fused_shared_experts, grouped_swiglu, matmul_choice,
                                         moe_swiglu, uses_expert_tiles)
from mtpjax.model.fp8_weight import dequantize_in_step, is_fp8
from mtpjax.model.kinds import ParamSpec, register_ffn_kind
from mtpjax.model.moe_routing import route, routing_rule
from pallas_kernels.grouped_matmul.row_moves import combine_rows, weighted_sum


EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
# the shared experts' weights, fused gate | up (model/fused.py) or not; each a kernel keyword
SHARED_WEIGHTS = ("shared_gate_up", "shared_gate", "shared_up", "shared_down")


def takes_fused_kernel(p: dict, tokens: int, per_device: bool = False) -> bool:
    """Does `routed_experts`' model path (its defaults) run this many tokens (static) as
    `fused_moe_ffn`, one launch? On the Pallas path up to `fused_moe_tokens()`, bf16 / f32
    experts only."""
    return (not any(is_fp8(p[w]) for w in EXPERT_WEIGHTS) and tokens <= fused_moe_tokens()
            and uses_expert_tiles(tokens, p["w_gate"].shape[0], per_device))


def kernel_shared_weights(p: dict) -> dict:
    """p's shared-expert weights as `fused_moe_ffn`'s keywords, or {} where the kernel leaves
    them to XLA: none in p, FP8 ones, or MTPJAX_FUSED_SHARED=0."""
    shared = {w: p[w] for w in SHARED_WEIGHTS if w in p}
    if not shared or any(is_fp8(w) for w in shared.values()) or not fused_shared_experts():
        return {}
    return shared


def shared_experts(p: dict, x: jax.Array, activation) -> jax.Array | None:
    """The shared experts' SwiGLU over every token of x [N, E] (XLA), None without them."""
    if "shared_gate_up" in p:
        return swiglu_fused(x, p["shared_gate_up"], p["shared_down"], activation)
    if "shared_gate" in p:
        return swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"], activation)
    return None


def moe_experts(p: dict, x: jax.Array, ids: jax.Array, weights: jax.Array, valid: jax.Array,
                activation) -> jax.Array:
    """The routed experts' weighted sum plus the shared experts: x [N, E] -> [N, E] in x's
    dtype. Where the routed ones run as `fused_moe_ffn` (batch-1 decode on one GPU) the
    shared ones are the kernel's extra pairs (`kernel_shared_weights`), in the same launch
    (padding tokens then get 0); else XLA's SwiGLU is added after."""
    shared = kernel_shared_weights(p)
    if shared and takes_fused_kernel(p, x.shape[0]):
        return routed_experts(p, x, ids, weights, valid, activation, fused_shared=shared)
    out = routed_experts(p, x, ids, weights, valid, activation)
    extra = shared_experts(p, x, activation)
    return out if extra is None else out + extra


def routed_experts(p: dict, x: jax.Array, ids: jax.Array, weights: jax.Array,
                   valid: jax.Array, activation, matmul=None, out_dtype=None,
                   per_device: bool = False, expert_tiles: bool = True,
                   swiglu=None, tile_swiglu=None, fused_shared: dict | None = None) -> jax.Array:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for valid tokens, grouped by expert.

    x [N, E], ids int32[N, k] (an id >= the number of experts in p: routed nowhere), weights
    f32[N, k], valid bool[N] -> [N, E] in out_dtype (default x's). matmul: None for the
    model's path (on one GPU the Pallas kernels: `moe_swiglu`, the tile layout without a
    sort; elsewhere ragged_dot over the pairs sorted by expert), or a grouped matmul(rows, w,
    sizes) for each of the three projections (the MoE bench passes one). per_device: inside
    the expert-parallel `shard_map` (this device's experts only).
    expert_tiles: on the Pallas path, up to 16 tokens go through `expert_tile_swiglu` (one tile
    per touched expert), and up to `fused_moe_tokens()` (4) through `fused_moe_ffn` (the FFN and
    the weighted sum in one kernel); False takes `moe_swiglu` at every size (the MoE bench
    compares them).
    swiglu: None for the model's, or the whole routed SwiGLU over the sorted rows,
    swiglu(rows, w_gate, w_up, w_down, sizes) (the MoE bench passes tuned kernels).
    tile_swiglu: None for `expert_tile_swiglu`, or a function of its arguments (x, ids,
    w_gate, w_up, w_down, activation) used in its place, at up to four tokens too (the MoE
    bench's tuned tiles).
    fused_shared: the shared experts' weights (`kernel_shared_weights`) for `fused_moe_ffn` to
    add (`moe_experts`); only where it runs (`takes_fused_kernel`), else ValueError."""
    N, k = ids.shape
    X = p["w_gate"].shape[0]
    if any(is_fp8(p[w]) for w in EXPERT_WEIGHTS):
        # FP8 experts: the XLA grouped path over weights dequantized inside the step (the
        # Pallas kernels take bf16; FP8 kernels are future work, docs/fp8.md)
        p = dict(p)
        for w in EXPERT_WEIGHTS:
            p[w], x = dequantize_in_step(p[w], x)
        if matmul is None and swiglu is None:
            matmul = jax.lax.ragged_dot
    model_path = matmul is None and swiglu is None
    fused = (model_path and expert_tiles and tile_swiglu is None
             and takes_fused_kernel(p, N, per_device))
    if fused_shared and not fused:
        raise ValueError(f"fused_shared needs the fused kernel's path (the model's, up to "
                         f"fused_moe_tokens()={fused_moe_tokens()} tokens on the Pallas path); "
                         f"got {N} tokens")
    if model_path and expert_tiles and uses_expert_tiles(N, X, per_device):
        ids = jnp.where(~valid[:, None] | (ids >= X), -1, ids)     # -1: routed nowhere
        if fused:                                    # batch-1 decode: FFN + sum in one
            shared = dict(fused_shared, valid=valid) if fused_shared else {}
            y = fused_moe_ffn(x, ids, weights, p["w_gate"], p["w_up"], p["w_down"],
                              activation, **shared)               # f32 [N, E]
            return y.astype(out_dtype or x.dtype)
        y = (tile_swiglu or expert_tile_swiglu)(
            x, ids, p["w_gate"], p["w_up"], p["w_down"],
            activation)                                           # f32 [N, k, E], 0 for none
        return weighted_sum(y, weights).astype(out_dtype or x.dtype)
    expert = jnp.where(valid[:, None] & (ids < X), ids, X)          # X: past every group
    if model_path and matmul_choice(N * k, X, per_device) == "pallas":
        # no sort: x's rows straight into the tile layout, the weighted sum straight out
        return moe_swiglu(x, expert, weights, p["w_gate"], p["w_up"], p["w_down"],
                          activation, out_dtype or x.dtype)
    expert = expert.reshape(-1)
    order = jnp.argsort(expert, stable=True)                      # [N*k] pairs sorted by expert
    token = order // k
    sizes = jnp.zeros(X + 1, jnp.int32).at[expert].add(1)[:X]    # tokens per expert
    slot = jnp.zeros(N * k, jnp.int32).at[order].set(jnp.arange(N * k, dtype=jnp.int32))
    xs = x[token]                                                 # [N*k, E]
    if swiglu is not None:
        y = swiglu(xs, p["w_gate"], p["w_up"], p["w_down"], sizes)
    elif matmul is None:
        y = grouped_swiglu(xs, p["w_gate"], p["w_up"], p["w_down"], sizes, activation,
                           per_device)                            # [N*k, E]
    else:
        h = activation(matmul(xs, p["w_gate"], sizes)) * matmul(xs, p["w_up"], sizes)
        y = matmul(h, p["w_down"], sizes)                         # [N*k, E]
    # Back to token order: each token's k rows gathered and summed in a fixed order
    rows = jnp.where(expert < X, slot, N * k).reshape(N, k)       # N * k: routed nowhere
    return combine_rows(y, rows, weights, out_dtype or x.dtype)


# The expert-parallel form of this layer lives in parallel/ (it needs the sharding table and
# shard_map), which registers it on import: parallel/ imports model/, never the reverse.
_expert_parallel: list = []


def register_expert_parallel(fn):
    """fn(p, x [N, E], cfg, valid bool[N], mesh, activation) -> [N, E]: the layer with its
    routed experts split over the mesh's "model" axis (`mtpjax.parallel.expert_parallel`)."""
    _expert_parallel[:] = [fn]
    return fn


def _registered_expert_parallel(mesh):
    if not _expert_parallel:
        raise RuntimeError(f"the MoE layer on a mesh of {mesh.size} devices needs the "
                           "expert-parallel layer: import mtpjax.parallel (`import mtpjax` does)")
    return _expert_parallel[0]


_split_tokens_layer: list = []


def register_split_tokens_moe(fn):
    """fn(p, x [N, E], cfg, valid bool[N], split: SplitTokens, activation) -> [N, E]: the layer
    inside the DP-attention `shard_map`, each device holding its own N tokens and its own slice
    of the routed experts (`mtpjax.parallel.dp_expert_parallel`)."""
    _split_tokens_layer[:] = [fn]
    return fn


def uses_expert_parallel(cfg, mesh) -> bool:
    """Does the MoE layer run `expert_parallel` on this mesh? When the "model" axis has several
    devices and the routed experts divide over it (else the table replicates them, and XLA's
    partition of the plain layer splits their columns)."""
    if mesh is None:
        return False
    m = int(mesh.shape["model"])
    return m > 1 and cfg.moe.n_routed_experts % m == 0


class MoEFFN:
    name = "moe"
    hf_rows = {
        "router": ("mlp.gate.weight", True),
        "router_bias": ("mlp.gate.e_score_correction_bias", False),
        "shared_gate": ("mlp.shared_experts.gate_proj.weight", True),
        "shared_up": ("mlp.shared_experts.up_proj.weight", True),
        "shared_down": ("mlp.shared_experts.down_proj.weight", True),
    }
    # leaf -> (HF suffix with {e} = expert index, transposed): one row per expert, stacked on
    # the leaf's first axis
    hf_expert_rows = {
        "w_gate": ("mlp.experts.{e}.gate_proj.weight", True),
        "w_up": ("mlp.experts.{e}.up_proj.weight", True),
        "w_down": ("mlp.experts.{e}.down_proj.weight", True),
    }
    activation = staticmethod(jax.nn.silu)

    def param_specs(self, cfg) -> dict[str, ParamSpec]:
        E, X, I = cfg.hidden_size, cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size
        # the router is replicated (not split by expert): every device routes every token
        specs = {"router": ParamSpec((E, X), ("embed", None), "normal")}
        if routing_rule(cfg.moe.routing).biased:
            specs["router_bias"] = ParamSpec((X,), (None,), "zeros")
        specs["w_gate"] = ParamSpec((X, E, I), ("experts", "embed", "mlp"), "normal")
        specs["w_up"] = ParamSpec((X, E, I), ("experts", "embed", "mlp"), "normal")
        specs["w_down"] = ParamSpec((X, I, E), ("experts", "mlp", "embed"), "normal")
        if cfg.moe.n_shared_experts:
            S = I * cfg.moe.n_shared_experts
            specs["shared_gate"] = ParamSpec((E, S), ("embed", "mlp"), "normal")
            specs["shared_up"] = ParamSpec((E, S), ("embed", "mlp"), "normal")
            specs["shared_down"] = ParamSpec((S, E), ("mlp", "embed"), "normal")
        return specs

    def __call__(self, p: dict, x, cfg, valid, mesh=None):
        """x [..., E] -> [..., E]; valid bool[...] marks real tokens (padding is not routed).
        mesh: the run's mesh; experts split over its "model" axis run `expert_parallel`; a
        `SplitTokens` (inside the DP-attention shard_map) runs the gather / scatter layer."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        valid = jnp.broadcast_to(valid, shape[:-1]).reshape(-1)
        if isinstance(mesh, SplitTokens):
            if not _split_tokens_layer:
                raise RuntimeError("the MoE layer under DP attention needs "
                                   "mtpjax.parallel.dp_expert_parallel (`import mtpjax` does)")
            with jax.named_scope("dp_expert_parallel"):
                return _split_tokens_layer[0](p, x, cfg, valid, mesh,
                                              self.activation).reshape(shape)
        if uses_expert_parallel(cfg, mesh):
            with jax.named_scope("expert_parallel"):
                return _registered_expert_parallel(mesh)(p, x, cfg, valid, mesh,
                                                         self.activation).reshape(shape)
        with jax.named_scope("router"):
            ids, weights = route(p, x, cfg.moe)
        with jax.named_scope("experts"):
            out = moe_experts(p, x, ids, weights, valid, self.activation)
        return out.reshape(shape)


MOE = register_ffn_kind(MoEFFN())
