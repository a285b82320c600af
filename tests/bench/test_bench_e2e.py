"""`mtpjax bench e2e` end to end on the tiny shape (CPU): every row, finite numbers, the HF peer
skipped, the table last and e2e.json written."""

import json
import math

import numpy as np
import pytest

from mtpjax.cli import main


def test_bench_e2e_tiny_prints_every_row(capsys, tmp_path):
    rc = main(["bench", "e2e", "--model-shape", "tiny", "--batch", "1", "--prompt-len", "4",
               "--new-tokens", "64", "--k", "2", "--copy-mib", "4", "--repeats", "2",
               "--draft-vocab", "16",
               "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    lines = out[out.index("| row |"):].strip().splitlines()
    assert out.rstrip().endswith(lines[-1])                      # the table comes last
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        rows[cells["row"]] = cells
    timed = ["generate plain", "generate MTP K=2", "generate MTP K=2 draft vocab 16",
             "engine plain", "engine MTP K=2", "engine MTP K=2 draft vocab 16"]
    assert list(rows) == ["start-up cold (engine MTP K=2)", *timed, "HF Llama static+compile"]
    for name in timed:
        r = rows[name]
        values = [float(r[c]) for c in ("ms/step", "tok/s", "acc len", "floor ms", "% floor")]
        assert all(math.isfinite(v) and v > 0 for v in values), (name, r)
        assert r["batch"] == "1" and 1 <= float(r["acc len"]) <= 3
    assert float(rows["generate plain"]["acc len"]) == 1.0
    for api in ("generate", "engine"):          # the subset's draft passes read fewer bytes
        assert float(rows[f"{api} MTP K=2 draft vocab 16"]["floor ms"]) < float(
            rows[f"{api} MTP K=2"]["floor ms"])
    assert math.isfinite(float(rows["start-up cold (engine MTP K=2)"]["start-up s"]))
    hf = rows["HF Llama static+compile"]
    assert hf["ms/step"] == "" and "JAX runs on the CPU" in hf["note"]
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert [r["row"] for r in saved["rows"]] == list(rows)
    assert saved["copy_bandwidth_Bps"] > 0


def test_mla_moe_shape_bytes_and_rows(capsys, tmp_path):
    """The DeepSeek-V2-Lite shape's byte count comes from the parameter table: every parameter
    counted once (15.7B + one MTP module), a step reads only the experts its tokens touch, and
    the tiny MLA + MoE shape runs the decode rows end to end (HF peer skipped: llama only)."""
    from mtpjax.bench import e2e
    from mtpjax.model.params import param_specs, tree_items
    cfg = e2e.model_config("deepseek-v2-lite")
    w = e2e.weight_bytes(cfg)
    total = sum(int(math.prod(s.shape)) for _, s in tree_items(param_specs(cfg))) * 2
    counted = (w["target_layers"] + w["final_norm"] + w["lm_head"] + w["mtp_module"]
               + w["embed_table_not_counted"]
               + w["expert"] * 64 * (w["target_moe_layers"] + w["mtp_moe_layers"]))
    assert counted == total and 15.5e9 < total / 2 < 17.5e9
    assert (w["target_moe_layers"], w["mtp_moe_layers"]) == (26, 1)
    assert w["expert"] == 3 * 2048 * 1408 * 2
    assert 5.9 < e2e.touched_experts(cfg, 1) <= 6 and 63 < e2e.touched_experts(cfg, 128) <= 64
    b1, b32 = (e2e.step_bytes(w, cfg, b, 192.0, 3)["total"] for b in (1, 32))
    assert b1 < b32 < b1 + 26 * 64 * w["expert"] + 32 * 192 * 27 * 576 * 2 + 3 * 64 * w["expert"]
    # an adaptive-K row's floor: its steps' bytes averaged by the passes each ran
    rng = np.random.default_rng(4)
    for _ in range(3):
        used = {p: int(n) for p, n in enumerate(rng.integers(0, 50, 4)) if n}
        mixed = e2e.mixed_step_bytes(w, cfg, 1, 192.0, used)
        total = sum(used.values())
        for part in ("weights", "mtp_drafts", "kv", "total"):
            assert mixed[part] == pytest.approx(sum(
                n * e2e.step_bytes(w, cfg, 1, 192.0, p)[part] for p, n in used.items()) / total)
    assert e2e.mixed_step_bytes(w, cfg, 32, 192.0, {3: 7}) == pytest.approx(
        e2e.step_bytes(w, cfg, 32, 192.0, 3))
    with pytest.raises(ValueError, match="passes_used must count at least one step"):
        e2e.mixed_step_bytes(w, cfg, 1, 192.0, {})

    # 96 tokens and medians of 3: with 32 and one run, a loaded 2-core CI machine once timed
    # the prefill-only run longer than the full one (the row then reads "below the timing
    # noise")
    rc = e2e.main(["--model-shape", "tiny-mla-moe", "--batch", "1,2", "--prompt-len", "4",
                   "--new-tokens", "96", "--k", "2", "--copy-mib", "4", "--repeats", "3",
                   "--no-startup", "--rows", "generate MTP,engine plain,HF",
                   "--out", str(tmp_path)])
    assert rc == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    timed = [r for r in saved["rows"] if "ms_per_step" in r]
    assert len(timed) == 4 and all(math.isfinite(r["pct_floor"]) and r["pct_floor"] > 0
                                   for r in timed)
    assert any("llama shapes only" in r.get("skipped", "") for r in saved["rows"])


def test_engine_timing_skips_passes_that_compiled():
    """A timed pass that built a program is replaced; the median is of compile-free passes."""
    from mtpjax.bench.e2e import compile_free_median
    seq = iter([dict(ms_per_step=300.0, compiled=2), dict(ms_per_step=5.0, compiled=0),
                dict(ms_per_step=250.0, compiled=1), dict(ms_per_step=7.0, compiled=0),
                dict(ms_per_step=6.0, compiled=0)])
    best = compile_free_median(lambda: next(seq), repeats=3)
    assert best["runs_ms_per_step"] == [5.0, 7.0, 6.0]
    assert best["ms_per_step"] == 6.0 and best["passes_that_compiled"] == 2
    always = compile_free_median(lambda: dict(ms_per_step=100.0, compiled=1), repeats=2)
    assert always["ms_per_step"] == 100.0 and "every timed pass compiled (4" in always["note"]


def test_v3_slice_shape_is_v3_layers_at_one_gpu_depth():
    """The DeepSeek-V3 slice has V3's real layer dimensions (its experts, routing, MLA) at a
    depth one H200 holds: every parameter counted once, about 100 GB in bf16."""
    from mtpjax.bench import e2e
    from mtpjax.model.params import param_specs, tree_items
    cfg = e2e.model_config("deepseek-v3-slice")
    assert (cfg.num_heads, cfg.mla.q_lora_rank, cfg.mla.kv_lora_rank) == (128, 1536, 512)
    assert (cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok, cfg.moe.n_group,
            cfg.moe.topk_group, cfg.moe.routing) == (256, 8, 8, 4, "sigmoid_group_limited_bias")
    w = e2e.weight_bytes(cfg)
    total = sum(int(math.prod(s.shape)) for _, s in tree_items(param_specs(cfg))) * 2
    counted = (w["target_layers"] + w["final_norm"] + w["lm_head"] + w["mtp_module"]
               + w["embed_table_not_counted"]
               + w["expert"] * 256 * (w["target_moe_layers"] + w["mtp_moe_layers"]))
    assert counted == total and 90e9 < total < 110e9
    assert (w["target_moe_layers"], w["mtp_moe_layers"]) == (3, 1)


@pytest.mark.parametrize("shape", ["llama3-8b", "deepseek-v2-lite"])
def test_fp8_floor_counts_projections_at_one_byte(shape):
    """--fp8's floor: quantized projections at one byte plus float32 block scales, everything
    else (embedding, lm_head, norms, router) as in bf16."""
    from mtpjax.bench import e2e
    cfg = e2e.model_config(shape)
    bf16, fp8 = e2e.weight_bytes(cfg), e2e.weight_bytes(cfg, fp8=(128, 128))
    assert fp8["lm_head"] == bf16["lm_head"] and fp8["final_norm"] == bf16["final_norm"]
    assert 0.5 < fp8["target_layers"] / bf16["target_layers"] < 0.52
    if "expert" in bf16:
        assert 0.5 <= fp8["expert"] / bf16["expert"] < 0.51


def test_background_startup_row_times_first_token_and_all_buckets():
    """`--background-startup`'s row: a fresh process with LLM(warmup="background") reports the
    first token before every bucket is compiled, then all of them compiled."""
    from mtpjax.bench.e2e import _background_row, parse_args
    args = parse_args(["--model-shape", "tiny", "--batch", "1", "--prompt-len", "4",
                       "--new-tokens", "8", "--k", "1", "--background-startup"])
    r = _background_row(args, 1)
    assert r["warmup"] == "background" and r["all_buckets_done"] is True
    assert 1 <= r["buckets_at_first_token"] <= r["buckets"]
    assert 0 < r["construct_s"] <= r["startup_s"] <= r["all_buckets_s"]
    assert "first token after" in r["note"] and "every bucket compiled after" in r["note"]


def test_a_child_killed_at_its_limit_still_reports_its_last_result_line(tmp_path):
    """A background start prints its first token's result before waiting for the rest; a
    child stopped at --child-timeout after that line reports it instead of an error."""
    import sys
    from mtpjax.bench import e2e
    script = tmp_path / "child.py"
    script.write_text("import json, time\n"
                      "print('E2E_RESULT ' + json.dumps({'startup_s': 1.5, 'n': 1}), flush=True)\n"
                      "print('E2E_RESULT ' + json.dumps({'startup_s': 1.5, 'n': 2}), flush=True)\n"
                      "time.sleep(60)\n")
    args = e2e.parse_args(["--model-shape", "tiny", "--batch", "1", "--child-timeout", "3"])
    real = e2e.subprocess.run

    def run(cmd, **kw):
        return real([sys.executable, str(script)], **kw)
    e2e.subprocess.run = run
    try:
        r = e2e.run_child(args, "startup", 1)
    finally:
        e2e.subprocess.run = real
    assert r["n"] == 2 and r["killed_at_timeout"] is True and r["process_s"] >= 3
    assert e2e._last_result("no result here\n") is None


def test_verify_k_holds_a_k_draft_engine_below_k(tmp_path):
    """--verify-k N: each request of the engine MTP row verifies at most N of the engine's K
    drafts (acceptance length <= N + 1), the row says so, and host work / waiting are printed;
    an N outside 0..K is refused."""
    from mtpjax.bench import e2e
    rc = e2e.main(["--model-shape", "tiny-mla-moe", "--batch", "1", "--prompt-len", "4",
                   "--new-tokens", "24", "--k", "3", "--verify-k", "1", "--accept-rate", "1.0",
                   "--copy-mib", "4", "--repeats", "1", "--no-startup", "--rows", "engine MTP",
                   "--out", str(tmp_path)])
    assert rc == 0
    row = [r for r in json.loads((tmp_path / "e2e.json").read_text())["rows"]
           if "ms_per_step" in r][0]
    assert 1.5 < row["acc_len"] <= 2.0          # every draft accepted, one verified a step
    assert "verifies <= 1 of K=3" in row["note"] and "host " in row["note"]
    with pytest.raises(SystemExit):
        e2e.parse_args(["--model-shape", "tiny", "--k", "2", "--verify-k", "3"])


def test_adaptive_row_floor_averages_its_passes(tmp_path):
    """An adaptive-K engine row records the draft passes its steps ran, and its floor is the
    bytes of those steps (`mixed_step_bytes`), not those of K passes every step."""
    from mtpjax.bench import e2e
    rc = e2e.main(["--model-shape", "tiny-mla-moe", "--batch", "1", "--prompt-len", "4",
                   "--new-tokens", "24", "--k", "3", "--copy-mib", "4", "--repeats", "1",
                   "--no-startup", "--rows", "engine MTP", "--adaptive-k",
                   "--accept-rate", "0.3", "--out", str(tmp_path)])
    assert rc == 0
    saved = json.loads((tmp_path / "e2e.json").read_text())
    (row,) = [r for r in saved["rows"] if "ms_per_step" in r]
    used = {int(p): n for p, n in row["passes_used"].items()}
    assert sum(used.values()) > 0 and set(used) <= {0, 1, 2, 3}
    cfg = e2e.model_config("tiny-mla-moe")
    want = e2e.mixed_step_bytes(saved["weight_bytes"], cfg, 1, saved["mean_decode_context"],
                                used)
    assert row["bytes_per_step"]["total"] == pytest.approx(want["total"])
    assert row["floor_ms"] == pytest.approx(1e3 * want["total"] / saved["copy_bandwidth_Bps"])
