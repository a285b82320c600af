"""`MLAConfig`: the shapes of attention kind "mla" (DeepSeek-V2/V3, Kimi-K2; model/mla.py).

`ModelConfig.mla` holds one exactly when `attention_kind == "mla"`. What relates these shapes to
the model's other fields (head_dim is qk_rope_head_dim, num_kv_heads == num_heads) is checked by
`ModelConfig`; this class checks only its own fields.
"""

from __future__ import annotations

import dataclasses

from mtpjax.config import _flag, _positive_int


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    kv_lora_rank: int                     # R: width of the cached latent c_kv
    qk_nope_head_dim: int                 # dn: per-head query/key dims without RoPE
    qk_rope_head_dim: int                 # dr: the rotated dims, one key shared by all heads
    v_head_dim: int                       # dv: per-head value dims
    q_lora_rank: int | None = None        # None: one q_proj; else q_a_proj -> norm -> q_b_proj
    rope_interleave: bool = False         # rotary pairs (x0, x1), (x2, x3), ... (DeepSeek)

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)
        _flag("rope_interleave", self.rope_interleave)
        object.__setattr__(self, "rope_interleave", bool(self.rope_interleave))
