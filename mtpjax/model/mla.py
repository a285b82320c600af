"""Attention kind "mla": DeepSeek's multi-head latent attention (DeepSeek-V2 paper, section 2.1).

Per token, the model keeps one latent vector shared by all heads: the normed KV compression
c = norm(x W_DKV) [R = kv_lora_rank] and the rotated shared key k_rope [dr = qk_rope_head_dim].
Head h's key is concat(c W_UK[h], k_rope) and its value c W_UV[h] (W_UK, W_UV are the two halves
of `kv_b_proj`). Its cache kind `LatentPages` stores exactly [c, k_rope] per token:
R + dr values (576 for V3), no per-head copies.

Two forms, same numbers:
- expanded (`paged=None`, the no-cache reference that matches transformers): build every head's
  K and V from the latents and run ordinary causal attention.
- absorbed (every paged path: prefill, decode, verify, drafts): fold W_UK into the query,
  q_lat[h] = concat(q_nope[h] W_UK[h]^T, q_rope[h]), so scores are q_lat . latent, attend over
  the latent cache directly (one shared KV head of width R + dr, values = its first R entries),
  then apply W_UV per head. Attention reads only the latent pages.

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`); we
de-interleave (evens, then odds) and use the rotate-half form, which gives the same dot products
(queries and keys get the same permutation) and matches transformers' output layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.model.fp8_weight import dequantize_in_step
from mtpjax.model.kinds import ParamSpec, register_attention_kind
from mtpjax.model.layers import apply_rope, rms_norm
from mtpjax.model.linear import linear

# q_a_layernorm / kv_a_layernorm use the RMSNorm default eps in DeepSeek's code and in
# transformers, not the config's rms_norm_eps.
LORA_NORM_EPS = 1e-6


@struct.dataclass
class LatentPages:
    """One MLA layer's paged latent cache: per token [c_kv (R), k_rope (dr)], shared by all heads."""

    latent: jax.Array    # [P, S, R + dr]   P pages of S tokens
    rank: int = struct.field(pytree_node=False)      # R = kv_lora_rank: the value width

    AXES = ("pages", "page", "latent")

    @property
    def num_pages(self) -> int:
        return self.latent.shape[0]

    @property
    def page_size(self) -> int:
        return self.latent.shape[1]

    def write(self, latent: jax.Array, page: jax.Array, offset: jax.Array) -> "LatentPages":
        """Scatters latent [N, R + dr] into slots (page, offset) [N]; out-of-range pages drop."""
        new = self.latent.at[page, offset].set(latent.astype(self.latent.dtype), mode="drop")
        return LatentPages(new, self.rank)


def softmax_scale(cfg) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 when set
    (DeepSeek-V3's long-context correction; transformers' `yarn_apply_mscale`)."""
    scale = (cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling
    if rs.rope_type != "default" and rs.mscale_all_dim:
        m = 1.0 if rs.factor <= 1 else 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0
        scale *= m * m
    return scale


def _rope(x: jax.Array, positions: jax.Array, cfg) -> jax.Array:
    """x [..., T, H, dr] -> rotated (interleaved pairs de-interleaved first)."""
    if cfg.mla.rope_interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, positions, cfg)


def mla_projections(p: dict, x: jax.Array, positions: jax.Array, cfg):
    """x [..., T, E] -> q_nope [..., T, H, dn], q_rope [..., T, H, dr] (rotated),
    c [..., T, R] (normed latent), k_rope [..., T, dr] (rotated)."""
    m = cfg.mla
    H, dn, dr, R = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    if "wq_kv_a" in p:         # fused at load (model/fused.py): one GEMM, then split
        y = linear(x, p["wq_kv_a"])
        q_in, kv = y[..., :-(R + dr)], y[..., -(R + dr):]
    else:
        q_in, kv = None, linear(x, p["wkv_a"])
    if m.q_lora_rank is None:
        q = q_in if q_in is not None else linear(x, p["wq"])
    else:
        q_a = q_in if q_in is not None else linear(x, p["wq_a"])
        q = linear(rms_norm(q_a, p["q_a_norm"], LORA_NORM_EPS), p["wq_b"])
    q = q.reshape(*q.shape[:-1], H, dn + dr)
    c = rms_norm(kv[..., :R], p["kv_a_norm"], LORA_NORM_EPS)
    q_rope = _rope(q[..., dn:], positions, cfg)
    k_rope = _rope(kv[..., None, R:], positions, cfg)[..., 0, :]
    return q[..., :dn], q_rope, c, k_rope


def _w_uk_uv(p: dict, cfg, c):
    """kv_b_proj [R, H * (dn + dv)] -> (W_UK [R, H, dn], W_UV [R, H, dv], c). An FP8 kv_b is
    dequantized first (the absorption reshapes and contracts it per head, not as one GEMM),
    tied to the latent c so that it stays in the step (`dequantize_in_step`)."""
    if "w_uk" in p:                      # split once at load (model/fused.py)
        return p["w_uk"], p["w_uv"], c
    w, c = dequantize_in_step(p["wkv_b"], c)
    return (*kv_b_halves(w, cfg), c)


def kv_b_halves(w, cfg):
    """kv_b_proj [R, H * (dn + dv)] (not FP8) -> (W_UK [R, H, dn], W_UV [R, H, dv])."""
    dn = cfg.mla.qk_nope_head_dim
    w = w.reshape(cfg.mla.kv_lora_rank, cfg.num_heads, dn + cfg.mla.v_head_dim)
    return w[..., :dn], w[..., dn:]


class MLA:
    name = "mla"
    hf_rows = {
        "wq": ("self_attn.q_proj.weight", True),
        "wq_a": ("self_attn.q_a_proj.weight", True),
        "q_a_norm": ("self_attn.q_a_layernorm.weight", False),
        "wq_b": ("self_attn.q_b_proj.weight", True),
        "wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", True),
        "kv_a_norm": ("self_attn.kv_a_layernorm.weight", False),
        "wkv_b": ("self_attn.kv_b_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True),
    }
    pages_type = LatentPages

    def param_specs(self, cfg) -> dict[str, ParamSpec]:
        E, H = cfg.hidden_size, cfg.num_heads
        m = cfg.mla
        dn, dr, dv, R = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        specs = {}
        if cfg.mla.q_lora_rank is None:
            specs["wq"] = ParamSpec((E, H * (dn + dr)), ("embed", "q_heads"), "normal")
        else:
            Q = cfg.mla.q_lora_rank
            specs["wq_a"] = ParamSpec((E, Q), ("embed", "q_lora"), "normal")
            specs["q_a_norm"] = ParamSpec((Q,), ("q_lora",), "ones")
            specs["wq_b"] = ParamSpec((Q, H * (dn + dr)), ("q_lora", "q_heads"), "normal")
        specs["wkv_a"] = ParamSpec((E, R + dr), ("embed", "latent"), "normal")
        specs["kv_a_norm"] = ParamSpec((R,), ("kv_lora",), "ones")
        specs["wkv_b"] = ParamSpec((R, H * (dn + dv)), ("kv_lora", "q_heads"), "normal")
        specs["wo"] = ParamSpec((H * dv, E), ("q_heads", "embed"), "normal")
        return specs

    def init_pages(self, cfg, num_pages: int, page_size: int, dtype) -> LatentPages:
        width = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
        return LatentPages(jnp.zeros((num_pages, page_size, width), dtype), cfg.mla.kv_lora_rank)

    def __call__(self, p: dict, x, positions, cfg, pages=None, paged=None):
        """x [..., T, E] -> (attention output [..., T, E], pages); see the module docstring."""
        from mtpjax.model.attention import dense_causal_attention
        q_nope, q_rope, c, k_rope = mla_projections(p, x, positions, cfg)
        w_uk, w_uv, c = _w_uk_uv(p, cfg, c)
        scale = softmax_scale(cfg)
        if paged is None:                                         # expanded form
            H = cfg.num_heads
            k_nope = jnp.einsum("...r,rhd->...hd", c, w_uk)
            v = jnp.einsum("...r,rhd->...hd", c, w_uv)
            k_r = jnp.broadcast_to(k_rope[..., None, :], (*k_rope.shape[:-1], H, k_rope.shape[-1]))
            q = jnp.concatenate([q_nope, q_rope], axis=-1)
            k = jnp.concatenate([k_nope, k_r], axis=-1)
            o = dense_causal_attention(q, k, v, sm_scale=scale)
        else:                                                     # absorbed form
            pages = pages.write(jnp.concatenate([c, k_rope], axis=-1), paged.page, paged.offset)
            q_lat = jnp.concatenate([jnp.einsum("nhd,rhd->nhr", q_nope, w_uk), q_rope], axis=-1)
            o_lat = paged.backend.paged_attention(q_lat, pages, paged.batch, sm_scale=scale)
            o = jnp.einsum("nhr,rhd->nhd", o_lat, w_uv)           # [N, H, dv]
        return linear(o.reshape(*o.shape[:-2], -1), p["wo"]), pages


MLA_KIND = register_attention_kind(MLA())
