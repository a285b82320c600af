"""Attention kind "gqa" (grouped-query attention; MHA when num_kv_heads == num_heads).

Its cache kind is `GQAPages`: per layer, pages of K and of V per KV head. Projections add
Qwen2's q/k/v biases (`qkv_bias`) and Qwen3's per-head q/k norms (`qk_norm`); RoPE rotates the
whole head (Hugging Face `rotate_half` layout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtpjax.model.kinds import ParamSpec, register_attention_kind
from mtpjax.model.layers import apply_rope, rms_norm
from mtpjax.model.linear import linear


@struct.dataclass
class GQAPages:
    """One attention layer's paged K and V (a tuple entry of `KVCache`, so a kernel gets a
    layer's pages without a copy and writes update the buffers in place under donation)."""

    k: jax.Array   # [KVH, P, S, hd]   P pages of S tokens
    v: jax.Array   # [KVH, P, S, hd]

    AXES = ("kv_heads", "pages", "page", "head_dim")     # logical axes of k and v

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    def write(self, k: jax.Array, v: jax.Array, page: jax.Array, offset: jax.Array) -> "GQAPages":
        """Scatters k/v [N, KVH, hd] into slots (page, offset) [N]; out-of-range pages drop."""
        kp = self.k.at[:, page, offset].set(jnp.swapaxes(k, 0, 1).astype(self.k.dtype), mode="drop")
        vp = self.v.at[:, page, offset].set(jnp.swapaxes(v, 0, 1).astype(self.v.dtype), mode="drop")
        return GQAPages(kp, vp)


def qkv_projection(p: dict, x: jax.Array, positions: jax.Array, cfg):
    """x [..., T, E] -> q [..., T, NH, hd], k/v [..., T, KV, hd] with bias, q/k norm and RoPE."""
    hd = cfg.head_dim
    if "wqkv" in p:                  # fused at load (model/fused.py): one GEMM, then split
        qkv = linear(x, p["wqkv"])
        if "bqkv" in p:
            qkv = qkv + p["bqkv"]
        nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
    else:
        q = linear(x, p["wq"])
        k = linear(x, p["wk"])
        v = linear(x, p["wv"])
        if "bq" in p:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    q = q.reshape(*q.shape[:-1], cfg.num_heads, hd)
    k = k.reshape(*k.shape[:-1], cfg.num_kv_heads, hd)
    v = v.reshape(*v.shape[:-1], cfg.num_kv_heads, hd)
    if "q_norm" in p:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(q, positions, cfg), apply_rope(k, positions, cfg), v


class GQA:
    name = "gqa"
    hf_rows = {
        "wq": ("self_attn.q_proj.weight", True),
        "wk": ("self_attn.k_proj.weight", True),
        "wv": ("self_attn.v_proj.weight", True),
        "wo": ("self_attn.o_proj.weight", True),
        "bq": ("self_attn.q_proj.bias", False),
        "bk": ("self_attn.k_proj.bias", False),
        "bv": ("self_attn.v_proj.bias", False),
        "q_norm": ("self_attn.q_norm.weight", False),
        "k_norm": ("self_attn.k_norm.weight", False),
    }
    pages_type = GQAPages

    def param_specs(self, cfg) -> dict[str, ParamSpec]:
        E, HD, NH, KV = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        specs = {
            "wq": ParamSpec((E, NH * HD), ("embed", "q_heads"), "normal"),
            "wk": ParamSpec((E, KV * HD), ("embed", "kv_heads"), "normal"),
            "wv": ParamSpec((E, KV * HD), ("embed", "kv_heads"), "normal"),
            "wo": ParamSpec((NH * HD, E), ("q_heads", "embed"), "normal"),
        }
        if cfg.qkv_bias:
            specs["bq"] = ParamSpec((NH * HD,), ("q_heads",), "zeros")
            specs["bk"] = ParamSpec((KV * HD,), ("kv_heads",), "zeros")
            specs["bv"] = ParamSpec((KV * HD,), ("kv_heads",), "zeros")
        if cfg.qk_norm:
            specs["q_norm"] = ParamSpec((HD,), ("head_dim",), "ones")
            specs["k_norm"] = ParamSpec((HD,), ("head_dim",), "ones")
        return specs

    def init_pages(self, cfg, num_pages: int, page_size: int, dtype) -> GQAPages:
        shape = (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        return GQAPages(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def __call__(self, p: dict, x, positions, cfg, pages=None, paged=None):
        """x [..., T, E] -> (attention output [..., T, E], pages).

        paged None: plain causal attention over x's own tokens (x [B, T, E], the reference).
        Else x [N, E] are ragged tokens: their K/V are written to `pages` and attention reads
        the paged cache through `paged.backend`.
        """
        from mtpjax.model.attention import dense_causal_attention
        q, k, v = qkv_projection(p, x, positions, cfg)
        if paged is None:
            o = dense_causal_attention(q, k, v)
        else:
            pages = pages.write(k, v, paged.page, paged.offset)
            o = paged.backend.paged_attention(q, pages, paged.batch)
        return linear(o.reshape(*o.shape[:-2], -1), p["wo"]), pages


GQA_KIND = register_attention_kind(GQA())
