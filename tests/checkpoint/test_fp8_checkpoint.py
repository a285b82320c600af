"""Block-scaled FP8 checkpoints (DeepSeek-V3's format): a tiny llama folder whose projections are
quantized here to F8_E4M3 with 128x128 `weight_scale_inv` blocks (partial ones too: hidden 160,
intermediate 200) loads as exactly the dequantized weights; every mismatch between weights,
scales and quantization_config is a CheckpointError naming the tensor. Also: `mtpjax.checkpoint`
after a plain `import mtpjax`, and `python -m mtpjax`."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mtpjax
from mtpjax.checkpoint import CheckpointError, export_hf, from_hf_state_dict, key_table, load_hf
from mtpjax.checkpoint.fp8 import dequantize_state_dict
from mtpjax.checkpoint.safetensors_io import TensorSource, read_tensor, scan_folder, write_folder
from tests.conftest import random_params, tiny_config

BLOCK = 128
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
FP8_MAX = 448.0                     # largest finite float8_e4m3fn


def _cfg():
    return tiny_config(hidden_size=160, intermediate_size=200, num_mtp_layers=1)


def _expand(scale_inv, shape):
    return np.repeat(np.repeat(scale_inv, BLOCK, 0), BLOCK, 1)[:shape[0], :shape[1]]


def quantize(w: np.ndarray):
    """[R, C] float32 -> (float8_e4m3fn [R, C], float32 scale_inv [ceil(R/128), ceil(C/128)]),
    scale_inv = blockwise amax / 448 (DeepSeek's recipe)."""
    R, C = w.shape
    s = np.zeros((-(-R // BLOCK), -(-C // BLOCK)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            amax = np.abs(w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]).max()
            s[i, j] = max(amax, 1e-12) / FP8_MAX
    q = (w / _expand(s, w.shape)).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def _quantized(name: str) -> bool:
    """The projections (experts' too); norms, embeddings, the router and the head stay float
    (as DeepSeek-V3 ships them)."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight"))


def _write(path, tensors: dict, hf_config: dict, sharded: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    sources = [TensorSource(n, a.shape, a.dtype, lambda a=a: a) for n, a in tensors.items()]
    write_folder(str(path), sources, 60_000 if sharded else None)
    (path / "config.json").write_text(json.dumps(hf_config))


def make_fp8(tmp_path, seed: int, sharded: bool = False, cfg=None):
    """An FP8 HF folder at tmp_path/"fp8" (of `cfg`, default a llama with partial blocks; a
    deepseek_v3 config gives DeepSeek-V3's own tensor names). Returns (cfg, original params,
    HF tensors as stored, the dequantized weights expected by HF name)."""
    cfg = cfg or _cfg()
    params = random_params(cfg, seed, std=0.05)
    src = tmp_path / f"src{seed}"
    export_hf(str(src), params, cfg)
    infos = scan_folder(str(src))
    tensors, expected = {}, {}
    for name, info in infos.items():
        a = read_tensor(info)
        if _quantized(name):
            q, s = quantize(a)
            tensors[name], tensors[name + "_scale_inv"] = q, s
            expected[name] = q.astype(np.float32) * _expand(s, a.shape)
        else:
            tensors[name] = a
    assert any(w.shape[0] % BLOCK and w.shape[1] % BLOCK for w in expected.values())
    hf_config = json.loads((src / "config.json").read_text())
    _write(tmp_path / "fp8", tensors, {**hf_config, "quantization_config": QUANT_CONFIG}, sharded)
    return cfg, params, tensors, expected


def _leaf(params, path):
    for p in path:
        params = params[p]
    return np.asarray(params)


def _assert_dequantized(params, cfg, expected):
    for name, slot in key_table(cfg).slots.items():
        if name in expected:
            want = expected[name].T if slot.transpose else expected[name]
            got = _leaf(params, slot.path)
            assert got.dtype == np.float32, name
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=name)


@pytest.mark.parametrize("seed,sharded", [(0, False), (1, True), (2, False)])
def test_load_gives_the_dequantized_weights_bitwise(tmp_path, seed, sharded):
    cfg, params, tensors, expected = make_fp8(tmp_path, seed, sharded)
    if sharded:
        assert (tmp_path / "fp8" / "model.safetensors.index.json").exists()
    ckpt = load_hf(str(tmp_path / "fp8"), fp8="dequantize")
    assert ckpt.cfg == cfg
    _assert_dequantized(ckpt.params, cfg, expected)
    for name, slot in key_table(cfg).slots.items():          # the rest as stored
        if name not in expected:
            want = tensors[name].T if slot.transpose else tensors[name]
            np.testing.assert_array_equal(_leaf(ckpt.params, slot.path), want, err_msg=name)
    # and close to what was quantized (e4m3 keeps 3 mantissa bits)
    for name, slot in key_table(cfg).slots.items():
        if name in expected:
            orig = _leaf(params, slot.path)
            err = np.abs(_leaf(ckpt.params, slot.path) - orig).max()
            assert err <= 2 ** -3 * np.abs(orig).max(), name


def test_fp8_model_runs_and_matches_the_unquantized_one(tmp_path):
    cfg, params, _, _ = make_fp8(tmp_path, 3)
    ckpt = load_hf(str(tmp_path / "fp8"), dtype=jnp.bfloat16, fp8="dequantize")
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(ckpt.params))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    ours = np.asarray(mtpjax.forward(ckpt.params, cfg, tokens), np.float32)
    ref = np.asarray(mtpjax.forward(params, cfg, tokens), np.float32)
    assert ours.shape == (2, 7, cfg.vocab_size) and np.isfinite(ours).all()
    # e4m3's 3 mantissa bits move logits by a few % of their range; a misplaced block would not
    # stay this correlated (measured 0.997)
    assert np.corrcoef(ours.ravel(), ref.ravel())[0, 1] > 0.99


def test_export_writes_unquantized_weights_without_quantization_config(tmp_path):
    cfg, _, _, expected = make_fp8(tmp_path, 4)
    ckpt = load_hf(str(tmp_path / "fp8"), fp8="dequantize")
    out = tmp_path / "out"
    export_hf(str(out), ckpt.params, cfg, assets=ckpt.assets)
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    infos = scan_folder(str(out))
    assert not any(n.endswith("_scale_inv") for n in infos)
    assert {i.dtype for i in infos.values()} == {"F32"}
    _assert_dequantized(load_hf(str(out)).params, cfg, expected)


def test_in_memory_state_dict(tmp_path):
    cfg, _, tensors, expected = make_fp8(tmp_path, 5)
    params = from_hf_state_dict(cfg, dequantize_state_dict(tensors))
    _assert_dequantized(params, cfg, expected)


def test_in_memory_torch_state_dict(tmp_path):
    torch = pytest.importorskip("torch")
    cfg, _, tensors, expected = make_fp8(tmp_path, 6)
    fp8 = ml_dtypes.float8_e4m3fn
    sd = {n: torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn) if a.dtype == fp8
          else torch.from_numpy(a) for n, a in tensors.items()}
    _assert_dequantized(from_hf_state_dict(cfg, dequantize_state_dict(sd)), cfg, expected)


# ---- errors --------------------------------------------------------------------------------------

Q = "model.layers.2.eh_proj.weight"                   # [160, 320]: scale [2, 3]
G = "model.layers.0.mlp.gate_proj.weight"             # [200, 160]: scale [2, 2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8")
    _, _, tensors, _ = make_fp8(tmp, 7)
    return tensors, json.loads((tmp / "fp8" / "config.json").read_text())


def _load_damaged(tmp_path, pristine, edit_tensors=None, edit_config=None):
    tensors, hf_config = dict(pristine[0]), json.loads(json.dumps(pristine[1]))
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(hf_config)
    _write(tmp_path / "bad", tensors, hf_config)
    with pytest.raises(CheckpointError) as e:
        load_hf(str(tmp_path / "bad"))
    return str(e.value)


def test_missing_scale(tmp_path, pristine):
    msg = _load_damaged(tmp_path, pristine, lambda t: t.pop(Q + "_scale_inv"))
    assert f"{Q}: F8_E4M3 without its scale {Q}_scale_inv (expected shape [2, 3])" in msg


def test_wrong_scale_shape(tmp_path, pristine):
    msg = _load_damaged(tmp_path, pristine,
                        lambda t: t.update({G + "_scale_inv": np.ones((1, 2), np.float32)}))
    assert f"{G}_scale_inv: shape [1, 2], expected [2, 2]" in msg
    assert "[200, 160]" in msg


def test_orphan_scale(tmp_path, pristine):
    orphan = "model.layers.0.mlp.gate.weight_scale_inv"
    msg = _load_damaged(tmp_path, pristine,
                        lambda t: t.update({orphan: np.ones((1, 1), np.float32)}))
    weight = "model.layers.0.mlp.gate.weight"
    assert f"{orphan}: scale of {weight}, which the checkpoint does not have" in msg


def test_scale_of_an_unquantized_weight(tmp_path, pristine):
    name = "model.embed_tokens.weight"
    msg = _load_damaged(tmp_path, pristine,
                        lambda t: t.update({name + "_scale_inv": np.ones((1, 2), np.float32)}))
    assert f"{name}_scale_inv: scale of {name}, which is stored as F32, not F8_E4M3" in msg


def test_fp8_without_quantization_config(tmp_path, pristine):
    msg = _load_damaged(tmp_path, pristine, edit_config=lambda c: c.pop("quantization_config"))
    assert "has no quantization_config" in msg and "F8_E4M3" in msg


@pytest.mark.parametrize("key,value,says", [
    ("quant_method", "gptq", "quant_method 'gptq' is not supported"),
    ("fmt", "e5m2", "fmt 'e5m2' is not supported"),
    ("weight_block_size", [0, 64], "weight_block_size [0, 64] is not supported"),
    ("weight_block_size", [128], "weight_block_size [128] is not supported"),
    ("weight_block_size", None, "weight_block_size None is not supported"),
    ("activation_scheme", "static", "activation_scheme 'static' is not supported"),
])
def test_unsupported_quantization_config(tmp_path, pristine, key, value, says):
    msg = _load_damaged(tmp_path, pristine, edit_config=lambda c: c["quantization_config"].update(
        {key: value}))
    assert "config.json: quantization_config " + says in msg


# ---- import and `python -m` ----------------------------------------------------------------------

def _run(*args):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_checkpoint_after_plain_import():
    r = _run("-c", "import sys, mtpjax; mtpjax.checkpoint.load_hf; mtpjax.checkpoint.fp8;"
                   "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"              # no torch / transformers at import time


def test_python_dash_m():
    r = _run("-m", "mtpjax", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: mtpjax" in r.stdout and "convert" in r.stdout
    assert _run("-m", "mtpjax").returncode == 2   # argparse: a command is required


# ---- kept FP8 (load_hf's default) ----------------------------------------------------------------

def _ds_cfg():
    """A tiny DeepSeek-V3 (MLA + MoE + an MTP layer): DeepSeek-V3's own tensor names, its
    128 x 128 blocks (partial ones here), routed and shared experts quantized, the router not."""
    from tests.model.test_deepseek import ds_config
    return ds_config(num_mtp_layers=1)


@pytest.mark.parametrize("seed,sharded", [(20, False), (21, True)])
def test_deepseek_v3_fp8_checkpoint_loads_fp8_and_exports_byte_for_byte(tmp_path, seed, sharded):
    from mtpjax import Fp8Weight
    cfg, _, tensors, expected = make_fp8(tmp_path, seed, sharded, cfg=_ds_cfg())
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv" in tensors
    assert "model.layers.2.eh_proj.weight_scale_inv" in tensors
    ckpt = load_hf(str(tmp_path / "fp8"))
    table = key_table(cfg)
    for name, slot in table.slots.items():
        leaf = ckpt.params
        for p in slot.path:
            leaf = leaf[p]
        if name not in expected:
            assert not isinstance(leaf, Fp8Weight), name
            continue
        assert isinstance(leaf, Fp8Weight), name
        assert leaf.values.dtype == jnp.float8_e4m3fn and leaf.scale.dtype == jnp.float32
        assert leaf.dtype == jnp.bfloat16 and leaf.block == (BLOCK, BLOCK)
        one = Fp8Weight(leaf.values[slot.index] if slot.index else leaf.values,
                        leaf.scale[slot.index] if slot.index else leaf.scale, leaf.block)
        stored = tensors[name].T if slot.transpose else tensors[name]
        np.testing.assert_array_equal(np.asarray(one.values).view(np.uint8), stored.view(np.uint8))
        # its dequantization is the checkpoint's (fp8.dequantize, transposed)
        want = expected[name].T if slot.transpose else expected[name]
        np.testing.assert_array_equal(np.asarray(one.dequantize(jnp.float32)), want, err_msg=name)
    out = tmp_path / "out"
    export_hf(str(out), ckpt.params, cfg, assets=ckpt.assets, max_shard_size=60_000 if sharded
              else None)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANT_CONFIG
    infos = scan_folder(str(out))
    assert set(infos) == set(tensors)
    for name, info in infos.items():
        a = read_tensor(info)
        assert a.dtype == tensors[name].dtype and a.tobytes() == tensors[name].tobytes(), name


def test_kept_fp8_runs_greedy_like_the_dequantize_on_load_path(tmp_path):
    from mtpjax import dequantize_params
    cfg, _, _, _ = make_fp8(tmp_path, 22, cfg=_ds_cfg())
    kept = load_hf(str(tmp_path / "fp8"), dtype=jnp.bfloat16)
    ref = load_hf(str(tmp_path / "fp8"), dtype=jnp.bfloat16, fp8="dequantize")
    # the same bf16 weights: dequantized on the host at load, or from the kept FP8 in the step
    for a, b in zip(jax.tree.leaves(dequantize_params(kept.params)), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5]]
    want = mtpjax.generate(ref.params, cfg, prompts, max_new_tokens=8).tokens
    spec = mtpjax.SpecConfig(num_speculative_tokens=1)
    assert mtpjax.generate(kept.params, cfg, prompts, max_new_tokens=8, spec=spec).tokens == want


def test_export_of_quantize_fp8_params_loads_back_bit_exact(tmp_path):
    from mtpjax import Fp8Weight, quantize_fp8
    cfg = _cfg()
    q = quantize_fp8(random_params(cfg, 23, std=0.05), (32, 16))
    export_hf(str(tmp_path / "q"), q, cfg)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [16, 32]   # HF's [out, in]
    back = load_hf(str(tmp_path / "q"), dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    assert isinstance(back.params["layers"][0]["wq"], Fp8Weight)
    # one quantization_config cannot hold per-channel scales of several shapes
    with pytest.raises(CheckpointError, match="one weight_block_size"):
        export_hf(str(tmp_path / "c"), quantize_fp8(random_params(cfg, 23), "channel"), cfg)
    # ... but exports dequantized with a dtype
    export_hf(str(tmp_path / "d"), quantize_fp8(random_params(cfg, 23), "channel"), cfg,
              dtype=np.float32)
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())


def test_bad_fp8_option(tmp_path):
    with pytest.raises(ValueError, match="fp8='maybe': expected 'keep' or 'dequantize'"):
        load_hf(str(tmp_path), fp8="maybe")


def test_load_pretrained_and_the_cli_take_the_fp8_option(tmp_path, capsys):
    """Hugging Face and Orbax folders: FP8 kept by default, dequantized on request; `convert`
    keeps FP8 into Orbax; `mtpjax generate` offers --fp8."""
    from mtpjax import Fp8Weight
    from mtpjax.checkpoint import convert, load_pretrained
    from mtpjax.cli import main
    cfg, _, _, expected = make_fp8(tmp_path, 24)
    hf = str(tmp_path / "fp8")
    assert isinstance(load_pretrained(hf).params["layers"][0]["wq"], Fp8Weight)
    _assert_dequantized(load_pretrained(hf, fp8="dequantize").params, cfg, expected)
    convert(hf, str(tmp_path / "orbax"))
    kept = load_pretrained(str(tmp_path / "orbax"))
    assert isinstance(kept.params["layers"][0]["wq"], Fp8Weight)
    plain = load_pretrained(str(tmp_path / "orbax"), fp8="dequantize").params
    assert not any(isinstance(x, Fp8Weight) for x in jax.tree.leaves(
        plain, is_leaf=lambda x: isinstance(x, Fp8Weight)))
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "--fp8 {keep,dequantize}" in capsys.readouterr().out
