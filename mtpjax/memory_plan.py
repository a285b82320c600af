"""`memory_plan(cfg, ...)`: what one device holds for a model, from abstract shapes alone.

Weights: every leaf of `init_params` traced with `jax.eval_shape` (no arrays are made), split by
the sharding table (`parallel/sharding.py`: q/kv heads and FFN columns over "model" (TP),
routed experts over "model" (EP: the same axis; the first logical axis of a leaf wins), vocab
over "model"), in bf16 or, with weight_dtype="fp8", the projections `quantize_fp8` quantizes as
e4m3 (1 byte) plus float32 block scales (`fp8_weight.partition_specs`: the scale grid splits
with its values where the blocks allow, else is replicated).

KV / latent cache: whole pages of `page_size` tokens for `max_num_seqs` sequences of `max_len`
tokens, over the target layers and the MTP modules: MLA stores R + dr latent values per token
and layer, replicated over "model"; GQA 2 x KV heads x head_dim, split over "model" when the KV
heads divide. Sequences split over "data".

Activations: an estimate of the largest step (`step_tokens` tokens at once): the residual stream
and its temporaries (4 x hidden), the widest FFN intermediate on this device (the dense MLP's
columns, or every routed pair's k x moe_intermediate rows when all land on one device: the
worst case), and float32 logits of this device's vocab slice. XLA's own workspace is not in it.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np

from mtpjax.config import ModelConfig
from mtpjax.model.fp8_weight import Fp8Weight, check_block, partition_specs, scale_grid
from mtpjax.model.params import init_params, param_specs, tree_items
from mtpjax.model.quantize import PROJECTIONS
from mtpjax.parallel.sharding import partition_spec

H200_BYTES = 141 * 10**9            # one H200's HBM3e, as NVIDIA counts it
WEIGHT_DTYPES = ("fp8", "bf16")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one model on one mesh (see the module docstring for the rules)."""

    model_type: str
    weight_dtype: str               # "fp8" | "bf16"
    num_devices: int
    tp: int                         # the "model" axis: tensor and expert parallel
    dp: int                         # the "data" axis
    parameters: int                 # of the target model (no MTP modules)
    mtp_parameters: int             # of the MTP modules
    weight_bytes: int               # per device
    cache_bytes: int                # per device
    activation_bytes: int           # per device (estimate)
    device_bytes: int               # one device's memory
    cache_tokens: int               # tokens of KV / latent cache per device

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes + self.activation_bytes

    @property
    def free_bytes(self) -> int:
        return self.device_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.device_bytes

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes <= self.device_bytes

    def __str__(self) -> str:
        gb = lambda b: f"{b / 1e9:10.2f} GB"                                   # noqa: E731
        rows = [("weights", self.weight_bytes),
                (f"KV / latent cache ({self.cache_tokens} tokens)", self.cache_bytes),
                ("activations (estimate)", self.activation_bytes),
                ("total", self.total_bytes), ("device", self.device_bytes),
                ("free" if self.fits else "over by", abs(self.free_bytes))]
        head = (f"{self.model_type}, {(self.parameters + self.mtp_parameters) / 1e9:.1f}B "
                f"parameters ({self.parameters / 1e9:.1f}B + MTP "
                f"{self.mtp_parameters / 1e9:.1f}B), {self.weight_dtype} weights on "
                f"{self.num_devices} devices (tp=ep={self.tp}, dp={self.dp}); per device:")
        width = max(len(r[0]) for r in rows)
        lines = [head] + [f"  {name:<{width}}  {gb(b)}" for name, b in rows]
        lines.append("  fits" if self.fits else "  does NOT fit")
        return "\n".join(lines)


def _mesh_shape(dp: int, tp: int):
    return {"data": dp, "model": tp}


def _split(spec, shape, mesh_shape) -> int:
    """How many pieces a leaf of `shape` is cut into by `spec`."""
    n = 1
    for axis in spec:
        for a in (axis if isinstance(axis, tuple) else (axis,) if axis else ()):
            n *= int(mesh_shape[a])
    return n


def _weight_bytes(cfg: ModelConfig, weight_dtype: str, block, dp: int, tp: int):
    """(target parameters, MTP parameters, weight bytes per device)."""
    mesh = types.SimpleNamespace(shape=_mesh_shape(dp, tp))
    abstract = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    specs = dict(tree_items(param_specs(cfg)))
    count = {"target": 0, "mtp": 0}
    total = 0
    for path, leaf in tree_items(abstract):
        shape = tuple(leaf.shape)
        count["mtp" if path[0] == "mtp" else "target"] += math.prod(shape)
        spec = partition_spec(specs[path].axes, shape, cfg, mesh)
        if weight_dtype == "fp8" and path[-1] in PROJECTIONS:
            b = check_block(block)
            w = Fp8Weight(jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                          jax.ShapeDtypeStruct(scale_grid(shape, b), jnp.float32), b)
            v, s = partition_specs(spec, w, mesh.shape)
            total += math.prod(shape) // _split(v, shape, mesh.shape)
            total += 4 * math.prod(w.scale.shape) // _split(s, w.scale.shape, mesh.shape)
        else:
            total += 2 * math.prod(shape) // _split(spec, shape, mesh.shape)
    return count["target"], count["mtp"], total


def _cache_bytes(cfg: ModelConfig, tokens: int, tp: int, cache_bytes_per_value: int) -> int:
    layers = cfg.num_layers + cfg.num_mtp_layers
    if cfg.attention_kind == "mla":
        per_token = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim   # replicated over "model"
    else:
        kv = cfg.num_kv_heads // tp if tp > 1 and cfg.num_kv_heads % tp == 0 else cfg.num_kv_heads
        per_token = 2 * kv * cfg.head_dim
    return tokens * layers * per_token * cache_bytes_per_value


def _activation_bytes(cfg: ModelConfig, step_tokens: int, tp: int) -> int:
    E, act = cfg.hidden_size, 2
    if cfg.ffn_kind == "moe":
        ffn = max(cfg.moe.num_experts_per_tok * cfg.moe.moe_intermediate_size,
                  cfg.intermediate_size // tp)
    else:
        ffn = cfg.intermediate_size // tp
    vocab = cfg.vocab_size // tp if cfg.vocab_size % tp == 0 else cfg.vocab_size
    return step_tokens * ((4 * E + 3 * ffn) * act + 4 * vocab)


def memory_plan(cfg: ModelConfig, weight_dtype: str = "fp8", *, num_devices: int = 8,
                tp: int | None = None, ep: int | None = None, max_num_seqs: int = 32,
                max_len: int = 8192, page_size: int = 64, step_tokens: int = 8192,
                block=(128, 128), device_bytes: int = H200_BYTES) -> MemoryPlan:
    """Per-device memory of `cfg` on `num_devices` devices (a ("data", "model") mesh of
    num_devices // tp x tp; tp defaults to every device). ep: mtpjax splits routed experts over
    the same "model" axis, so ep must equal tp when given. weight_dtype "fp8": projections in
    e4m3 with float32 scales of `block` (DeepSeek-V3's (128, 128)); embeddings, norms, the
    router and lm_head bf16, as DeepSeek ships them. The cache holds max_num_seqs x max_len
    tokens (whole pages), bf16; step_tokens sizes the activation estimate."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype={weight_dtype!r}: expected one of {WEIGHT_DTYPES}")
    tp = num_devices if tp is None else tp
    if tp < 1 or num_devices % tp:
        raise ValueError(f"tp={tp} must divide num_devices={num_devices}")
    if ep is not None and ep != tp:
        raise ValueError(f"ep={ep} != tp={tp}: mtpjax splits the routed experts over the same "
                         "\"model\" mesh axis as the heads and FFN columns (ep == tp)")
    for name, v in (("max_num_seqs", max_num_seqs), ("max_len", max_len),
                    ("page_size", page_size), ("step_tokens", step_tokens)):
        if int(v) < 1:
            raise ValueError(f"{name}={v}: expected a positive int")
    dp = num_devices // tp
    target, mtp, weights = _weight_bytes(cfg, weight_dtype, block, dp, tp)
    seqs = -(-max_num_seqs // dp)                                  # per data shard
    tokens = seqs * -(-max_len // page_size) * page_size
    return MemoryPlan(cfg.model_type, weight_dtype, num_devices, tp, dp, target, mtp, weights,
                      _cache_bytes(cfg, tokens, tp, np.dtype(jnp.bfloat16).itemsize),
                      _activation_bytes(cfg, step_tokens, tp), int(device_bytes), tokens)
