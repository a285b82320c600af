"""Orbax save/restore (bit-exact, into a sharding) and Hugging Face export (bit-exact through
load_hf, byte-exact through HF -> Orbax -> HF, loadable by transformers)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from mtpjax.checkpoint import (Assets, CheckpointError, convert, export_hf, load_hf, restore,
                               save)
from mtpjax.checkpoint.bundle import flat_items
from tests.conftest import random_params, tiny_config, write_hf_checkpoint, write_tokenizer


def _assert_same(a, b):
    fa, fb = sorted(flat_items(a), key=lambda t: t[0]), sorted(flat_items(b), key=lambda t: t[0])
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (path, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))


def _model(family, D, seed=0, dtype=jnp.float32, **kw):
    extra = dict(qkv_bias=family in ("qwen2", "mimo"), qk_norm=family == "qwen3")
    if family == "mimo":
        extra.update(mtp_concat_order="hidden_embed", mtp_normed_hidden_to_next=True)
    cfg = tiny_config(model_type=family, num_mtp_layers=D, **extra, **kw)
    return cfg, random_params(cfg, seed, dtype)


def _assets(tmp_path):
    write_tokenizer(tmp_path, 96)
    return Assets({"model_type": "mimo", "bos_token_id": 1, "eos_token_id": [5, 6]},
                  {"tokenizer.json": (tmp_path / "tokenizer.json").read_bytes(),
                   "generation_config.json": b'{"eos_token_id": 9}'})


@pytest.mark.parametrize("family,D,dtype", [("mimo", 2, jnp.float32), ("qwen3", 1, jnp.bfloat16),
                                            ("llama", 0, jnp.float16)])
def test_orbax_round_trip_is_bit_exact(tmp_path, family, D, dtype):
    cfg, params = _model(family, D, dtype=dtype)
    assets = _assets(tmp_path)
    save(str(tmp_path / "ck"), params, cfg, assets=assets)
    got = restore(str(tmp_path / "ck"))
    assert got.cfg == cfg and got.assets == assets
    _assert_same(got.params, params)
    assert got.eos_token_id == 9                       # generation_config.json first
    assert got.tokenizer.decode(got.tokenizer.encode("t1 t2")) == "t1 t2"
    assert sorted(os.listdir(tmp_path)) == ["ck", "tokenizer.json"]   # no temp folder left


def test_restore_into_a_sharding(tmp_path):
    cfg, params = _model("qwen2", 1)
    save(str(tmp_path / "ck"), params, cfg)
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    named = NamedSharding(mesh, P())
    got = restore(str(tmp_path / "ck"), named)
    for _, leaf in flat_items(got.params):
        assert leaf.sharding == named
    _assert_same(got.params, params)
    # a tree of shardings, one per leaf, and a cast on restore
    tree = jax.tree.map(lambda a: SingleDeviceSharding(jax.devices()[0]), params)
    tree["embed"] = NamedSharding(mesh, P("x", None))
    got = restore(str(tmp_path / "ck"), tree, dtype=jnp.bfloat16)
    assert got.params["embed"].sharding == tree["embed"]
    _assert_same(got.params, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    # load_hf places leaves the same way
    export_hf(str(tmp_path / "hf"), params, cfg)
    loaded = load_hf(str(tmp_path / "hf"), sharding=named)
    assert all(leaf.sharding == named for _, leaf in flat_items(loaded.params))


@pytest.mark.parametrize("family,D,tied,shard,dtype", [
    ("llama", 0, True, None, jnp.float32), ("qwen2", 2, False, "16KB", jnp.float32),
    ("qwen3", 1, False, None, jnp.bfloat16), ("mimo", 2, False, "16KB", jnp.bfloat16)])
def test_export_then_load_is_bit_exact(tmp_path, family, D, tied, shard, dtype):
    cfg, params = _model(family, D, seed=D, dtype=dtype, tie_word_embeddings=tied)
    files = export_hf(str(tmp_path / "hf"), params, cfg, max_shard_size=shard)
    names = os.listdir(tmp_path / "hf")
    assert ("model.safetensors.index.json" in names) == (shard is not None)
    assert set(files) == set(names)
    got = load_hf(str(tmp_path / "hf"))
    assert got.cfg == cfg
    _assert_same(got.params, params)
    # the files are ordinary safetensors: the reference library reads the same values
    from safetensors import safe_open
    weight_map = (json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
                  ["weight_map"] if shard else {})
    name = "model.layers.1.self_attn.o_proj.weight"
    with safe_open(str(tmp_path / "hf" / weight_map.get(name, "model.safetensors")), "np") as f:
        np.testing.assert_array_equal(f.get_tensor(name), np.asarray(params["layers"][1]["wo"]).T)
    if weight_map and family == "mimo":             # MTP tensors in the family's layout
        assert {"model.mtp_layers.1.input_proj.weight", "model.mtp_layers.1.mlp.up_proj.weight",
                "model.mtp_layers.1.final_layernorm.weight"} <= set(weight_map)
    elif weight_map:
        assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
                "model.layers.3.embed_tokens.weight", "model.layers.3.mlp.up_proj.weight"} \
            <= set(weight_map)


def test_export_refuses_a_config_that_hf_cannot_express(tmp_path):
    cfg, params = _model("llama", 1, mtp_concat_order="hidden_embed")
    with pytest.raises(CheckpointError, match=r"cannot be written as a llama config\.json.*"
                                              r"mtp_concat_order"):
        export_hf(str(tmp_path / "hf"), params, cfg)
    assert not (tmp_path / "hf").exists()


def test_export_checks_the_tree(tmp_path):
    cfg, params = _model("llama", 1)
    params["layers"] = (dict(params["layers"][0], wq=params["layers"][0]["wq"][:, :8]),
                        *params["layers"][1:])
    with pytest.raises(CheckpointError, match=r"layers/0/wq: \[32, 8\] \(expected \[32, 32\]\)"):
        export_hf(str(tmp_path / "hf"), params, cfg)


# ---- with transformers ---------------------------------------------------------------------------

@pytest.mark.parametrize("family,D,sharded", [("mimo", 2, True), ("qwen2", 1, False)])
def test_hf_orbax_hf_round_trip_is_byte_exact(tmp_path, family, D, sharded):
    pytest.importorskip("torch")
    from safetensors.numpy import load_file
    src = tmp_path / "src"
    write_hf_checkpoint(src, family, 5, sharded=sharded, num_mtp_layers=D)
    s1 = convert(str(src), str(tmp_path / "orbax"))
    s2 = convert(str(tmp_path / "orbax"), str(tmp_path / "back"), to="hf",
                 max_shard_size="20KB" if sharded else None)
    assert s1.num_mtp_layers == s2.num_mtp_layers == D
    assert s1.mtp_layout == ("mimo" if family == "mimo" else "deepseek")

    def tensors(folder):
        out = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                out.update(load_file(str(folder / f)))
        return out
    a, b = tensors(src), tensors(tmp_path / "back")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
    for f in ("tokenizer.json", "generation_config.json"):
        assert (src / f).read_bytes() == (tmp_path / "back" / f).read_bytes()
    src_cfg = json.loads((src / "config.json").read_text())
    back_cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    for key in ("model_type", "bos_token_id", "eos_token_id", "num_nextn_predict_layers",
                "vocab_size", "num_hidden_layers", "transformers_version"):
        assert back_cfg[key] == src_cfg[key], key


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_transformers_loads_the_export(tmp_path, family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, _ = write_hf_checkpoint(tmp_path / "src", family, 6, tokenizer=False)
    ckpt = load_hf(str(tmp_path / "src"))
    export_hf(str(tmp_path / "out"), ckpt.params, ckpt.cfg, assets=ckpt.assets)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "out"), dtype=torch.float32).eval()
    assert type(again) is type(model)
    ids = torch.tensor(np.random.default_rng(6).integers(0, 128, size=(2, 20)))
    with torch.no_grad():
        np.testing.assert_array_equal(again(ids).logits.numpy(), model(ids).logits.numpy())
