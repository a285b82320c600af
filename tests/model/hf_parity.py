"""Transformers-parity harness for a model family with MTP modules in DeepSeek's layout (helper
module, not a test file): a family's test file is its `HFFamily` plus its own special checks.

Tiny float32 checkpoints are written by transformers' save_pretrained (on-disk layout: one tensor
per expert), plus random MTP modules at `model.layers.{L + k}` named as DeepSeek stores them
(transformers' models have none; vLLM reads them there). The checks:
- `check_logits`: our forward's logits equal transformers' on padded random prompts;
- `check_greedy_generate_and_engine`: greedy `mtpjax.generate` and the engine with K = 2
  speculation both equal transformers' greedy generate;
- `check_mtp_module`: the MTP module equals the formula written out in torch around
  transformers' own decoder layer;
- `check_export_round_trip`: export_hf then load_hf gives the same tree, and transformers reads
  the export to the same logits;
- `routing_differs`: the correction bias and the group limit each change the routed experts.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mtpjax
from mtpjax import ModelConfig, SamplingParams, SpecConfig
from mtpjax.checkpoint import export_hf, key_table, load_hf
from tests.conftest import move_off_init

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEEDS = (0, 1)          # the seeds the logits parity runs per variant


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """A transformers family: `{prefix}Config`, `{prefix}ForCausalLM`, `{prefix}DecoderLayer` and
    `{prefix}RotaryEmbedding` in `transformers.models.{module}.modeling_{module}`; `base`: the
    config's fields, `variants`: name -> fields over base."""
    prefix: str
    module: str
    base: dict
    variants: dict

    def transformers_class(self, suffix: str):
        modeling = getattr(getattr(transformers.models, self.module), f"modeling_{self.module}")
        return getattr(modeling, self.prefix + suffix)

    @property
    def vocab_size(self) -> int:
        return self.base["vocab_size"]


def hf_model(family: HFFamily, variant: str, seed: int):
    """A random transformers model of the variant, moved off its init: norms and biases shifted,
    weights scaled up (sharper logits), routing correction biases non-zero."""
    torch.manual_seed(seed)
    hf_cfg = family.transformers_class("Config")(**{**family.base, **family.variants[variant]})
    hf_cfg._attn_implementation = "eager"
    model = family.transformers_class("ForCausalLM")(hf_cfg).eval().float()
    move_off_init(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    return model


def write_checkpoint(family: HFFamily, path, variant: str, seed: int, num_mtp_layers: int = 1):
    """save_pretrained + random MTP modules named as DeepSeek stores them (names from our key
    table, which is what is tested elsewhere: here it only spares listing ~30 names). Returns
    the torch model."""
    from safetensors.torch import load_file, save_file
    model = hf_model(family, variant, seed)
    model.save_pretrained(str(path))
    cfg_json = json.loads((path / "config.json").read_text())
    cfg_json["num_nextn_predict_layers"] = num_mtp_layers
    (path / "config.json").write_text(json.dumps(cfg_json))
    if num_mtp_layers:
        table = key_table(ModelConfig.from_hf(cfg_json))
        g = torch.Generator().manual_seed(500 + seed)
        tensors = load_file(str(path / "model.safetensors"))
        for name, slot in table.slots.items():
            if slot.path[0] != "mtp":
                continue
            shape = table.hf_shape(name)
            if name.endswith("norm.weight"):
                tensors[name] = 1.0 + 0.3 * torch.randn(shape, generator=g)
            elif name.endswith("e_score_correction_bias"):
                tensors[name] = 0.2 * torch.randn(shape, generator=g)
            else:
                tensors[name] = 0.3 * torch.randn(shape, generator=g)
        for k in range(num_mtp_layers):
            pre = f"model.layers.{family.base['num_hidden_layers'] + k}"
            tensors[f"{pre}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
            tensors[f"{pre}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return model


class Checkpoints(dict):
    """(variant, seed) -> (folder, torch model), each written on first use (a run of a few
    tests builds only theirs): a family's module-scoped `checkpoints` fixture returns one."""

    def __init__(self, family: HFFamily, tmp_path_factory, name: str):
        super().__init__()
        self.family, self.tmp_path_factory, self.name = family, tmp_path_factory, name

    def __missing__(self, key):
        variant, seed = key
        if variant not in self.family.variants:
            raise KeyError(f"no variant {variant!r}; expected one of {list(self.family.variants)}")
        path = self.tmp_path_factory.mktemp(f"{self.name}_{variant}_{seed}")
        self[key] = (path, write_checkpoint(self.family, path, variant, seed))
        return self[key]


def prompts(family: HFFamily, seed: int, n: int = 3) -> list[list[int]]:
    """n random prompts of 4..13 ids in [2, vocab)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, family.vocab_size, int(t)).tolist() for t in rng.integers(4, 14, n)]


def check_logits(family: HFFamily, path, model, seed: int) -> None:
    ck = load_hf(str(path), jnp.float32)
    ids = np.asarray([p + [3] * (14 - len(p)) for p in prompts(family, seed, 2)])
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(mtpjax.forward(ck.params, ck.cfg, jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def check_greedy_generate_and_engine(family: HFFamily, path, model) -> None:
    ck = load_hf(str(path), jnp.float32)
    batch = prompts(family, 7, 3)
    want = []
    for p in batch:
        with torch.no_grad():
            out = model.generate(torch.as_tensor([p]), max_new_tokens=10, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    assert mtpjax.generate(ck.params, ck.cfg, batch, max_new_tokens=10).tokens == want
    # min_token_bucket = the token budget: every step runs one T = 16 program (fewer compiles)
    llm = mtpjax.LLM(ck.params, ck.cfg, SpecConfig(num_speculative_tokens=2), num_pages=64,
                     page_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                     min_token_bucket=16, warmup=False)
    assert [o.token_ids for o in llm.generate(batch, SamplingParams(max_tokens=10))] == want


def routing_differs(path, x) -> tuple[bool, bool, np.ndarray]:
    """(the correction bias changes some token's experts, the group limit does, the experts
    [N, top-k]) for inputs x [N, hidden] at the checkpoint's first MoE layer (layer 1)."""
    from mtpjax.model.moe import route
    ck = load_hf(str(path), jnp.float32)
    p = ck.params["layers"][1]
    moe = ck.cfg.moe
    ids, _ = route(p, x, moe)
    no_bias, _ = route({**p, "router_bias": jnp.zeros_like(p["router_bias"])}, x, moe)
    no_limit, _ = route(p, x, dataclasses.replace(moe, topk_group=moe.n_group))

    def differs(a, b):
        return any(set(r) != set(s) for r, s in zip(np.asarray(a).tolist(), np.asarray(b).tolist()))
    return differs(ids, no_bias), differs(ids, no_limit), np.asarray(ids)


def _torch_rmsnorm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))


def check_mtp_module(family: HFFamily, path, model) -> None:
    """The MTP module written out in torch around transformers' own decoder layer: e =
    enorm(embed(x)) (zero at position 0), u = eh_proj([e, hnorm(h)]), y = layer(u), logits =
    head(shared_head.norm(y)), and y handed on."""
    from safetensors.torch import load_file
    ck = load_hf(str(path), jnp.float32)
    L, X = family.base["num_hidden_layers"], family.base["n_routed_experts"]
    eps = family.base["rms_norm_eps"]
    sd = load_file(str(path / "model.safetensors"))
    pre = f"model.layers.{L}."
    mod = {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}
    layer = family.transformers_class("DecoderLayer")(model.config, layer_idx=L).eval()
    block = {k: v for k, v in mod.items() if not k.startswith(("enorm", "hnorm", "eh_proj",
                                                                "shared_head", "embed_tokens"))
             and ".experts." not in k}
    block["mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([mod[f"mlp.experts.{e}.gate_proj.weight"],
                    mod[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(X)])
    block["mlp.experts.down_proj"] = torch.stack(
        [mod[f"mlp.experts.{e}.down_proj.weight"] for e in range(X)])
    missing, unexpected = layer.load_state_dict(block, strict=False)
    # a non-persistent correction-bias buffer is not in the state dict: copied in below
    assert not unexpected and not [m for m in missing if "e_score_correction_bias" not in m], \
        (missing, unexpected)

    rng = np.random.default_rng(3)
    B, T = 2, 9
    tokens = rng.integers(0, family.vocab_size, (B, T))
    hidden = rng.normal(size=(B, T, family.base["hidden_size"])).astype(np.float32)
    h_next, logits = mtpjax.mtp_forward(ck.params, ck.cfg, 0, jnp.asarray(hidden),
                                        jnp.asarray(tokens))
    with torch.no_grad():
        if "mlp.gate.e_score_correction_bias" in mod:
            layer.mlp.gate.e_score_correction_bias.copy_(mod["mlp.gate.e_score_correction_bias"])
        tok = torch.as_tensor(tokens)
        pos = torch.arange(T)[None].expand(B, T)
        emb = sd["model.embed_tokens.weight"][tok]
        emb = torch.where((pos == 0)[..., None], torch.zeros_like(emb), emb)
        e = _torch_rmsnorm(emb, mod["enorm.weight"], eps)
        h = _torch_rmsnorm(torch.as_tensor(hidden), mod["hnorm.weight"], eps)
        u = torch.cat([e, h], -1) @ mod["eh_proj.weight"].T
        rotary = family.transformers_class("RotaryEmbedding")(model.config)
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = layer(u, attention_mask=mask, position_ids=pos, position_embeddings=rotary(u, pos))
        want = (_torch_rmsnorm(y, mod["shared_head.norm.weight"], eps)
                @ mod["shared_head.head.weight"].T)
    np.testing.assert_allclose(np.asarray(h_next), y.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want.numpy(), atol=1e-4, rtol=1e-4)


def check_export_round_trip(family: HFFamily, path, model, out):
    """export_hf to `out`, load_hf back: same config, bit-equal params; transformers reads the
    export to the logits of `model`. Returns the loaded-back checkpoint."""
    ck = load_hf(str(path), jnp.float32)
    export_hf(str(out), ck.params, ck.cfg, assets=ck.assets)
    back = load_hf(str(out), jnp.float32)
    assert back.cfg == ck.cfg
    for a, b in zip(jax.tree.leaves(ck.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = family.transformers_class("ForCausalLM").from_pretrained(str(out)).eval().float()
    ids = torch.as_tensor([prompts(family, 2, 1)[0]])
    with torch.no_grad():
        np.testing.assert_allclose(hf(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-5)
    return back
