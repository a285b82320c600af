"""The DP-attention layout (mtpjax/parallel/dp_attention.py, docs/parallel.md "DP attention"):
attention per device over its own requests and latent pages, routed experts split over the
same devices (all-gather tokens -> own experts -> reduce-scatter).

The mesh cases run in one subprocess with 4 fake CPU devices (tests/dp_attention_cases.py),
the same mechanism as tests/parallel/test_parallel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from mtpjax.parallel import make_mesh
from mtpjax.parallel.dp_attention import check_dp_attention, param_partition_specs
from tests.conftest import tiny_config, tiny_mla_moe_config
from tests.parallel.test_parallel import HERE, _cli, _env, slow


@pytest.fixture(scope="module")
def cases():
    out = subprocess.run([sys.executable, os.path.join(HERE, "dp_attention_cases.py"), "all"],
                         capture_output=True, text=True, env=_env(4), timeout=900)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_layout_is_refused_where_it_does_not_apply():
    mesh = make_mesh()
    with pytest.raises(ValueError, match="needs a mesh"):
        check_dp_attention(tiny_mla_moe_config(), None)
    with pytest.raises(ValueError, match=r"MLA \+ MoE.*attention_kind='gqa', ffn_kind='dense'"):
        check_dp_attention(tiny_config(), mesh)
    with pytest.raises(ValueError, match="attention_kind='mla', ffn_kind='dense'"):
        check_dp_attention(tiny_mla_moe_config(moe=False), mesh)
    assert check_dp_attention(tiny_mla_moe_config(), mesh, num_requests=3) == 1
    fake = type("FakeMesh", (), {"shape": {"data": 3, "model": 1}})()
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by data_parallel=3"):
        check_dp_attention(tiny_mla_moe_config(), fake)
    fake.shape = {"data": 2, "model": 1}
    with pytest.raises(ValueError, match="5 requests do not divide over data_parallel=2"):
        check_dp_attention(tiny_mla_moe_config(), fake, num_requests=5)
    fake.shape = {"data": 2, "model": 2}
    with pytest.raises(ValueError, match="model=2"):
        check_dp_attention(tiny_mla_moe_config(), fake)


def test_param_specs_split_only_the_routed_experts():
    import mtpjax
    cfg = tiny_mla_moe_config()
    params = mtpjax.init_params(cfg, jax.random.PRNGKey(0))
    fake = type("FakeMesh", (), {"shape": {"data": 4, "model": 1}})()
    specs = param_partition_specs(params, cfg, fake)
    flat = {jax.tree_util.keystr(p): s for p, s in
            jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(
                x, jax.sharding.PartitionSpec))[0]}
    split = sorted(k for k, s in flat.items() if tuple(s))
    experts = sorted(k for k in flat if k.endswith(("['w_gate']", "['w_up']", "['w_down']"))
                     and "experts" not in k and ("mtp" in k or "[1]" in k))
    assert split == experts and split, (split, experts)
    assert all(tuple(flat[k]) == ("data",) for k in split)


@pytest.mark.parametrize("d", [2, 4])
def test_moe_layer_equals_one_device_with_gather_and_scatter_only(cases, d):
    runs = [r for r in cases["moe"] if r["d"] == d]
    assert len(runs) == 3 and all(r["padding_rows"] > 0 for r in runs)
    for r in runs:
        assert r["max_err"] <= 1e-6 * r["scale"] + 1e-6, r
        N, n, E, k = d * r["n_local"], r["n_local"], r["E"], r["k"]
        # exactly: the tokens, their ids and weights gathered; the outputs scattered back.
        # No weight moves (a weight-sized collective would show here as another entry).
        assert sorted(r["collectives"]) == sorted([
            ["all-gather", f"f32[{N},{E}]{{1,0}}"], ["all-gather", f"f32[{N},{k}]{{1,0}}"],
            ["all-gather", f"s32[{N},{k}]{{1,0}}"], ["reduce-scatter", f"f32[{n},{E}]{{1,0}}"]])


def test_moe_layer_with_fp8_experts_equals_one_device(cases):
    r = cases["moe_fp8"]
    assert r["w_gate_specs"] == [["data"], ["data"]]       # values and scales split alike
    assert r["max_err"] <= 1e-5 * r["scale"] + 1e-5, r


def test_params_pages_and_rows_are_placed_by_the_layout(cases):
    got = cases["placement"]          # [global shape, one device's shape] on (4, 1)
    # routed experts split 4 ways (target layer and MTP block); attention and router whole
    assert got["w_gate"] == [[8, 32, 16], [2, 32, 16]]
    assert got["mtp_w_up"] == [[8, 32, 16], [2, 32, 16]]
    assert got["wkv_b"][0] == got["wkv_b"][1] and got["router"][0] == got["router"][1]
    # latent pages split by page (each device its own pool), per-request rows by row
    for leaf in ("pages", "mtp_pages", "seq_len", "hist_hidden", "draft_probs"):
        whole, local = got[leaf]
        assert local == [whole[0] // 4] + whole[1:], (leaf, got[leaf])


@pytest.mark.parametrize("run", ["plain d=2", "chain d=4"])
def test_generate_gives_the_tokens_and_statistics_of_one_device(cases, run):
    r = cases["generate"][run]
    assert r["equal"] and r["stats_equal"], r
    assert r["equal_plain"]                      # speculative decoding is exact (greedy rows)
    if run.startswith("chain"):                  # forced drafts were accepted: multi-token steps
        assert r["sampled_rows"] == 1            # a sampled row gave one device's tokens too
        assert r["stats"]["accepted_draft_tokens"] > 0
        assert sum(r["stats"]["num_accepted_histogram"][2:]) > 0


def test_generate_refuses_bad_batches_and_meshes(cases):
    errors = cases["generate"]["errors"]
    assert "3 requests do not divide over data_parallel=2" in errors["odd batch"]
    assert "num_pages=7 is not a multiple of data_parallel=2" in errors["odd pages"]
    assert "got model=2" in errors["tensor parallel"]


def test_unknown_layout_is_refused():
    import mtpjax
    with pytest.raises(ValueError, match=r"layout must be one of \(None, 'dp_attention'\), "
                                         r"got 'dp'"):
        mtpjax.generate(None, tiny_config(), [[1, 2]], max_new_tokens=1, layout="dp")


def test_bench_flag_is_its_own_mesh():
    from mtpjax.bench.e2e import layout_of, parse_args
    args = parse_args(["--model-shape", "tiny-mla-moe", "--dp-attention", "4"])
    assert layout_of(args) == "dp_attention"
    assert layout_of(parse_args(["--model-shape", "tiny-mla-moe"])) is None
    for bad in (["--tensor-parallel", "2"], ["--replicas", "2"], ["--data-parallel", "2"]):
        with pytest.raises(SystemExit):
            parse_args(["--model-shape", "tiny-mla-moe", "--dp-attention", "2", *bad])


def _moe_pass(d: int, n: int, E: int = 32, k: int = 2) -> list:
    """One DP-attention MoE pass over n tokens per device: tokens, ids, weights gathered,
    outputs scattered back."""
    N = d * n
    return [["all-gather", f"f32[{N},{E}]{{1,0}}"], ["all-gather", f"s32[{N},{k}]{{1,0}}"],
            ["all-gather", f"f32[{N},{k}]{{1,0}}"], ["reduce-scatter", f"f32[{n},{E}]{{1,0}}"]]


def test_decode_loop_has_only_the_moe_collectives_and_one_stop_check(cases):
    """The compiled decode loop: attention, dense layers, sampling and acceptance run per device
    with no collective; each MoE pass gathers and scatters its tokens; one all-reduce of the
    live count decides whether to stop."""
    stop = [["all-reduce", "s32[]"]]
    # plain, 2 devices x 4 rows: the target's one MoE layer over 4 tokens per device
    got = cases["generate"]["plain d=2"]["loop_collectives"]
    assert sorted(got) == sorted(_moe_pass(2, 4) + stop)
    # chain K=2, 4 devices x 2 rows: target layer over 2 x 3 verify tokens, the MTP block over
    # the 2 x 3 first-pass window, the MTP block again in the one later draft step (2 rows)
    got = cases["generate"]["chain d=4"]["loop_collectives"]
    assert sorted(got) == sorted(_moe_pass(4, 6) + _moe_pass(4, 6) + _moe_pass(4, 2) + stop)


@slow
def test_bench_e2e_dp_attention_runs_generate_rows(tmp_path):
    """`mtpjax bench e2e --dp-attention 2` on 2 fake CPU devices, tiny MLA + MoE shape: the
    generate rows run in the layout; the engine row says it is not built."""
    out = _cli(["bench", "e2e", "--model-shape", "tiny-mla-moe", "--batch", "2",
                "--prompt-len", "4", "--new-tokens", "8", "--k", "2", "--copy-mib", "4",
                "--repeats", "1", "--no-startup", "--rows", "generate plain,generate MTP,"
                "engine plain", "--dp-attention", "2", "--out", str(tmp_path)], devices=2)
    assert "DP attention on 2" in out.stdout
    rows = {r["row"]: r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]}
    for name in ("generate plain", "generate MTP K=2"):
        assert "error" not in rows[name] and rows[name]["steps"] > 0, rows[name]
    assert "not built for layout='dp_attention'" in rows["engine plain"]["error"]
