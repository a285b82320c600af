"""Every conversion error, produced by a damaged checkpoint: the message names the tensor (or the
file / config key), and nothing is written at the destination (nor left beside it)."""

import json
import os
import shutil

import numpy as np
import pytest

from mtpjax.checkpoint import CheckpointError, convert, export_hf
from mtpjax.cli import main
from tests.conftest import random_params, tiny_config

safetensors_numpy = pytest.importorskip("safetensors.numpy")

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A sharded llama checkpoint with one DeepSeek-layout MTP module."""
    cfg = tiny_config(num_mtp_layers=1)
    params = random_params(cfg)
    path = tmp_path_factory.mktemp("pristine") / "hf"
    export_hf(str(path), params, cfg, max_shard_size="16KB")
    return path


def _shard_of(src, name):
    return json.loads((src / INDEX).read_text())["weight_map"][name]


def _rewrite(src, shard, fn):
    """Rewrites one shard with the safetensors library: fn(dict of tensors) edits it in place."""
    tensors = safetensors_numpy.load_file(str(src / shard))
    fn(tensors)
    safetensors_numpy.save_file(tensors, str(src / shard), metadata={"format": "pt"})


def _index_edit(src, fn):
    index = json.loads((src / INDEX).read_text())
    fn(index["weight_map"])
    (src / INDEX).write_text(json.dumps(index))


def missing(src):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(src, _shard_of(src, name), lambda t: t.pop(name))
    _index_edit(src, lambda m: m.pop(name))


def unexpected(src):
    shard = _shard_of(src, "model.norm.weight")
    _rewrite(src, shard, lambda t: t.update({"model.layers.0.self_attn.mystery.weight":
                                             np.zeros((4, 4), np.float32)}))
    _index_edit(src, lambda m: m.update({"model.layers.0.self_attn.mystery.weight": shard}))


def wrong_shape(src):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(src, _shard_of(src, name), lambda t: t.update({name: np.zeros((5, 32), np.float32)}))


def wrong_dtype(src):
    name = "model.layers.2.enorm.weight"
    _rewrite(src, _shard_of(src, name), lambda t: t.update({name: np.ones(32, np.int32)}))


def duplicate(src):
    name = "model.layers.0.input_layernorm.weight"
    home = _shard_of(src, name)
    other = next(f for f in sorted(os.listdir(src)) if f.endswith(".safetensors") and f != home)
    value = safetensors_numpy.load_file(str(src / home))[name]
    _rewrite(src, other, lambda t: t.update({name: value}))


def truncated(src):
    shard = _shard_of(src, "model.layers.1.mlp.down_proj.weight")
    data = (src / shard).read_bytes()
    (src / shard).write_bytes(data[:-100])


def model_type(src):
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))


def lost_shard(src):
    os.remove(src / _shard_of(src, "model.layers.1.mlp.down_proj.weight"))


def unlisted(src):
    _index_edit(src, lambda m: m.pop("model.layers.0.mlp.up_proj.weight"))


CASES = {
    missing: r"missing tensors:\n    model\.layers\.1\.mlp\.up_proj\.weight \(-> layers/w_up\[1\]\)",
    unexpected: r"unexpected tensors:\n    model\.layers\.0\.self_attn\.mystery\.weight",
    wrong_shape: r"wrong shape:\n    model\.layers\.0\.self_attn\.q_proj\.weight: shape \[5, 32\], "
                 r"expected \[32, 32\] \(-> layers/wq\[0\]\)",
    wrong_dtype: r"wrong dtype:\n    model\.layers\.2\.enorm\.weight: dtype I32",
    duplicate: r"tensor model\.layers\.0\.input_layernorm\.weight is stored twice: in "
               r"model-\d+-of-\d+\.safetensors and in model-\d+-of-\d+\.safetensors",
    truncated: r"model-\d+-of-\d+\.safetensors: truncated file: tensor \S+ ends at byte",
    model_type: r"config\.json: model_type 'gpt_neox' is not supported",
    lost_shard: r"shard model-\d+-of-\d+\.safetensors \(holding \S+ in "
                r"model\.safetensors\.index\.json\) is missing",
    unlisted: r"tensor model\.layers\.0\.mlp\.up_proj\.weight is in model-\d+-of-\d+\.safetensors "
              r"but not in model\.safetensors\.index\.json",
}


@pytest.mark.parametrize("damage", list(CASES), ids=lambda f: f.__name__)
def test_damaged_checkpoint_names_the_tensor_and_writes_nothing(tmp_path, pristine, damage):
    src = tmp_path / "src"
    shutil.copytree(pristine, src)
    damage(src)
    dst = tmp_path / "out"
    with pytest.raises(CheckpointError, match=CASES[damage]):
        convert(str(src), str(dst))
    assert sorted(os.listdir(tmp_path)) == ["src"]          # no out/, no half-written temp


def test_pristine_checkpoint_converts(tmp_path, pristine):
    summary = convert(str(pristine), str(tmp_path / "out"))
    assert summary.num_mtp_layers == 1 and summary.mtp_layout == "deepseek"
    assert os.path.isdir(tmp_path / "out" / "params")


def test_cli_reports_the_error_and_writes_nothing(tmp_path, pristine, capsys):
    src = tmp_path / "src"
    shutil.copytree(pristine, src)
    wrong_shape(src)
    assert main(["convert", str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "model.layers.0.self_attn.q_proj.weight: shape [5, 32]" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_failure_while_writing_leaves_nothing(tmp_path, pristine, monkeypatch):
    """An error after output has started (here: in the Orbax writer) removes the partial folder."""
    import orbax.checkpoint as ocp

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        convert(str(pristine), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


def test_existing_output_is_refused(tmp_path, pristine):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists"):
        convert(str(pristine), str(tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
