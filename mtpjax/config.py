"""Frozen, validated configuration objects.

`ModelConfig` describes the target model and its MTP modules, `SamplingParams` one request's
sampling, `SpecConfig` the speculative decoding method. All are frozen dataclasses validated at
construction; shrink them in tests with `dataclasses.replace` (which re-validates).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:      # imported on use below: they import this module's validators
    from mtpjax.model.mla_config import MLAConfig
    from mtpjax.model.moe_config import MoEConfig

# SUPPORTED_MODEL_TYPES (the model_types of the registered families, mtpjax/models/) is looked
# up on use by the module __getattr__ below: the families import this module.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MTP_CONCAT_ORDERS = ("embed_hidden", "hidden_embed")
SPEC_METHODS = ("chain", "multi_layer")


def __getattr__(name):
    if name == "SUPPORTED_MODEL_TYPES":
        from mtpjax.models.registry import supported_model_types
        return supported_model_types()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _finite(name: str, value: Any, positive: bool = False) -> None:
    """A finite real number (> 0 when `positive`): inf or nan would reach the model as NaN
    logits, a string would fail later as a TypeError that names nothing."""
    if not _is_real(value) or not math.isfinite(value) or (positive and not value > 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got "
                         f"{value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (Hugging Face `rope_scaling`). `rope_type="default"` is none."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None

    def __post_init__(self):
        if self.rope_type == "dynamic":
            raise ValueError(
                "rope_scaling type 'dynamic' is not supported: its frequencies depend on the running "
                f"sequence length, which a paged KV cache cannot reproduce; supported: {SUPPORTED_ROPE_TYPES}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        _finite("rope_scaling factor", self.factor, positive=True)
        _finite("rope_scaling original_max_position_embeddings",
                self.original_max_position_embeddings, positive=True)
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                     "mscale_all_dim"):
            _finite(f"rope_scaling {name}", getattr(self, name))
        if self.attention_factor is not None:
            _finite("rope_scaling attention_factor", self.attention_factor)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> "RopeScaling":
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ValueError(f"rope_scaling must be an object (or null), got {d!r}")
        if not d:
            return cls()
        rope_type = d.get("rope_type", d.get("type", "default"))
        known = {f.name for f in dataclasses.fields(cls)} - {"rope_type"}
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        return cls(rope_type=rope_type, **kwargs)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only target model plus D = `num_mtp_layers` MTP modules.

    `model_type` names its family (mtpjax/models/: how its config.json and checkpoint read and
    write); the layers are (attention kind, FFN kind) pairs (`layer_kinds`, model/kinds.py).

    MTP modules follow docs/models.md: `u = eh_proj(concat(enorm(embed(x)), hnorm(h)))` (order set by
    `mtp_concat_order`), one decoder layer, and the shared `lm_head` behind the module's own
    output norm. `mtp_normed_hidden_to_next` is MiMo's behaviour: the module hands the *normed*
    hidden state to the next depth (DeepSeek hands the raw one and norms only for the logits).
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    # RoPE rotates the first rotary_dim = head_dim * partial_rotary_factor dims of each head
    # (rotate_half within them) and passes the rest through (GLM-4.5: 0.5)
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 1
    mtp_concat_order: str = "embed_hidden"
    mtp_normed_hidden_to_next: bool = False
    # layer kinds (mtpjax/model/kinds.py): every target layer and every MTP block; with
    # ffn_kind "moe" the first `moe.first_k_dense_replace` target layers are "dense"
    attention_kind: str = "gqa"
    ffn_kind: str = "dense"
    # the kinds' own sub-configs (a dict is read as one), set exactly when the kind is used:
    # MLA's shapes (attention_kind "mla", model/mla_config.py). head_dim is qk_rope_head_dim
    # there (the rotated part), and num_kv_heads == num_heads (MLA has one latent, no KV heads).
    mla: MLAConfig | None = None
    # the experts and routing kind (ffn_kind "moe", model/moe_config.py)
    moe: MoEConfig | None = None

    def __post_init__(self):
        from mtpjax.models.registry import family_for     # the registry (lazy: cycle)
        family = family_for(self.model_type)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "max_position_embeddings"):
            _positive_int(name, getattr(self, name))
        self._read_sub_configs()
        if self.attention_kind == "mla":
            self._check_mla()
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "set head_dim explicitly")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if not isinstance(self.num_mtp_layers, int) or self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be an int >= 0, got {self.num_mtp_layers!r}")
        if self.mtp_concat_order not in MTP_CONCAT_ORDERS:
            raise ValueError(
                f"mtp_concat_order {self.mtp_concat_order!r} not in {MTP_CONCAT_ORDERS}")
        _finite("rms_norm_eps", self.rms_norm_eps, positive=True)
        _finite("rope_theta", self.rope_theta, positive=True)
        for name in ("qkv_bias", "qk_norm", "tie_word_embeddings", "mtp_normed_hidden_to_next"):
            _flag(name, getattr(self, name))
            object.__setattr__(self, name, bool(getattr(self, name)))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or a dict, got "
                             f"{self.rope_scaling!r}")
        from mtpjax.model.kinds import attention_kind, ffn_kind   # the registries (lazy: cycle)
        attention_kind(self.attention_kind)
        ffn_kind(self.ffn_kind)
        if self.ffn_kind == "moe":
            self._check_moe()
        self._check_partial_rotary()
        family.check(self)

    def _check_partial_rotary(self) -> None:
        f = self.partial_rotary_factor
        _finite("partial_rotary_factor", f, positive=True)
        if f > 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {f!r}")
        object.__setattr__(self, "partial_rotary_factor", float(f))
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} * partial_rotary_factor {f} gives "
                             f"{self.rotary_dim} rotary dims; expected an even number >= 2")
        if self.attention_kind == "mla" and f != 1.0:
            raise ValueError(f"an MLA model rotates its whole qk_rope_head_dim; got "
                             f"partial_rotary_factor={f}")

    def _read_sub_configs(self) -> None:
        """`mla` / `moe` as their classes (from a dict too), present exactly when the layer
        kind that owns them is used: a missing one has no shapes to build, and a stray one
        would be silently ignored."""
        from mtpjax.model.mla_config import MLAConfig       # (lazy: cycle)
        from mtpjax.model.moe_config import MoEConfig
        for name, cls, kind_field, kind in (("mla", MLAConfig, "attention_kind", "mla"),
                                            ("moe", MoEConfig, "ffn_kind", "moe")):
            value = getattr(self, name)
            if isinstance(value, Mapping):
                known = {f.name for f in dataclasses.fields(cls)}
                unknown = sorted(set(value) - known)
                if unknown:
                    raise ValueError(f"unknown {name} keys: {unknown}; known: {sorted(known)}")
                value = cls(**value)
                object.__setattr__(self, name, value)
            used = getattr(self, kind_field) == kind
            if used and value is None:
                raise ValueError(f"{kind_field} {kind!r} needs {name}= (a {cls.__name__} or a "
                                 f"dict of its fields), got None")
            if not used and value is not None:
                raise ValueError(f"{name} is set but {kind_field} is "
                                 f"{getattr(self, kind_field)!r}; a {cls.__name__} belongs to "
                                 f"{kind_field} {kind!r} (set {name}=None)")
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"{name} must be a {cls.__name__}, a dict of its fields or "
                                 f"None, got {value!r}")

    def _check_mla(self) -> None:
        rope_dim = self.mla.qk_rope_head_dim
        if self.head_dim not in (None, rope_dim):
            raise ValueError(f"an MLA model's head_dim is its qk_rope_head_dim "
                             f"({rope_dim}), got head_dim={self.head_dim}")
        object.__setattr__(self, "head_dim", rope_dim)
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"an MLA model has num_kv_heads == num_heads ({self.num_heads}), "
                             f"got num_kv_heads={self.num_kv_heads}")

    def _check_moe(self) -> None:
        dense = self.moe.first_k_dense_replace
        if dense > self.num_layers:
            raise ValueError(f"first_k_dense_replace must be an int in [0, num_layers="
                             f"{self.num_layers}], got {dense!r}")

    def layer_kinds(self) -> tuple[tuple[str, str], ...]:
        """(attention kind, FFN kind) of each target layer (MoE models: dense first layers)."""
        dense = self.moe.first_k_dense_replace if self.ffn_kind == "moe" else 0
        return tuple((self.attention_kind, "dense" if i < dense else self.ffn_kind)
                     for i in range(self.num_layers))

    def mtp_layer_kind(self) -> tuple[str, str]:
        """(attention kind, FFN kind) of every MTP module's decoder block."""
        return (self.attention_kind, self.ffn_kind)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (all unless partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_query_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict, the sub-configs nested (`from_dict` inverts it exactly)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Inverts `to_dict`; also reads the older flat format (MLA / MoE fields at top level,
        see flat_config.py)."""
        from mtpjax.flat_config import is_flat, nest_flat_fields
        if is_flat(d):
            d = nest_flat_fields(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        d = dict(d)
        if isinstance(d.get("rope_scaling"), Mapping):
            known = {f.name for f in dataclasses.fields(RopeScaling)}
            unknown = sorted(set(d["rope_scaling"]) - known)
            if unknown:
                raise ValueError(f"unknown rope_scaling keys: {unknown}")
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], **overrides) -> "ModelConfig":
        """Reads a Hugging Face `config.json` dict: the Llama-style keys every family shares here,
        the family's own keys by its module (mtpjax/models/, found by `model_type`)."""
        from mtpjax.models.registry import family_for     # the registry (lazy: cycle)
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict (parsed config.json), got {type(config).__name__}")
        model_type = config.get("model_type")
        family = family_for(model_type)
        get = functools.partial(_hf_value, config)
        if get("use_sliding_window", FLAG, False):
            raise ValueError("use_sliding_window=True is not supported (sliding-window attention)")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; supported: ('silu',)")
        num_heads = get("num_attention_heads", POSITIVE)
        hidden = get("hidden_size", POSITIVE)
        rope_scaling = config.get("rope_scaling")
        rope_theta = get("rope_theta", NUMBER, 10000.0)
        # transformers >= 5 may nest theta and scaling into `rope_parameters`.
        rope_params = config.get("rope_parameters")
        if rope_params is not None:
            if not isinstance(rope_params, Mapping):
                raise ValueError(f"rope_parameters must be an object (or null), got "
                                 f"{rope_params!r}")
            rope_theta = _hf_value(rope_params, "rope_theta", NUMBER, rope_theta,
                                   "rope_parameters.rope_theta")
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        kwargs = dict(
            model_type=model_type,
            vocab_size=get("vocab_size", POSITIVE),
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", POSITIVE),
            num_layers=get("num_hidden_layers", POSITIVE),
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads", COUNT, 0) or num_heads,
            head_dim=get("head_dim", COUNT, 0) or None,
            rms_norm_eps=get("rms_norm_eps", NUMBER, 1e-6),
            rope_theta=rope_theta,
            rope_scaling=RopeScaling.from_hf(rope_scaling),
            max_position_embeddings=get("max_position_embeddings", POSITIVE, 4096),
            qkv_bias=get("attention_bias", FLAG, False),
            tie_word_embeddings=get("tie_word_embeddings", FLAG, False),
            num_mtp_layers=get("num_nextn_predict_layers", COUNT, 0),
        )
        kwargs.update(family.read_hf(config, model_type))
        kwargs.update(overrides)
        return cls(**kwargs)


# What a config.json value must be: (description for messages, check).
POSITIVE = ("a positive int", lambda v: _is_int(v) and v > 0)
COUNT = ("an int >= 0", lambda v: _is_int(v) and v >= 0)
NUMBER = ("a finite number", lambda v: _is_real(v) and math.isfinite(v))
FLAG = ("true or false", lambda v: isinstance(v, bool) or (_is_int(v) and v in (0, 1)))
TEXT = ("a string", lambda v: isinstance(v, str))
_REQUIRED = object()


def _hf_value(config: Mapping[str, Any], key: str, kind: tuple, default: Any = _REQUIRED,
              label: str | None = None) -> Any:
    """config.json's `key` if it is of `kind` (ints as int, flags as bool); `default` when it is
    absent or null. A value of another type raises naming the key and what was expected: read
    unchecked, a string such as "32" would fail later (or, for a flag, "false" would be True)."""
    what, ok = kind
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            got = "null" if key in config else "missing"
            raise ValueError(f"{label or key} is {got}; expected {what}")
        return default
    if not ok(value):
        raise ValueError(f"{label or key} must be {what}, got {value!r}")
    if kind is FLAG:
        return bool(value)
    return int(value) if _is_int(value) else value


# A request's PRNG key is jax.random.PRNGKey(seed), which keeps the low 32 bits of the seed
# (mtpjax.sampling.request_key): seed and seed + 2**32 would silently give the same tokens.
SEED_RANGE = (0, 2**32)
INT32_MAX = 2**31 - 1        # top_k and stop ids travel to the device as int32
# SamplingParams.logit_bias: entries per request (a fixed width keeps one compiled step; the
# device adds them with one small scatter) and the bias range (OpenAI's)
LOGIT_BIAS_SLOTS = 32
LOGIT_BIAS_MAX = 100.0
PENALTY_MAX = 2.0            # |presence_penalty|, |frequency_penalty| (vLLM's and OpenAI's range)


def _is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    """A Python or numpy real number, not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) \
        and not isinstance(value, (bool, np.bool_))


def check_seed(name: str, value: Any) -> int:
    """`value` as a Python int if it is a valid PRNG seed, else ValueError naming it."""
    lo, hi = SEED_RANGE
    if not _is_int(value) or not lo <= value < hi:
        raise ValueError(f"{name} must be an int in [0, 2**32) (a PRNG key keeps 32 bits of the "
                         f"seed; larger ones would repeat smaller ones), got {name}={value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 disables top-k; top_p 1 disables top-p.

    Numbers may be Python or numpy scalars; they are stored as Python int / float. Every field is
    checked here, so a request that passes cannot fail later inside a step.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # Drafts per verify step for this request, 0 <= k <= the engine's K (None: K). k = 0 decodes
    # without drafts, in the same batch and compiled step as speculative requests.
    num_speculative_tokens: int | None = None
    # Return, for every generated token, its logprob and the `logprobs` most likely tokens'
    # logprobs under the target's processed distribution (docs/engine.md, "Logprobs").
    logprobs: int | None = None
    # Return, for every prompt token after the first, its logprob and the `prompt_logprobs`
    # most likely tokens' (same distribution; one extra target pass over the prompt,
    # docs/engine.md, "Prompt logprobs").
    prompt_logprobs: int | None = None
    # vLLM's min_p: keep tokens with probability >= min_p * the top token's (after temperature,
    # with top-k / top-p); 0 disables. Sampled requests only (a greedy row's argmax is kept).
    min_p: float = 0.0
    # {token id: bias} added to the logits before temperature and filtering (greedy requests
    # too: the argmax is the biased one); biases in [-100, 100], at most LOGIT_BIAS_SLOTS ids.
    # Stored as a tuple of (id, bias) pairs sorted by id (hashable); a mapping or pairs in.
    logit_bias: Any = None
    # Stop strings (vLLM's names): the completion ends where its text first contains one; the
    # text is cut before it (after it with include_stop_str_in_output). mtpjax.LLM with a
    # tokenizer only (docs/engine.md, "Stop strings"). A single string is taken as (string,).
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # Completions per prompt (vLLM's n): LLM.generate / generate_stream run n requests per
    # prompt, sample j seeded with (seed + j) mod 2**32 when seed is set (docs/engine.md, "n
    # samples per prompt").
    n: int = 1
    # vLLM's penalties over the request's history (docs/engine.md, "Penalties"):
    # repetition_penalty > 0 divides a positive logit (multiplies a negative one) of every token
    # in the prompt or the output, 1 disables; presence_penalty / frequency_penalty in [-2, 2]
    # subtract p * (token in the output) and f * (its count in the output), 0 disables.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Structured output: a JSON schema, regex or EBNF grammar the completion must follow
    # (mtpjax.structured.StructuredOutput; mtpjax.LLM with a tokenizer only,
    # docs/structured_output.md).
    structured_output: Any = None

    def __post_init__(self):
        set_ = lambda name, v: object.__setattr__(self, name, v)    # noqa: E731 (frozen)
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got temperature={t!r}")
        set_("temperature", float(t))
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise ValueError(f"top_k must be an int in [0, 2**31 - 1] (0 disables), got "
                             f"top_k={self.top_k!r}")
        set_("top_k", int(self.top_k))
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got top_p={self.top_p!r}")
        set_("top_p", float(self.top_p))
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive int or None, got "
                                 f"max_tokens={self.max_tokens!r}")
            set_("max_tokens", int(self.max_tokens))
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or _is_int(stops) or not hasattr(stops, "__iter__"):
            raise ValueError(f"stop_token_ids must be a sequence of token ids (e.g. (2,)), got "
                             f"stop_token_ids={stops!r}")
        stops = tuple(stops)
        for t in stops:
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {t!r} in "
                                 f"stop_token_ids={stops!r}")
        set_("stop_token_ids", tuple(int(t) for t in stops))
        if self.seed is not None:
            set_("seed", check_seed("seed", self.seed))
        for name in ("num_speculative_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                if not _is_int(v) or v < 0:
                    raise ValueError(f"{name} must be an int >= 0 or None, got {name}={v!r}")
                set_(name, int(v))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        stop = tuple(stop) if hasattr(stop, "__iter__") and not isinstance(stop, bytes) else None
        if stop is None or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop must be a non-empty string or a sequence of non-empty "
                             f"strings, got stop={self.stop!r}")
        set_("stop", tuple(stop))
        if not isinstance(self.include_stop_str_in_output, (bool, np.bool_)):
            raise ValueError(f"include_stop_str_in_output must be a bool, got "
                             f"include_stop_str_in_output={self.include_stop_str_in_output!r}")
        set_("include_stop_str_in_output", bool(self.include_stop_str_in_output))
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got n={self.n!r}")
        set_("n", int(self.n))
        self._check_logit_processors(set_)
        self._check_penalties(set_)
        so = self.structured_output
        if so is not None:
            from mtpjax.structured.spec import StructuredOutput
            if not isinstance(so, StructuredOutput):
                raise ValueError(f"structured_output must be a mtpjax.StructuredOutput (json_schema"
                                 f"=, regex=, grammar= or json_object=True) or None, got "
                                 f"{type(so).__name__}")

    def _check_logit_processors(self, set_):
        m = self.min_p
        if not _is_real(m) or not 0.0 <= m <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (0 disables), got min_p={m!r}")
        set_("min_p", float(m))
        lb = self.logit_bias
        if lb is None or (isinstance(lb, (Mapping, tuple, list)) and not lb):
            set_("logit_bias", None)
            return
        if isinstance(lb, Mapping):
            items = list(lb.items())
        elif isinstance(lb, (tuple, list)) and all(isinstance(x, (tuple, list)) and len(x) == 2
                                                   for x in lb):
            items = [tuple(x) for x in lb]
        else:
            raise ValueError(f"logit_bias must be a mapping {{token_id: bias}} or None, got "
                             f"logit_bias={lb!r}")
        if len(items) > LOGIT_BIAS_SLOTS:
            raise ValueError(f"logit_bias has {len(items)} entries; at most LOGIT_BIAS_SLOTS="
                             f"{LOGIT_BIAS_SLOTS} are supported per request")
        pairs = {}
        for t, b in items:
            if isinstance(t, str) and t.isdigit():       # JSON keys (OpenAI's API) are strings
                t = int(t)
            if not _is_int(t) or not 0 <= t <= INT32_MAX:
                raise ValueError(f"logit_bias token ids must be non-negative ints, got {t!r} in "
                                 f"logit_bias={lb!r}")
            if not _is_real(b) or not math.isfinite(b) or abs(b) > LOGIT_BIAS_MAX:
                raise ValueError(f"logit_bias biases must be numbers in [-{LOGIT_BIAS_MAX:g}, "
                                 f"{LOGIT_BIAS_MAX:g}], got {b!r} for token {t}")
            if int(t) in pairs:
                raise ValueError(f"logit_bias has token id {int(t)} twice")
            pairs[int(t)] = float(b)
        set_("logit_bias", tuple(sorted(pairs.items())))

    def _check_penalties(self, set_):
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables), got "
                             f"repetition_penalty={r!r}")
        set_("repetition_penalty", float(r))
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -PENALTY_MAX <= v <= PENALTY_MAX:
                raise ValueError(f"{name} must be a number in [-{PENALTY_MAX:g}, "
                                 f"{PENALTY_MAX:g}] (0 disables), got {name}={v!r}")
            set_(name, float(v))

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty is on (the request then needs its token history on device)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding with the checkpoint's MTP modules.

    method "chain": module `step % D` drafts autoregressively (MTP used as EAGLE), any K >= 1.
    method "multi_layer": K <= D distinct modules (the first K), module k consumes module k-1's
    hidden state.
    acceptance: "rejection" (lossless; greedy requests reduce to exact-match), "coupled"
    (lossless: target and draft sample position p with the same key, fold_in(request key, p);
    a draft is kept iff it equals the target's own sample, so a request's tokens are exactly
    those of plain seeded sampling, whatever K, the drafts or preemption), "greedy"
    (exact-match on the target argmax for every request), "relaxed" (lossy, thinking phase
    only), "synthetic" (benchmark-only: draft i is accepted with probability
    `synthetic_accept_rate` (or its i-th entry) given that drafts 1..i-1 were, so P(draft i
    accepted) is the product of the first i rates and a verify step commits on average
    1 + r + ... + r^K tokens for a scalar r; docs/spec_decoding.md), or any rule registered
    with `mtpjax.speculative.rules.register_acceptance_rule` (which also validates the rule's
    parameters).
    """

    num_speculative_tokens: int = 1
    method: str = "chain"
    acceptance: str = "rejection"
    relaxed_topk: int = 3
    relaxed_delta: float = 0.6
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None
    synthetic_accept_rate: float | tuple[float, ...] = 0.7
    # drafts come from N token ids (FR-Spec; speculative/draft_vocab.py), verification from all
    draft_vocab_size: int | None = None

    def __post_init__(self):
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        if self.draft_vocab_size is not None:
            _positive_int("draft_vocab_size", self.draft_vocab_size)
        if self.method not in SPEC_METHODS:
            raise ValueError(f"method {self.method!r} is not supported; supported: {SPEC_METHODS}")
        # the rule registry (lazy: cycle); an unknown name's error lists the registered rules
        from mtpjax.speculative.rules.registry import ACCEPTANCE_RULES, acceptance_rule
        rule = acceptance_rule(self.acceptance)
        if isinstance(self.synthetic_accept_rate, list):   # hashable: a static jit argument
            object.__setattr__(self, "synthetic_accept_rate", tuple(self.synthetic_accept_rate))
        for other in ACCEPTANCE_RULES.values():   # the config carries every rule's parameters
            other.check_params(self)
        rule.check_selected(self)

    def check_model(self, cfg: ModelConfig) -> None:
        """Raises if the model cannot serve this method."""
        if cfg.num_mtp_layers < 1:
            raise ValueError("speculative decoding needs a model with num_mtp_layers >= 1, got 0")
        if self.draft_vocab_size is not None and self.draft_vocab_size > cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is larger than the "
                             f"vocabulary ({cfg.vocab_size})")
        if self.method == "multi_layer" and self.num_speculative_tokens > cfg.num_mtp_layers:
            raise ValueError(
                f"method 'multi_layer' needs num_speculative_tokens <= num_mtp_layers "
                f"({cfg.num_mtp_layers}), got {self.num_speculative_tokens}; use method 'chain' "
                "to reuse modules")

    def synthetic_rates(self) -> tuple[float, ...]:
        r = self.synthetic_accept_rate
        r = tuple(r) if isinstance(r, (tuple, list)) else (r,)
        return r * self.num_speculative_tokens if len(r) == 1 else r
