"""`python -m mtpjax.bench.moe` on the tiny shape (CPU): the gather form of the experts equals
the model's ragged_dot layer on random routing, every timed cell is finite, the table comes last."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtpjax.bench import moe


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_experts_equal_the_models_ragged_dot_layer(seed):
    shape = moe.SHAPES["tiny"]
    p = jax.tree.map(lambda w: w.astype(jnp.float32), moe.make_weights(shape, seed))
    ids, w = moe.make_routing(shape, 5, seed)
    assert all(len(set(r)) == shape["k"] for r in np.asarray(ids).tolist())
    x = jax.random.normal(jax.random.key(seed), (5, shape["hidden"]), jnp.float32)
    ref = moe.experts_ragged(x, p, ids, w)
    np.testing.assert_allclose(moe.experts_gather(x, p, ids, w), ref, rtol=1e-4, atol=1e-5)
    # and both are the per-token sum of weighted SwiGLU experts
    for n in range(5):
        want = sum(float(w[n, j]) * ((jax.nn.silu(x[n] @ p["w_gate"][e]) * (x[n] @ p["w_up"][e]))
                                     @ p["w_down"][e]) for j, e in enumerate(np.asarray(ids[n])))
        np.testing.assert_allclose(ref[n], want, rtol=1e-4, atol=1e-5)


def test_bench_moe_tiny_prints_finite_rows(capsys, tmp_path):
    # --calls 2: each variant compiled once, for a jit of two chained calls (the default 8
    # compiles a jit of 8 and one of 2 per variant; timeit's marginal method that needs them is
    # run by the default-calls tests below)
    assert moe.main(["--shapes", "tiny", "--tokens", "1,16", "--calls", "2", "--out",
                     str(tmp_path), "--variants",
                     "ragged_dot,tiled,pallas,pallas:16/32/16/2,pallas_ffn,pallas_ffn_sorted,"
                     "pallas_ffn:bm=16/bn=32/bk=32/s=2/st=2,pallas_tiles:bk=32/s=2/st=2,"
                     "pallas_fused:bn=32/bk=32/be=32,gather"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].startswith("| tiny | 16 |")
    assert "| pallas:16/32/16/2 us (x floor) |" in out
    rows = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 16]
    for r in rows:
        assert 1 <= r["touched"] <= moe.SHAPES["tiny"]["experts"]
        assert math.isfinite(r["ragged_dot_us"]) and r["ragged_dot_us"] > 0
        assert r["gather_err"] < 2e-2                       # bf16 weights, vs ragged_dot
        for v in ("tiled", "pallas", "pallas:16/32/16/2", "pallas_ffn", "pallas_ffn_sorted",
                  "pallas_ffn:bm=16/bn=32/bk=32/s=2/st=2", "pallas_tiles:bk=32/s=2/st=2"):
            assert r[f"{v}_err"] < 2e-2, v
    v = "pallas_fused:bn=32/bk=32/be=32"           # at most eight tokens (pallas_ffn at 1: the
    assert rows[0][f"{v}_err"] < 2e-2                # same kernel with default blocks)
    assert "pallas_fused takes at most 8 tokens, got 16" in rows[1][f"{v}_error"]


def test_shared_expert_rows_compare_the_kernel_with_xla(capsys, tmp_path):
    """fused_shared / fused_shared_xla: the routed and shared experts with the shared ones in
    the fused kernel or in XLA: equal outputs (bf16 weights; the kernel rounds once at the
    end, XLA the routed and shared sums apart), a floor with the shared bytes, and a named
    error past the fused kernel's token limit. Padded to 2 rows at one token, as `generate`."""
    assert moe.main(["--shapes", "tiny", "--tokens", "1,16", "--calls", "2", "--pad-to", "2",
                     "--out", str(tmp_path), "--variants",
                     "ragged_dot,fused_shared,fused_shared_xla"]) == 0
    assert "| fused_shared us (x floor) | fused_shared_xla us (x floor) |" in \
        capsys.readouterr().out
    one, many = json.loads((tmp_path / "moe.json").read_text())["rows"]
    assert one["floor_shared_us"] > one["floor_us"]
    assert one["fused_shared_err"] == 0.0 and one["fused_shared_xla_err"] < 2e-2
    assert one["fused_shared_x_floor"] == pytest.approx(one["fused_shared_us"]
                                                        / one["floor_shared_us"])
    assert "16 tokens: past the fused kernel's limit" in many["fused_shared_error"]


def test_ncu_targets_of_the_moe_layer_run_and_bad_names_are_refused(capsys):
    """kernel_sweep's Nsight Compute targets for the MoE layer (the model's grouped SwiGLU and
    the three-call form) run one call each (interpreted here); an unknown target is named."""
    from mtpjax.bench import kernel_sweep
    assert kernel_sweep.ncu_target("moe:3:tiny,moe3:3:tiny") == 0
    out = capsys.readouterr().out
    assert "ncu target moe:3:tiny" in out and "ncu target moe3:3:tiny" in out
    with pytest.raises(ValueError, match="unknown ncu target 'mlx:16'"):
        kernel_sweep.ncu_target("mlx:16")


def test_ffn_tuning_parses_and_names_a_bad_key():
    assert moe.parse_ffn_tuning("bm=128/bn=64/w=8/dbn=128/ds=2/st=4") == dict(
        block_m=128, num_stages=4, gate_up_blocks=(64, None, None, 8),
        down_blocks=(128, None, 2, None))
    assert moe.parse_ffn_tuning("mg=1/bt=1") == dict(kernel="mosaic", band_tiles=1,
                                                     gate_up_blocks=(None,) * 4,
                                                     down_blocks=(None,) * 4)
    with pytest.raises(ValueError, match="'warps=8': expected KEY=INT"):
        moe.parse_ffn_tuning("bm=64/warps=8")
    with pytest.raises(ValueError, match="'pallas_tiles:bm=16/s=2': expert tiles take no bm"):
        moe.pallas_variants(["pallas_tiles:bm=16/s=2"])
    assert moe.parse_fused_tuning("bn=32/bk=256/w=8") == dict(block_n=32, block_k=256,
                                                               num_warps=8)
    with pytest.raises(ValueError, match="'s=2': expected KEY=INT with KEY in"):
        moe.parse_fused_tuning("bn=32/s=2")


def test_padded_batch_gives_the_real_tokens_rows(capsys):
    """--pad-to: the engine's padded step; padding rows routed nowhere change nothing for the
    real tokens (each variant agrees with ragged_dot) and the table names the padding."""
    rows = moe.run(["tiny"], [3], use=("ragged_dot", "pallas_ffn", "gather"), pad_to=8)
    assert "| tiny | 3 of 8 |" in capsys.readouterr().out
    for r in rows:
        assert r["padded_to"] == 8 and "gather_us" not in r
        assert r["pallas_ffn_err"] < 2e-2
    ids, w = moe.make_routing(moe.SHAPES["tiny"], 3, seed=0)
    pids, pw = moe.pad_routing(moe.SHAPES["tiny"], ids, w, 8)
    assert pids.shape == (8, 2) and np.all(np.asarray(pids[3:]) == moe.SHAPES["tiny"]["experts"])
    assert np.all(np.asarray(pw[3:]) == 0)


def test_independent_calls_time_the_same_layer(capsys):
    """--independent (the older timing method) times the same layer as the
    default chained calls: finite times, the same outputs."""
    chained = moe.run(["tiny"], [3], use=("ragged_dot", "pallas_ffn"))
    independent = moe.run(["tiny"], [3], use=("ragged_dot", "pallas_ffn"), independent=True)
    for r in chained + independent:
        assert math.isfinite(r["pallas_ffn_us"]) and r["pallas_ffn_us"] > 0
        assert r["pallas_ffn_err"] < 2e-2
    assert moe.main(["--shapes", "tiny", "--tokens", "2", "--variants", "ragged_dot",
                     "--independent"]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("| tiny | 2 |")


def test_gemv_peer_rows_have_the_experts_bytes_and_bad_shapes_are_named():
    """bench.gemv_peer (the one-token layer's GPU-time peer) on the tiny shape: one row per
    matrix with the k experts' bytes and a positive time; an unknown shape is refused."""
    from mtpjax.bench import gemv_peer
    s = moe.SHAPES["tiny"]
    rows = gemv_peer.gemv_rows("tiny", repeats=2)
    assert [r["matrix"] for r in rows] == ["gate/up", "down"]
    want_mb = [s["k"] * s["hidden"] * 2 * s["width"] * 2 / 1e6,
               s["k"] * s["width"] * s["hidden"] * 2 / 1e6]
    assert [r["MB"] for r in rows] == pytest.approx(want_mb)
    assert all(math.isfinite(r["us"]) and r["us"] > 0 for r in rows)
    with pytest.raises(SystemExit, match="--shapes takes .* got \\['v9'\\]"):
        gemv_peer.main(["--shapes", "v9"])


def test_timeline_off_the_gpu_keeps_the_wall_clock_rows(capsys):
    """--timeline reads the kernels' timestamps; off the GPU there are none, so the rows keep
    only the wall-clock columns (and the run does not fail). A row with GPU figures shows
    both."""
    from mtpjax.bench.kernels import chained_gpu_time
    assert chained_gpu_time(lambda q, w: q @ w, [jnp.ones((4, 4))] * 8,
                            (jnp.eye(4),)) is None
    assert moe.main(["--shapes", "tiny", "--tokens", "1", "--variants", "ragged_dot",
                     "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "| tiny | 1 |" in out and "GPU" not in out.splitlines()[-1]
    row = {"shape": "v2-lite", "tokens": 1, "touched": 6, "floor_us": 35.0, "pallas_ffn_us": 70.0,
           "pallas_ffn_x_floor": 2.0, "pallas_ffn_gpu_us": 42.0, "pallas_ffn_gpu_kernels": 3.0}
    assert "| 70 (2.00x); GPU 42.0 (1.20x, 3 kernels) |" in moe.table([row])


def test_median_run_splits_runs_at_the_host_gaps():
    """chained_gpu_time's split of a trace into runs: three runs of kernels (2, 3 and 2) with
    small gaps inside and wide host gaps between; the median span's run is reported."""
    from mtpjax.bench.kernels import median_run
    us = 1000
    evs = [(0, 10 * us, "a"), (12 * us, 5 * us, "b"),                         # span 17
           (500 * us, 4 * us, "a"), (505 * us, 4 * us, "b"), (510 * us, 10 * us, "c"),  # 20
           (900 * us, 10 * us, "a"), (911 * us, 3 * us, "b")]                 # span 14
    assert median_run(evs, 3) == (17.0, 15.0, 2)
    assert median_run(evs[2:5], 1) == (20.0, 18.0, 3)


def test_kernel_streams_are_kept_whatever_else_ran_on_them():
    """The profiler names a stream by what ran on it; one that also copied device to device
    still runs kernels (its kernels were once dropped by a filter on "memcpy")."""
    from mtpjax.bench.kernels import is_compute_stream
    assert is_compute_stream("Stream #14(Compute)")
    assert is_compute_stream("Stream #14(Memset,Compute,MemcpyD2D)")
    assert is_compute_stream("Stream #7")
    assert not is_compute_stream("Stream #15(MemcpyH2D)")
    assert not is_compute_stream("XLA Ops")


def test_bench_moe_refuses_a_negative_call_count():
    with pytest.raises(ValueError, match="calls must be an int >= 0.*-1"):
        moe.run(["tiny"], [1], calls=-1)
