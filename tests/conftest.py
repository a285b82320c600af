import dataclasses
import os

# mtpjax's persistent compilation cache off in the tests (it would write to ~/.cache/mtpjax); the
# cache's own tests turn it on in a tmp folder. MTPJAX_TEST_SHARED_CACHE=1 makes the run share one
# in a temp folder of its own (pytest_configure below).
os.environ.setdefault("MTPJAX_COMPILATION_CACHE", "0")
# The suite is dominated by XLA:CPU compiles of tiny models; LLVM's optimization passes make up
# about a third of it and buy nothing at these sizes. (No fast-math either way: same numbers.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()

import jax  # noqa: E402
import numpy as np
import pytest

jax.config.update("jax_default_matmul_precision", "highest")

from mtpjax import ModelConfig  # noqa: E402
from tests import gpu_interpreter  # noqa: E402
from tests import shared_compilation_cache  # noqa: E402

gpu_interpreter.install()


def replace_fields(cfg: ModelConfig, **fields) -> ModelConfig:
    """dataclasses.replace, where a field of the MLA / MoE sub-config (kv_lora_rank=,
    n_group=, routing=, ...) replaces it in `cfg.mla` / `cfg.moe`: the tests' shrinking helpers
    take every field by its own name."""
    subs = {}
    for name in ("mla", "moe"):
        sub = fields.pop(name, getattr(cfg, name))
        own = {f.name for f in dataclasses.fields(sub)} if dataclasses.is_dataclass(sub) else set()
        mine = {k: fields.pop(k) for k in list(fields) if k in own}
        subs[name] = dataclasses.replace(sub, **mine) if mine else sub
    return dataclasses.replace(cfg, **subs, **fields)


def tiny_config(**overrides) -> ModelConfig:
    base = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                       num_layers=2, num_heads=4, num_kv_heads=2, num_mtp_layers=1)
    return dataclasses.replace(base, **overrides)


def tiny_mla_moe_config(vocab_size: int = 48, moe: bool = True) -> ModelConfig:
    """A tiny DeepSeek-V3-style model (MLA with q_lora, 8 routed experts top-2 in 4 groups, one
    shared expert, a dense first layer, one MTP module); moe=False: the same with a dense FFN.
    A vocabulary of a test's own gives it programs traced anew (spies inside see them)."""
    return ModelConfig(
        model_type="deepseek_v3", vocab_size=vocab_size, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=4, attention_kind="mla",
        mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=12),
        ffn_kind="moe" if moe else "dense",
        moe=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 moe_intermediate_size=16, first_k_dense_replace=1, n_group=4,
                 topk_group=2) if moe else None,
        num_mtp_layers=1)


def pytest_configure(config):
    """One persistent compilation cache for the whole run, shared by the xdist workers
    (tests/shared_compilation_cache.py): a fresh temp folder, removed at the end."""
    config.addinivalue_line("markers", shared_compilation_cache.MARKER_HELP)
    if shared_compilation_cache.is_switched_off():
        return
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:             # the controller, or the only process without xdist
        folder = config.mtpjax_shared_cache = shared_compilation_cache.make_folder()
    else:
        folder = workerinput.get(shared_compilation_cache.WORKERINPUT_KEY)
    if folder:
        shared_compilation_cache.use(folder)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist, in the controller: hands each worker the run's cache folder."""
    folder = getattr(node.config, "mtpjax_shared_cache", None)
    if folder:
        node.workerinput[shared_compilation_cache.WORKERINPUT_KEY] = folder


def pytest_unconfigure(config):
    folder = getattr(config, "mtpjax_shared_cache", None)
    if folder:
        shared_compilation_cache.remove(folder)


@pytest.fixture(autouse=True)
def _own_compilation_cache(request):
    """A test marked own_compilation_cache runs with JAX's cache settings at their defaults."""
    if request.node.get_closest_marker(shared_compilation_cache.MARKER) is None:
        yield
        return
    with shared_compilation_cache.jax_defaults():
        yield


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops every compiled program after each test module. XLA:CPU maps each JIT-compiled
    kernel into memory; an xdist worker that keeps a whole suite's programs alive reached ~43k
    of the kernel's 65,530 `vm.max_map_count` mappings, and workers died in XLA compiles
    (segfault / abort) once they ran out. Programs are rarely shared across modules (with
    MTPJAX_TEST_SHARED_CACHE=1 a later module's copy comes from the run's persistent cache)."""
    yield
    jax.clear_caches()
    gpu_interpreter.clear()


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---- tiny Hugging Face checkpoints on disk (checkpoint tests) ------------------------------------

HF_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=7)
HF_FAMILIES = {            # family -> (transformers config, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_theta=1e6)),
    "mimo": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),   # + MTP tensors
}
MTP_BLOCK_SUFFIXES = ("input_layernorm.weight", "post_attention_layernorm.weight",
                      "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                      "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                      "self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                      "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def write_tokenizer(path, vocab_size: int):
    """A word-level tokenizer.json over the words t0 .. t{V-1} (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    tok.save(str(path / "tokenizer.json"))


def mtp_tensors(family: str, hf_cfg, num_mtp_layers: int, seed: int) -> dict:
    """Random MTP module tensors named as MiMo (`model.mtp_layers.{k}`, family "mimo") or
    DeepSeek (`model.layers.{L+k}`, with copies of the shared embedding and head) store them."""
    import torch
    g = torch.Generator().manual_seed(1000 + seed)
    E, L = hf_cfg.hidden_size, hf_cfg.num_hidden_layers
    shapes = {"input_layernorm.weight": (E,), "post_attention_layernorm.weight": (E,),
              "self_attn.q_proj.weight": (E, E), "self_attn.k_proj.weight": (E // 2, E),
              "self_attn.v_proj.weight": (E // 2, E), "self_attn.o_proj.weight": (E, E),
              "self_attn.q_proj.bias": (E,), "self_attn.k_proj.bias": (E // 2,),
              "self_attn.v_proj.bias": (E // 2,),
              "mlp.gate_proj.weight": (hf_cfg.intermediate_size, E),
              "mlp.up_proj.weight": (hf_cfg.intermediate_size, E),
              "mlp.down_proj.weight": (E, hf_cfg.intermediate_size)}
    names = ({"enorm": "token_layernorm.weight", "hnorm": "hidden_layernorm.weight",
              "proj": "input_proj.weight", "out": "final_layernorm.weight"} if family == "mimo" else
             {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "proj": "eh_proj.weight",
              "out": "shared_head.norm.weight"})
    out = {}
    for k in range(num_mtp_layers):
        pre = f"model.mtp_layers.{k}" if family == "mimo" else f"model.layers.{L + k}"
        for suffix, shape in shapes.items():
            if suffix.endswith("norm.weight"):
                t = 1.0 + 0.3 * torch.randn(shape, generator=g)
            else:
                t = 0.15 * torch.randn(shape, generator=g)
            out[f"{pre}.{suffix}"] = t
        for key in ("enorm", "hnorm", "out"):
            out[f"{pre}.{names[key]}"] = 1.0 + 0.3 * torch.randn(E, generator=g)
        out[f"{pre}.{names['proj']}"] = 0.15 * torch.randn(E, 2 * E, generator=g)
    return out


def move_off_init(model) -> None:
    """A random transformers model's weights moved off their init, in place (torch's global
    RNG): norms and biases shifted by 0.3 N(0, 1), every other weight scaled by 4, so logits are
    sharp and greedy argmax is far from ties."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)


def write_hf_checkpoint(path, family: str, seed: int, *, sharded: bool = False,
                        num_mtp_layers: int = 0, tokenizer: bool = True):
    """A tiny random checkpoint written by transformers' save_pretrained (llama, qwen2, qwen3).
    "mimo" is a qwen2 checkpoint plus MiMo-named MTP tensors (model_type "mimo"); a qwen2 one
    with num_mtp_layers > 0 gets DeepSeek-named ones. Weights are moved off their init (norms,
    biases) and sharpened so greedy argmax is far from ties. Returns (torch target model, MTP
    tensors by HF name)."""
    import json
    import os
    import torch
    import transformers
    from safetensors.torch import load_file, save_file
    cfg_cls, model_cls, extra = HF_FAMILIES[family]
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, cfg_cls)(**HF_BASE, **extra)
    model = getattr(transformers, model_cls)(hf_cfg).eval().float()
    move_off_init(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), max_shard_size="20KB" if sharded else "1GB")
    if family == "mimo":
        num_mtp_layers = num_mtp_layers or 2
    mtp = mtp_tensors(family, hf_cfg, num_mtp_layers, seed) if num_mtp_layers else {}
    if mtp and family != "mimo":           # DeepSeek keeps copies of the shared tensors per layer
        sd = model.state_dict()
        for k in range(num_mtp_layers):
            pre = f"model.layers.{hf_cfg.num_hidden_layers + k}"
            mtp[f"{pre}.embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
            mtp[f"{pre}.shared_head.head.weight"] = sd["lm_head.weight"].clone()
    if mtp:
        mtp = {k: v.contiguous() for k, v in mtp.items()}
        index_file = path / "model.safetensors.index.json"
        if index_file.exists():                 # one more shard, listed in the index
            save_file(mtp, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
            index = json.loads(index_file.read_text())
            index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
            index_file.write_text(json.dumps(index))
        else:
            tensors = load_file(str(path / "model.safetensors"))
            save_file({**tensors, **mtp}, str(path / "model.safetensors"),
                      metadata={"format": "pt"})
        cfg_json = json.loads((path / "config.json").read_text())
        cfg_json["num_nextn_predict_layers"] = num_mtp_layers
        if family == "mimo":
            cfg_json.update(model_type="mimo", architectures=["MiMoForCausalLM"])
        (path / "config.json").write_text(json.dumps(cfg_json))
    if tokenizer:
        write_tokenizer(path, HF_BASE["vocab_size"])
    assert os.path.isfile(path / "config.json")
    return model, mtp


def random_params(cfg: ModelConfig, seed: int = 0, dtype=np.float32, std: float = 0.3):
    """Like mtpjax.init_params, drawn with numpy (no per-shape compiles): normal weights, norms
    near one and nonzero biases, so a misplaced tensor shows in any comparison."""
    import jax.numpy as jnp
    from mtpjax.model.params import ParamSpec, param_specs
    rng = np.random.default_rng(seed)

    def draw(spec: ParamSpec):
        a = rng.standard_normal(spec.shape, np.float32)
        a = 1.0 + 0.3 * a if spec.init == "ones" else std * a
        return jnp.asarray(a.astype(dtype))
    return jax.tree.map(draw, param_specs(cfg), is_leaf=lambda x: isinstance(x, ParamSpec))
