"""Damaged or malformed checkpoint inputs fail with a `CheckpointError` (a ValueError) that names
the file, the tensor or field, and what was expected; none loads silently with wrong weights.

Everything here is header / JSON work on tiny folders (no model is compiled)."""

import json
import math
import os
import re
import shutil
import struct

import numpy as np
import pytest

from mtpjax import ModelConfig
from mtpjax.checkpoint import CheckpointError, export_hf, load_hf, load_pretrained
from mtpjax.checkpoint.bundle import Assets, flat_items
from mtpjax.checkpoint.hf_load import read_hf_config
from mtpjax.checkpoint.orbax_io import FORMAT, FORMAT_FILE, read_meta
from mtpjax.checkpoint.safetensors_io import read_header, read_tensor
from mtpjax.config import RopeScaling
from mtpjax.model.params import param_specs
from tests.conftest import random_params, replace_fields, tiny_config

INDEX = "model.safetensors.index.json"


def ds_config(**overrides) -> ModelConfig:
    """A tiny DeepSeek-V3 (MLA + MoE), as in test_deepseek.py."""
    base = ModelConfig(
        model_type="deepseek_v3", vocab_size=96, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=4, attention_kind="mla",
        mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=12, rope_interleave=True),
        ffn_kind="moe",
        moe=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
                 routed_scaling_factor=2.5, norm_topk_prob=True),
        num_mtp_layers=1)
    return replace_fields(base, **overrides)


def _library_rejects(file) -> bool:
    """Whether the reference `safetensors` library refuses the file (skips without it)."""
    safetensors = pytest.importorskip("safetensors")
    try:
        with safetensors.safe_open(str(file), "np") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:
        return True
    return False


# ---- safetensors headers -------------------------------------------------------------------------

A = np.arange(4, dtype=np.float32).reshape(2, 2)
B = np.arange(4, 8, dtype=np.float32)
C = np.array([8, -9], np.int8)
DATA = A.tobytes() + B.tobytes() + C.tobytes()
ENTRIES = [("__metadata__", {"format": "pt"}),
           ("a", {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}),
           ("b", {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}),
           ("c", {"dtype": "I8", "shape": [2], "data_offsets": [32, 34]})]


def _write(path, entries=ENTRIES, data=DATA, raw=None):
    """A safetensors file from (name, entry) pairs, which may repeat a name (a dict cannot)."""
    if raw is None:
        raw = "{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries) + "}"
    raw = raw.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _edit(name, **fields):
    return lambda entries, data: ([(k, {**v, **fields} if k == name else v) for k, v in entries],
                                  data)


def _header(raw):
    return lambda entries, data: (raw, data)


DAMAGED = {   # id: (damage(entries, data) -> (entries or raw header, data), message after "file: ")
    "overlap": (_edit("b", data_offsets=[0, 16]),
                r"damaged safetensors header: tensor b: data_offsets \[0, 16\] overlap tensor "
                r"a's \[0, 16\] \(expected it to start at 16, where a ends\)"),
    "negative_offset": (_edit("b", data_offsets=[-16, 0]),
                        r"tensor b: data_offsets must be two ints >= 0 \[begin, end\], got "
                        r"\[-16, 0\]"),
    "named_twice": (lambda e, d: (e + [("b", ENTRIES[1][1])], d),
                    r"tensor b appears twice \(expected each name once\)"),
    "named_twice_same_entry": (lambda e, d: (e + [("b", ENTRIES[2][1])], d),
                               r"tensor b appears twice"),
    "gap": (lambda e, d: ([x for x in e if x[0] != "b"], d),
            r"tensor c: data_offsets \[32, 34\] leave bytes \[16, 32\) of the data unused "
            r"\(after tensor a; expected the tensors to cover the data without gaps\)"),
    "gap_at_start": (lambda e, d: ([(k, {**v, "data_offsets": [o + 8 for o in v["data_offsets"]]}
                                     if k != "__metadata__" else v) for k, v in e],
                                   bytes(8) + d),
                     r"tensor a: data_offsets \[8, 24\] leave bytes \[0, 8\) of the data unused "
                     r"\(at the start of the data"),
    "trailing_bytes": (lambda e, d: (e, d + bytes(8)),
                       r"damaged safetensors file: 8 bytes after the end of the last tensor, c, "
                       r"at byte \d+ \(expected the tensors to end at the end of the file"),
    "wrong_byte_count": (_edit("b", shape=[3]),
                         r"tensor b has 16 bytes for F32 \[3\], expected 12"),
    "end_before_begin": (_edit("b", data_offsets=[32, 16]),
                         r"tensor b: data_offsets \[32, 16\] end before they begin"),
    "float_offsets": (_edit("b", data_offsets=[16.0, 32.0]),
                      r"tensor b: data_offsets must be two ints >= 0 \[begin, end\], got "
                      r"\[16\.0, 32\.0\]"),
    "three_offsets": (_edit("b", data_offsets=[16, 32, 48]),
                      r"tensor b: data_offsets must be two ints"),
    "unknown_dtype": (_edit("c", dtype="I4"),
                      r"tensor c: dtype \"I4\" is not a safetensors dtype \(one of BOOL, "),
    "negative_shape": (_edit("b", shape=[-4]),
                       r"tensor b: shape must be a list of ints >= 0, got \[-4\]"),
    "sub_byte": (_edit("c", dtype="F4", shape=[3]),
                 r"tensor c: F4 \[3\] is 12 bits, not whole bytes"),
    "metadata_not_strings": (lambda e, d: ([("__metadata__", {"format": 1})] + e[1:], d),
                             r"__metadata__ must map names to strings \(each once\), got "
                             r"\{\"format\": 1\}"),
    "field_twice": (_header('{"a": {"dtype": "F32", "dtype": "F32", "shape": [2, 2], '
                            '"data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [4], '
                            '"data_offsets": [16, 32]}, "c": {"dtype": "I8", "shape": [2], '
                            '"data_offsets": [32, 34]}}'),
                    r"tensor a: field dtype appears twice"),
    "entry_not_object": (lambda e, d: (e[:2] + [("b", [16, 32])] + e[3:], d),
                         r"tensor b: expected an object with dtype, shape and data_offsets, "
                         r"got \[16, 32\]"),
    "not_an_object": (_header("[]"),
                      r"unreadable safetensors header \(expected a JSON object of tensors, got a "
                      r"list\)"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_damaged_safetensors_header_names_the_file_and_tensor(tmp_path, case):
    damage, message = DAMAGED[case]
    got, data = damage(list(ENTRIES), DATA)
    file = tmp_path / "x.safetensors"
    if isinstance(got, str):
        _write(file, raw=got, data=data)
    else:
        _write(file, got, data)
    with pytest.raises(CheckpointError, match=re.escape(str(file)) + ": .*" + message):
        read_header(str(file))
    # the reference library refuses the same files, except a name given twice with one entry
    # (its JSON map keeps one of them; we refuse any header that names a tensor twice)
    assert _library_rejects(file) == (case != "named_twice_same_entry")


def test_header_length_over_the_format_limit(tmp_path):
    file = tmp_path / "x.safetensors"
    file.write_bytes(struct.pack("<Q", 2**40) + b"{}" + bytes(6))
    with pytest.raises(CheckpointError, match=re.escape(str(file)) + r": not a safetensors file, "
                       r"or a damaged one: its first 8 bytes give a header of 1099511627776 "
                       r"bytes, over the format's limit"):
        read_header(str(file))


def test_valid_headers_read_as_the_library_reads_them(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    mine = _write(tmp_path / "mine.safetensors")
    zero = np.zeros((0, 3), np.float32)
    theirs = tmp_path / "theirs.safetensors"
    safetensors_numpy.save_file({"a": A, "z": zero, "b": B, "c": C}, str(theirs),
                                metadata={"format": "pt"})
    for file, want in ((mine, {"a": A, "b": B, "c": C}),
                       (theirs, {"a": A, "b": B, "c": C, "z": zero})):
        infos = {i.name: i for i in read_header(str(file))}
        assert sorted(infos) == sorted(want)
        lib = safetensors_numpy.load_file(str(file))
        for name, value in want.items():
            got = read_tensor(infos[name])
            assert got.dtype == value.dtype and got.shape == value.shape
            np.testing.assert_array_equal(got, value)
            np.testing.assert_array_equal(got, lib[name])
    empty = _write(tmp_path / "empty.safetensors", [("__metadata__", {"format": "pt"})], b"")
    assert read_header(str(empty)) == [] and not _library_rejects(empty)
    null_meta = _write(tmp_path / "null_meta.safetensors", [("__metadata__", None)] + ENTRIES[1:])
    assert len(read_header(str(null_meta))) == 3 and not _library_rejects(null_meta)


# ---- a tiny Hugging Face folder ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A llama folder without MTP modules (one model.safetensors)."""
    cfg = tiny_config(num_mtp_layers=0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    export_hf(str(path), random_params(cfg), cfg)
    return path


@pytest.fixture
def folder(tmp_path, hf_folder):
    """A fresh copy of `hf_folder` to damage."""
    return shutil.copytree(hf_folder, tmp_path / "llama")


def _rewrite_header(file, edit):
    """edit(header dict) -> header JSON text, keeping the data section as it was."""
    b = file.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    raw = edit(json.loads(b[8:8 + n])).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n:])


def test_load_hf_refuses_a_tensor_pointing_at_another_tensors_bytes(folder):
    """A checkpoint whose up_proj points at gate_proj's bytes loaded as if nothing were wrong."""
    up, gate = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"

    def overlap(h):
        h[up]["data_offsets"] = list(h[gate]["data_offsets"])
        return json.dumps(h)
    _rewrite_header(folder / "model.safetensors", overlap)
    with pytest.raises(CheckpointError, match=re.escape(str(folder / "model.safetensors"))
                       + r": damaged safetensors header: tensor " + re.escape(up)
                       + r": data_offsets \[\d+, \d+\] overlap tensor " + re.escape(gate)):
        load_hf(str(folder))


# ---- model.safetensors.index.json ----------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory):
    cfg = tiny_config(num_mtp_layers=0)
    path = tmp_path_factory.mktemp("hf") / "sharded"
    export_hf(str(path), random_params(cfg), cfg, max_shard_size="16KB")
    return path


INDEX_DAMAGE = {
    "not_json": ("{weight_map", r"not valid JSON"),
    "a_list": ("[]", r"expected a JSON object with a weight_map, got a list"),
    "no_weight_map": ('{"metadata": {}}', r"no weight_map \(expected \{\"weight_map\": "),
    "weight_map_a_list": ('{"weight_map": ["model.norm.weight"]}',
                          r"weight_map must be an object \{tensor name: shard file name\}, got "
                          r"\[\"model.norm.weight\"\]"),
    "shard_not_a_name": ('{"weight_map": {"model.norm.weight": 3}}',
                         r"weight_map\['model.norm.weight'\] must be the file name of a shard in "
                         r"this folder, got 3"),
    "shard_outside": ('{"weight_map": {"model.norm.weight": "../model.safetensors"}}',
                      r"weight_map\['model.norm.weight'\] must be the file name of a shard in "
                      r"this folder, got \"../model.safetensors\""),
}


@pytest.mark.parametrize("case", list(INDEX_DAMAGE))
def test_malformed_index_names_the_file(tmp_path, sharded_folder, case):
    text, message = INDEX_DAMAGE[case]
    src = shutil.copytree(sharded_folder, tmp_path / "src")
    (src / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(str(src / INDEX)) + ": " + message):
        load_hf(str(src))


# ---- config.json ---------------------------------------------------------------------------------

CONFIG_DAMAGE = {   # field: (value written, message after "config.json: ")
    "num_hidden_layers": ("2", r"num_hidden_layers must be a positive int, got '2'"),
    "rms_norm_eps": ("1e-6", r"rms_norm_eps must be a finite number, got '1e-6'"),
    "rope_theta": ("1e4", r"rope_theta must be a finite number, got '1e4'"),
    "num_nextn_predict_layers": ("one", r"num_nextn_predict_layers must be an int >= 0, got "
                                        r"'one'"),
    "tie_word_embeddings": ("false", r"tie_word_embeddings must be true or false, got 'false'"),
    "rope_scaling": ("yarn", r"rope_scaling must be an object \(or null\), got 'yarn'"),
    "num_attention_heads": (None, r"num_attention_heads is null; expected a positive int"),
}


@pytest.mark.parametrize("field", list(CONFIG_DAMAGE))
def test_config_json_value_of_the_wrong_type_names_the_field(folder, field):
    value, message = CONFIG_DAMAGE[field]
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(CheckpointError, match=re.escape(str(folder / "config.json")) + ": "
                       + message):
        load_hf(str(folder))


def test_config_json_missing_and_infinite_values(folder):
    cfg = json.loads((folder / "config.json").read_text())
    file = str(folder / "config.json")
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(file)
                       + r": hidden_size is missing; expected a positive int"):
        read_hf_config(str(folder))
    cfg["hidden_size"] = 32
    cfg["rope_theta"] = math.inf              # json writes Infinity, which Python reads back
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=re.escape(file)
                       + r": rope_theta must be a finite number, got inf"):
        read_hf_config(str(folder))


@pytest.mark.parametrize("field, value, message", [
    ("routed_scaling_factor", "2.5", r"routed_scaling_factor must be a finite number, got '2\.5'"),
    ("norm_topk_prob", "false", r"norm_topk_prob must be true or false, got 'false'"),
    ("kv_lora_rank", "16", r"kv_lora_rank must be a positive int, got '16'"),
    ("n_routed_experts", 8.0, r"n_routed_experts must be an int >= 0, got 8\.0"),
])
def test_deepseek_config_value_of_the_wrong_type_names_the_field(field, value, message):
    from mtpjax.checkpoint.hf_export import hf_config_dict
    d = hf_config_dict(ds_config(num_mtp_layers=0))
    assert ModelConfig.from_hf(d) == ds_config(num_mtp_layers=0)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf({**d, field: value})


@pytest.mark.parametrize("make, message", [
    (lambda: tiny_config(rope_theta=math.inf), r"rope_theta must be a finite number > 0, got inf"),
    (lambda: tiny_config(rope_theta="1e4"), r"rope_theta must be a finite number > 0, got '1e4'"),
    (lambda: tiny_config(rms_norm_eps=math.nan), r"rms_norm_eps must be a finite number > 0"),
    (lambda: tiny_config(qkv_bias="no"), r"qkv_bias must be True or False, got 'no'"),
    (lambda: ds_config(routed_scaling_factor=math.inf), r"routed_scaling_factor must be a finite"),
    (lambda: RopeScaling("yarn", factor=math.inf), r"rope_scaling factor must be a finite number"),
    (lambda: RopeScaling("yarn", factor=4.0, beta_fast="32"),
     r"rope_scaling beta_fast must be a finite number, got '32'"),
])
def test_model_config_refuses_non_finite_and_mistyped_numbers(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- mtpjax_checkpoint.json (Orbax folders) ------------------------------------------------------

def _meta(cfg):
    return {"format": FORMAT, "version": 1, "model_config": cfg.to_dict(),
            "dtypes": {p: "float32" for p, _ in flat_items(param_specs(cfg))}}


def _edited(key, value):
    def edit(meta):
        target = meta["model_config"] if key.startswith("model_config.") else meta
        k = key.split(".", 1)[-1]
        if value is KeyError:
            del target[k]
        else:
            target[k] = value
        return json.dumps(meta)
    return edit


META_DAMAGE = {
    "not_json": (lambda m: json.dumps(m)[:-10], r"not valid JSON"),
    "a_list": (lambda m: "[]", r"expected a JSON object with format, version, model_config and "
                               r"dtypes, got a list"),
    "no_model_config": (_edited("model_config", KeyError),
                        r"model_config must be an object of ModelConfig fields, got null"),
    "string_size": (_edited("model_config.hidden_size", "32"),
                    r"model_config: hidden_size must be a positive int, got '32'"),
    "string_flag": (_edited("model_config.qkv_bias", "no"),
                    r"model_config: qkv_bias must be True or False, got 'no'"),
    "infinite_theta": (_edited("model_config.rope_theta", math.inf),
                       r"model_config: rope_theta must be a finite number > 0, got inf"),
    "unknown_key": (_edited("model_config.hiden_size", 32),
                    r"model_config: unknown ModelConfig keys: \['hiden_size'\]"),
    "unknown_rope_key": (_edited("model_config.rope_scaling", {"rope_type": "yarn", "factr": 2}),
                         r"model_config: unknown rope_scaling keys: \['factr'\]"),
    "stray_moe": (_edited("model_config.moe", {"n_routed_experts": 8, "num_experts_per_tok": 2,
                                               "moe_intermediate_size": 16}),
                  r"model_config: moe is set but ffn_kind is 'dense'"),
    "no_dtypes": (_edited("dtypes", KeyError), r"dtypes must be an object \{param path: dtype "
                                               r"name\}, got null"),
    "dtype_missing": (lambda m: json.dumps({**m, "dtypes": {}}),
                      r"dtypes has no entry for param embed \(expected one per param"),
    "dtype_bad": (lambda m: json.dumps({**m, "dtypes": {**m["dtypes"], "final_norm": "floaty"}}),
                  r"dtypes\['final_norm'\] is \"floaty\", expected a float dtype name"),
}


@pytest.mark.parametrize("case", list(META_DAMAGE))
def test_damaged_orbax_meta_names_the_file_and_field(tmp_path, case):
    damage, message = META_DAMAGE[case]
    path = tmp_path / "orbax"
    path.mkdir()
    (path / FORMAT_FILE).write_text(damage(_meta(tiny_config(num_mtp_layers=0))))
    with pytest.raises(CheckpointError, match=re.escape(str(path / FORMAT_FILE)) + ": "
                       + message):
        load_pretrained(str(path))


def test_valid_orbax_meta_reads(tmp_path):
    cfg = ds_config()
    (tmp_path / FORMAT_FILE).write_text(json.dumps(_meta(cfg)))
    assert read_meta(str(tmp_path))[1] == cfg


# The MLA / MoE fields of a model_config as mtpjax wrote them before the sub-configs: flat, at
# top level, every one of them whatever the layer kinds, the routing as DeepSeek's pair.
FLAT_DENSE_FIELDS = dict(
    q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=0, qk_rope_head_dim=0, v_head_dim=0,
    rope_interleave=False, n_routed_experts=0, num_experts_per_tok=0, n_shared_experts=0,
    moe_intermediate_size=0, first_k_dense_replace=0, n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="sigmoid",
    topk_method="noaux_tc")


def _flat(cfg, **fields):
    core = {k: v for k, v in cfg.to_dict().items() if k not in ("mla", "moe")}
    return {**core, **FLAT_DENSE_FIELDS, **fields}


@pytest.mark.parametrize("pair, routing", [
    (("sigmoid", "noaux_tc"), "sigmoid_group_limited_bias"),
    (("softmax", "greedy"), "softmax_greedy"),
    (("softmax", "group_limited_greedy"), "softmax_group_limited"),
])
def test_orbax_meta_in_the_flat_format_reads(tmp_path, pair, routing):
    """A checkpoint saved with the flat ModelConfig still loads: its fields go to the
    sub-configs, DeepSeek's (scoring_func, topk_method) to the routing kind it names."""
    want = ds_config(routing=routing, norm_topk_prob=pair[0] == "sigmoid")
    flat = _flat(want, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=12, rope_interleave=True, n_routed_experts=8, num_experts_per_tok=2,
                 n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1,
                 n_group=4, topk_group=2, routed_scaling_factor=2.5,
                 norm_topk_prob=pair[0] == "sigmoid", scoring_func=pair[0], topk_method=pair[1])
    (tmp_path / FORMAT_FILE).write_text(json.dumps({**_meta(want), "model_config": flat}))
    assert read_meta(str(tmp_path))[1] == want
    # a dense GQA model's flat dict held the defaults of every MLA / MoE field: they are dropped
    dense = tiny_config(num_mtp_layers=0)
    assert ModelConfig.from_dict(_flat(dense)) == dense
    # an MLA model with a dense FFN keeps only its MLA fields
    mla_dense = ds_config(ffn_kind="dense", moe=None)
    assert ModelConfig.from_dict(_flat(mla_dense, q_lora_rank=24, kv_lora_rank=16,
                                       qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                                       rope_interleave=True)) == mla_dense


def test_flat_format_with_an_unknown_routing_pair_names_it(tmp_path):
    flat = _flat(ds_config(), kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                 v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=16, scoring_func="softmax", topk_method="noaux_tc")
    (tmp_path / FORMAT_FILE).write_text(json.dumps({**_meta(ds_config()), "model_config": flat}))
    with pytest.raises(CheckpointError, match=r"model_config: scoring_func 'softmax' with "
                                              r"topk_method 'noaux_tc' names no MoE routing"):
        read_meta(str(tmp_path))


# ---- generation_config.json ----------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("{eos", r"not valid JSON"),
    ("[2]", r"expected a JSON object, got a list"),
    ('{"eos_token_id": "2"}', r"eos_token_id must be a token id \(an int >= 0\) or a list of "
                              r"them, got \"2\""),
    ('{"eos_token_id": [2, "x"]}', r"eos_token_id must be a token id .* got \[2, \"x\"\]"),
    ('{"eos_token_id": -1}', r"eos_token_id must be a token id"),
])
def test_bad_generation_config_names_the_file(folder, text, message):
    file = folder / "generation_config.json"
    file.write_text(text)
    with pytest.raises(CheckpointError, match=re.escape(str(file)) + ": " + message):
        load_hf(str(folder))
    with pytest.raises(CheckpointError, match=r"^generation_config\.json: " + message):
        Assets(None, {"generation_config.json": text.encode()}).eos_token_id()


def test_generation_config_eos_list_and_null():
    gen = lambda eos: {"generation_config.json": json.dumps({"eos_token_id": eos}).encode()}  # noqa: E731
    assert Assets({"eos_token_id": 9}, gen([5, 7])).eos_token_id() == 5
    assert Assets({"eos_token_id": 9}, gen(None)).eos_token_id() == 9
    assert Assets({"eos_token_id": [4, 9]}, gen([])).eos_token_id() == 4
    with pytest.raises(CheckpointError, match=r"config\.json: eos_token_id must be a token id"):
        Assets({"eos_token_id": "4"}).eos_token_id()


# ---- a config that declares MTP modules the files do not have ------------------------------------

def test_deepseek_saved_without_mtp_layers_says_how_to_load_it(tmp_path):
    """transformers' DeepseekV3 config keeps num_nextn_predict_layers = 1, but its save_pretrained
    writes no MTP layer: the error says what was found and that num_mtp_layers=0 loads it."""
    cfg = ds_config(num_mtp_layers=0)
    path = tmp_path / "ds"
    export_hf(str(path), random_params(cfg), cfg)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError) as e:
        load_hf(str(path))
    msg = str(e.value)
    assert "missing tensors:\n    model.layers.2." in msg
    assert ("The config declares 1 MTP module (num_mtp_layers; config.json's "
            "num_nextn_predict_layers), but the checkpoint has no MTP module's tensors (nothing "
            "under model.layers.2.*)") in msg
    assert ("To load it as a target model only (no speculative decoding), pass "
            "num_mtp_layers=0 (load_hf / load_pretrained(path, num_mtp_layers=0), `mtpjax "
            "generate --num-mtp-layers 0`) or set \"num_nextn_predict_layers\": 0") in msg
    assert load_hf(str(path), num_mtp_layers=0).cfg == cfg


def test_fewer_mtp_modules_than_declared_suggests_the_count_found(tmp_path):
    cfg = tiny_config(num_mtp_layers=1)
    path = tmp_path / "llama"
    export_hf(str(path), random_params(cfg), cfg)
    hf = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 3}))
    with pytest.raises(CheckpointError, match=r"(?s)the checkpoint has the tensors of MTP "
                       r"modules 0\.\.0 only \(nothing under model\.layers\.3\.\*, "
                       r"model\.layers\.4\.\*\).*To load it with its 1 MTP module, pass "
                       r"num_mtp_layers=1"):
        load_hf(str(path))


def test_a_partly_missing_mtp_module_is_damage_not_a_hint(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    cfg = tiny_config(num_mtp_layers=1)
    path = tmp_path / "llama"
    export_hf(str(path), random_params(cfg), cfg)
    tensors = safetensors_numpy.load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.eh_proj.weight"]
    safetensors_numpy.save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors:\n    "
                       r"model\.layers\.2\.eh_proj\.weight") as e:
        load_hf(str(path))
    assert "num_mtp_layers=" not in str(e.value)
