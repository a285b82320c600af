"""load_hf and LLM.from_pretrained on tiny checkpoints written by transformers (llama, qwen2,
qwen3) and in the MiMo layout, sharded and not: logits and greedy generate against
transformers, the MTP module against an independent torch re-implementation, speculative ==
plain greedy output, and the bf16 read path."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import mtpjax  # noqa: E402
from mtpjax import LLM, SamplingParams, SpecConfig  # noqa: E402
from mtpjax.checkpoint import CheckpointError, convert, from_hf_state_dict, load_hf  # noqa: E402
from tests.conftest import HF_BASE, MTP_BLOCK_SUFFIXES, write_hf_checkpoint  # noqa: E402

V = HF_BASE["vocab_size"]
ENGINE = dict(num_pages=48, page_size=4, max_num_seqs=3, max_num_batched_tokens=32)


@pytest.mark.parametrize("family,sharded,seed", [
    ("llama", False, 0), ("llama", True, 1), ("qwen2", False, 0), ("qwen2", True, 1),
    ("qwen3", False, 0), ("qwen3", True, 1), ("mimo", False, 0), ("mimo", True, 1)])
def test_logits_match_transformers(tmp_path, family, sharded, seed):
    model, mtp = write_hf_checkpoint(tmp_path, family, seed, sharded=sharded)
    ckpt = load_hf(str(tmp_path))
    assert ckpt.cfg.model_type == family
    assert ckpt.cfg.num_mtp_layers == (2 if family == "mimo" else 0)
    assert ckpt.eos_token_id == HF_BASE["eos_token_id"]
    assert ckpt.tokenizer.encode("t3 t9 t127") == [3, 9, 127]
    ids = np.random.default_rng(seed).integers(0, V, size=(2, 24))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(mtpjax.forward(ckpt.params, ckpt.cfg, jnp.asarray(ids)))
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=1e-4)
    # The in-memory path reads the same key table: the same params, bit for bit.
    in_memory = from_hf_state_dict(ckpt.cfg, {**model.state_dict(), **mtp})
    for a, b in zip(*(sorted(mtpjax.checkpoint.bundle.flat_items(t)) for t in
                      (in_memory, ckpt.params))):
        assert a[0] == b[0]
        np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def test_bf16_checkpoint_reads_exactly(tmp_path):
    model, _ = write_hf_checkpoint(tmp_path / "f32", "qwen3", 4, tokenizer=False)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    ckpt = load_hf(str(tmp_path / "bf16"))                   # dtype None: as stored
    assert ckpt.params["embed"].dtype == jnp.bfloat16 and ckpt.tokenizer is None
    want = from_hf_state_dict(ckpt.cfg, model.state_dict(), dtype=jnp.bfloat16)
    for got_layer, want_layer in zip(ckpt.params["layers"], want["layers"], strict=True):
        np.testing.assert_array_equal(np.asarray(got_layer["wq"]), np.asarray(want_layer["wq"]))
    f32 = load_hf(str(tmp_path / "bf16"), jnp.float32)
    np.testing.assert_array_equal(
        np.asarray(f32.params["embed"]),
        model.model.embed_tokens.weight.float().detach().numpy())


# ---- MTP module: an independent re-implementation of vLLM's mimo_mtp / deepseek_mtp formulas ---

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp(model, mtp, layout, k, hidden, tokens):
    """Module k at positions 0..T-1 given the previous depth's hidden states and the tokens:
    (hidden handed to the next depth, logits). The block is transformers' Qwen2DecoderLayer."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding
    cfg, eps = model.config, model.config.rms_norm_eps
    if layout == "mimo":
        pre, e_n, h_n, proj, out_n = (f"model.mtp_layers.{k}", "token_layernorm", "hidden_layernorm",
                                      "input_proj", "final_layernorm")
    else:
        pre, e_n, h_n, proj, out_n = (f"model.layers.{cfg.num_hidden_layers + k}", "enorm", "hnorm",
                                      "eh_proj", "shared_head.norm")
    w = lambda name: mtp[f"{pre}.{name}.weight"]
    B, T = tokens.shape
    positions = torch.arange(T)[None].expand(B, T)
    emb = model.model.embed_tokens.weight[tokens].clone()
    emb[positions == 0] = 0.0                                    # not needed at position 0
    e, h = _rms(emb, w(e_n), eps), _rms(hidden, w(h_n), eps)
    u = torch.cat([h, e] if layout == "mimo" else [e, h], dim=-1) @ w(proj).T
    block = Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    block.load_state_dict({s: mtp[f"{pre}.{s}"] for s in MTP_BLOCK_SUFFIXES})
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    y = block(u, attention_mask=mask, position_ids=positions,
              position_embeddings=Qwen2RotaryEmbedding(cfg)(u, positions))
    y = y[0] if isinstance(y, tuple) else y
    normed = _rms(y, w(out_n), eps)
    logits = normed @ model.lm_head.weight.T
    return (normed if layout == "mimo" else y), logits          # MiMo hands on the normed state


@pytest.mark.parametrize("layout,seed", [("mimo", 3), ("mimo", 4), ("deepseek", 3)])
def test_mtp_modules_match_reference(tmp_path, layout, seed):
    family = "mimo" if layout == "mimo" else "qwen2"
    model, mtp = write_hf_checkpoint(tmp_path, family, seed, num_mtp_layers=2, sharded=True,
                                     tokenizer=False)
    ckpt = load_hf(str(tmp_path))
    assert ckpt.cfg.num_mtp_layers == 2
    assert ckpt.cfg.mtp_concat_order == ("hidden_embed" if layout == "mimo" else "embed_hidden")
    T = 12
    ids = np.random.default_rng(seed).integers(0, V, size=(2, T + 2))
    with torch.no_grad():
        ref_h = model.model(torch.tensor(ids[:, :T])).last_hidden_state   # after the final norm
        ours_h = jnp.asarray(ref_h.numpy())
        for k in range(2):              # module k at position i is given token x_{i+k+1}
            tokens = ids[:, k + 1:k + 1 + T]
            ref_h, ref_logits = reference_mtp(model, mtp, layout, k, ref_h, torch.tensor(tokens))
            ours_h, ours_logits = mtpjax.mtp_forward(ckpt.params, ckpt.cfg, k, ours_h,
                                                     jnp.asarray(tokens))
            np.testing.assert_allclose(np.asarray(ours_h), ref_h.numpy(), atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(np.asarray(ours_logits), ref_logits.numpy(), atol=1e-4,
                                       rtol=1e-4)


# ---- LLM.from_pretrained: greedy generate against transformers, speculative == plain -----------

def _prompts(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V, size=n).tolist() for n in (5, 12, 1)]


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()            # stops after eos (generation_config.json)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mimo"])
def test_greedy_generate_matches_transformers(tmp_path, family):
    model, _ = write_hf_checkpoint(tmp_path / "hf", family, 7)
    prompts = _prompts(7)
    llm = LLM.from_pretrained(str(tmp_path / "hf"), **ENGINE)
    assert llm.tokenizer is not None
    outs = llm.generate(prompts, SamplingParams(max_tokens=10))
    got = [o.token_ids for o in outs]
    assert got == [_hf_greedy(model, p, 10) for p in prompts]
    if family == "llama":
        # eos from generation_config.json: every output stops right after it (eos kept)
        eos = got[0][2]
        gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
        (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))
        stopped = LLM.from_pretrained(str(tmp_path / "hf"), **ENGINE).generate(
            prompts, SamplingParams(max_tokens=10))
        assert [o.token_ids for o in stopped] == [t[:t.index(eos) + 1] if eos in t else t
                                                  for t in got]
        assert stopped[0].finish_reason == "stop"
        (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(gen))
        # the Orbax folder serves the same tokens (same config: same compiled step)
        convert(str(tmp_path / "hf"), str(tmp_path / "orbax"))
        llm2 = LLM.from_pretrained(str(tmp_path / "orbax"), **ENGINE)
        assert [o.token_ids for o in llm2.generate(prompts, SamplingParams(max_tokens=10))] == got
        text = llm2.generate(["t5 t6 t7"], SamplingParams(max_tokens=4))[0]
        assert text.text == " ".join(f"t{i}" for i in text.token_ids)
    if family == "mimo":                # speculative greedy (MTP drafts, K > D) == plain greedy
        spec = LLM.from_pretrained(str(tmp_path / "hf"), SpecConfig(num_speculative_tokens=3),
                                   **ENGINE)
        more = prompts + _prompts(8) + _prompts(9)
        plain = [o.token_ids for o in llm.generate(more, SamplingParams(max_tokens=12))]
        outs = spec.generate(more, SamplingParams(max_tokens=12))
        assert [o.token_ids for o in outs] == plain
        assert sum(o.num_verify_steps for o in outs) > 0


def test_spec_on_a_checkpoint_without_mtp_is_a_clear_error(tmp_path):
    write_hf_checkpoint(tmp_path, "qwen3", 0, tokenizer=False)
    with pytest.raises(CheckpointError, match="qwen3 checkpoint has no MTP modules.*loads as a "
                                              "target model only"):
        LLM.from_pretrained(str(tmp_path), SpecConfig(num_speculative_tokens=2), **ENGINE)
