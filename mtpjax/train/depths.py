"""Teacher-forced MTP depths over whole windows, in the two drafting regimes.

Notation: windows x int32[B, T + depths + 1]; root i = 0..T-1 is a position whose prefix
x_0..x_{i+1} is known (x_{i+1} is the pending token); h^0_i is the target's final-normed hidden
state at i. Depth s (0-based) predicts x_{i+s+2}, module m = s % D (D = num_mtp_layers).

multi_layer  (DeepSeek-V3's training layout; what `SpecConfig(method="multi_layer")` drafts)
    depth s at position i: module m on (h^s_i, x_{i+s+1}); h^{s+1}_i is its output hidden.
    Its attention reads the same depth at positions j <= i. So module s is fed module s-1's
    hidden state at the same position.

chain        (MTP used as EAGLE; what `SpecConfig(method="chain")` drafts)
    depth 0 is multi_layer's depth 0. Depth s >= 1 of root i sits at position i + s and feeds
    module m the previous depth's output g^{s-1}_i and x_{i+s+1}. Its attention reads module
    m's KV at positions j <= i built from target inputs (h^0_j, x_{j+1}) - the draft loop's
    first pass - plus module m's KV at positions i+1..i+s built from this root's chain inputs
    (g^{t-1}_i, x_{i+t+1}), t = 1..s - what the draft loop writes at draft positions. So a
    module is fed the hidden state a module (with D = 1: itself) produced one position earlier.
    All roots are computed at once (EAGLE-3's "training-time test" attention): a causal block
    over the T target-derived keys plus a diagonal block of the root's own s chain keys.
    Implemented for the "gqa" attention kind.

Both are written from the module formula (docs/models.md); `tests/train/test_train.py` checks them
against a per-root loop over `mtpjax.mtp_forward`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtpjax.config import ModelConfig
from mtpjax.model.gqa import qkv_projection
from mtpjax.model.kinds import ffn_kind
from mtpjax.model.layers import rms_norm
from mtpjax.model.mtp import _module_input, _module_output, mtp_forward
from mtpjax.model.transformer import logits_from_hidden

REGIMES = ("multi_layer", "chain")


def multi_layer_depths(params, cfg: ModelConfig, hidden0, windows, depths: int):
    """hidden0 [B, T, E] (h^0 at roots 0..T-1), windows int32[B, >= T + depths]
    -> list over depths of logits f32[B, T, V] (depth s at root i predicts x_{i+s+2})."""
    T = hidden0.shape[1]
    h, out = hidden0, []
    for s in range(depths):
        h, logits = mtp_forward(params, cfg, s % cfg.num_mtp_layers, h, windows[:, s + 1:s + 1 + T])
        out.append(logits)
    return out


def _kv_and_input(params, cfg, m: int, hidden, tokens, positions):
    """Module m's block input u [B, T, E] and its attention (q, k, v) at `positions` [B, T]."""
    mp = params["mtp"][m]
    u = _module_input(params, mp, cfg, hidden, tokens, positions)
    q, k, v = qkv_projection(mp["block"], rms_norm(u, mp["block"]["attn_norm"], cfg.rms_norm_eps),
                             positions, cfg)
    return u, q, k, v


def _chain_attention(q, k_base, v_base, k_chain, v_chain):
    """q [B, T, NH, hd] (root i's query); k_base/v_base [B, T, KV, hd] at positions 0..T-1;
    k_chain/v_chain [B, T, s, KV, hd] (root i's own chain keys) -> [B, T, NH, hd].
    Root i attends to base keys j <= i and to its s chain keys."""
    B, T, NH, hd = q.shape
    KV = k_base.shape[2]
    qg = q.reshape(B, T, KV, NH // KV, hd).astype(jnp.float32)
    scale = hd ** -0.5
    s_base = jnp.einsum("bqkgd,btkd->bkgqt", qg, k_base.astype(jnp.float32)) * scale
    s_base = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s_base, -jnp.inf)
    s_chain = jnp.einsum("bqkgd,bqskd->bkgqs", qg, k_chain.astype(jnp.float32)) * scale
    p = jax.nn.softmax(jnp.concatenate([s_base, s_chain], axis=-1), axis=-1)
    o = (jnp.einsum("bkgqt,btkd->bqkgd", p[..., :T], v_base.astype(jnp.float32))
         + jnp.einsum("bkgqs,bqskd->bqkgd", p[..., T:], v_chain.astype(jnp.float32)))
    return o.reshape(B, T, NH, -1).astype(q.dtype)


def chain_depths(params, cfg: ModelConfig, hidden0, windows, depths: int):
    """Same arguments and result as `multi_layer_depths`, in the chain regime (module docstring)."""
    attention_kind, ffn_name = cfg.mtp_layer_kind()
    if depths > 1 and attention_kind != "gqa":
        raise ValueError(f"the chain training regime is implemented for the 'gqa' attention kind; "
                         f"this model's MTP modules use {attention_kind!r} (use regime "
                         "'multi_layer')")
    B, T, _ = hidden0.shape
    D = cfg.num_mtp_layers
    base = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    g, first = mtp_forward(params, cfg, 0, hidden0, windows[:, 1:T + 1], base)
    out, outputs = [first], [g]              # outputs[t] = g^t [B, T, E]
    base_kv, chain_kv = {}, {}               # module m -> (k, v) base; (m, t) -> (u, q, k, v)
    for s in range(1, depths):
        m = s % D
        mp = params["mtp"][m]
        if m not in base_kv:
            _, _, k, v = _kv_and_input(params, cfg, m, hidden0, windows[:, 1:T + 1], base)
            base_kv[m] = (k, v)
        for t in range(1, s + 1):
            if (m, t) not in chain_kv:
                chain_kv[m, t] = _kv_and_input(params, cfg, m, outputs[t - 1],
                                               windows[:, t + 1:t + 1 + T], base + t)
        u, q, _, _ = chain_kv[m, s]
        k_chain = jnp.stack([chain_kv[m, t][2] for t in range(1, s + 1)], axis=2)
        v_chain = jnp.stack([chain_kv[m, t][3] for t in range(1, s + 1)], axis=2)
        o = _chain_attention(q, *base_kv[m], k_chain, v_chain)
        blk = mp["block"]
        y = u + o.reshape(B, T, -1) @ blk["wo"]
        y = y + ffn_kind(ffn_name)(blk, rms_norm(y, blk["mlp_norm"], cfg.rms_norm_eps), cfg,
                                   jnp.ones((B, T), bool))
        h_next, normed = _module_output(mp, cfg, y)
        outputs.append(h_next)
        out.append(logits_from_hidden(params, normed))
    return out


def depth_logits(params, cfg: ModelConfig, hidden0, windows, depths: int, regime: str):
    if regime == "multi_layer":
        return multi_layer_depths(params, cfg, hidden0, windows, depths)
    if regime == "chain":
        return chain_depths(params, cfg, hidden0, windows, depths)
    raise ValueError(f"regime {regime!r} is not one of {REGIMES}")
