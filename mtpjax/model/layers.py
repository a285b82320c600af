"""Building blocks shared by the target and the MTP modules: norms, RoPE, the decoder layer."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig, RopeScaling
from mtpjax.model.kinds import attention_kind, ffn_kind


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 (as Hugging Face does), cast back to x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [rotary_dim/2] (float64 numpy) and the attention scaling of cos/sin."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs: RopeScaling = cfg.rope_scaling
    if rs.rope_type == "default":
        return inv_freq, 1.0
    if rs.rope_type == "linear":
        return inv_freq / rs.factor, 1.0
    if rs.rope_type == "llama3":
        old_len = rs.original_max_position_embeddings
        low_wavelen = old_len / rs.low_freq_factor
        high_wavelen = old_len / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old_len / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled), 1.0
    if rs.rope_type == "yarn":
        factor = rs.factor
        orig = rs.original_max_position_embeddings
        if rs.attention_factor is not None:
            attn = rs.attention_factor
        elif rs.mscale and rs.mscale_all_dim:
            attn = _yarn_mscale(factor, rs.mscale) / _yarn_mscale(factor, rs.mscale_all_dim)
        else:
            attn = _yarn_mscale(factor)

        def correction_dim(rot):
            return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rs.beta_fast)), 0)
        high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrap_factor = 1 - ramp
        interp = inv_freq / factor
        return interp * (1 - extrap_factor) + inv_freq * extrap_factor, float(attn)
    raise ValueError(f"unsupported rope type {rs.rope_type!r}")


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Rotary embedding, Hugging Face `rotate_half` layout. x [..., T, H, hd], positions [..., T].

    Only the first `cfg.rotary_dim` dims rotate (rotate_half within them; partial rotary, as
    transformers' GPT-NeoX / GLM apply it); the rest pass through unchanged."""
    inv_freq, scale = rope_frequencies(cfg)
    # [..., T, rd/2], rd = the rotated dims
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = (jnp.cos(freqs) * scale)[..., None, :]
    sin = (jnp.sin(freqs) * scale)[..., None, :]
    rd = 2 * inv_freq.shape[0]
    half = rd // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:rd].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    if rd == x.shape[-1]:
        return out
    return jnp.concatenate([out, x[..., rd:]], axis=-1)


def decoder_block(p: dict, x: jax.Array, positions: jax.Array, cfg: ModelConfig,
                  kinds: tuple[str, str], pages=None, paged=None):
    """Pre-norm decoder layer of `kinds` = (attention kind, FFN kind) -> (x, pages).

    paged None: causal attention over x [B, T, E] itself (no cache, the reference). Else x [N, E]
    are ragged tokens whose KV goes to `pages` (see the attention kind)."""
    attention, ffn = attention_kind(kinds[0]), ffn_kind(kinds[1])
    with jax.named_scope("attention"):
        o, pages = attention(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions, cfg,
                             pages, paged)
        x = x + o
    with jax.named_scope("mlp"):
        backend = getattr(paged, "backend", None)
        # inside the DP-attention shard_map the FFN learns the token split instead of a mesh
        mesh = getattr(backend, "split_tokens", None) or getattr(backend, "mesh", None)
        x = x + ffn(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps), cfg, positions >= 0, mesh)
    return x, pages
