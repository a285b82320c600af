"""The MoE layer of the DP-attention layout (`dp_attention.py`), inside its `shard_map`: each
device holds the tokens of its own requests and X / d of the routed experts.

    route own tokens -> all-gather (x, expert ids, weights) over the device axis
      -> own experts on every device's tokens -> reduce-scatter (psum_scatter) of f32[d*N, E]
      -> own tokens' outputs; + shared experts (replicated) on own tokens, no collective

SGLang's DP-attention MoE without DeepEP. The all-to-all dispatch / combine (DeepEP-style: send
each (token, expert) pair only to the device holding that expert) is not built.
model/moe.py calls it through `register_split_tokens_moe` (parallel/ imports model/, never the
reverse).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.model.backend import SplitTokens
from mtpjax.model.dense_ffn import swiglu, swiglu_fused
from mtpjax.model.moe import register_split_tokens_moe, routed_experts
from mtpjax.model.moe_routing import route


@register_split_tokens_moe
def split_tokens_moe(p: dict, x: jax.Array, cfg, valid: jax.Array, split: SplitTokens,
                     activation) -> jax.Array:
    """x [N, E] (this device's tokens), valid bool[N]; p's routed experts are this device's
    X / d (w_gate [X/d, E, I], ...), the router and shared experts whole -> [N, E].

    Each device routes only its own tokens (the router is replicated, its work is not); the
    gathered pairs of experts held elsewhere sort behind every group and are skipped."""
    N = x.shape[0]
    X_local = p["w_gate"].shape[0]
    X = cfg.moe.n_routed_experts
    ids, weights = route(p, x, cfg.moe)                            # [N, k] own tokens
    ids = jnp.where(valid[:, None], ids, X)                        # padding: routed nowhere
    gather = lambda a: jax.lax.all_gather(a, split.axis, tiled=True)
    x_all, ids_all, w_all = gather(x), gather(ids), gather(weights)   # [d*N, ...]
    first = jax.lax.axis_index(split.axis) * X_local
    mine = (ids_all >= first) & (ids_all < first + X_local)
    out = routed_experts(p, x_all, jnp.where(mine, ids_all - first, X_local), w_all,
                         ids_all[:, 0] < X, activation, out_dtype=jnp.float32,
                         per_device=True)                          # f32 [d*N, E], own experts
    out = jax.lax.psum_scatter(out, split.axis, scatter_dimension=0, tiled=True)   # [N, E]
    assert out.shape[0] == N
    if "shared_gate_up" in p:
        out = out + swiglu_fused(x, p["shared_gate_up"], p["shared_down"], activation)
    elif "shared_gate" in p:
        out = out + swiglu(x, p["shared_gate"], p["shared_up"], p["shared_down"], activation)
    return out.astype(x.dtype)
