"""bench.step_profile: the trace summary on a synthetic device timeline, and the CLI on CPU."""

import gzip
import json

import pytest

import mtpjax
from mtpjax.bench import step_profile


def write_trace(folder, kernels, host=()):
    """kernels: (name, start_us, dur_us) on one GPU stream; host: (name, start, dur)."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    events += [{"ph": "X", "pid": 1, "tid": 7, "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    events += [{"ph": "X", "pid": 2, "tid": 1, "name": n, "ts": t, "dur": d} for n, t, d in host]
    (folder / "plugins").mkdir(parents=True)
    with gzip.open(folder / "plugins" / "x.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_summary_counts_steps_busy_time_and_the_gap(tmp_path, capsys):
    # 10 steps of 2 layers: per step gemm 30 us + paged_attn 10 us per layer, then a 200 us
    # gap (filled by a host launch) before every step
    kernels, host, t = [], [], 0.0
    for _ in range(10):
        host.append(("cuGraphLaunch", t + 5, 150))
        t += 200
        for _ in range(2):
            kernels += [("gemm_fusion", t, 30.0), ("paged_attn_bq8", t + 30, 10.0)]
            t += 40
    write_trace(tmp_path, kernels, host)
    r = step_profile.summarize(str(tmp_path), layers=2, name="generate")
    out = capsys.readouterr().out
    assert r["steps"] == 7                             # the decode window: the last 70%
    assert abs(r["busy_ms_per_step"] - 0.080) < 1e-9
    assert abs(r["per_kernel_us"]["gemm_fusion"] - 60.0) < 1e-9
    assert "gap 200 us" in out and "cuGraphLaunch" in out


def test_mla_steps_are_counted_by_the_mosaic_kernel(tmp_path):
    # DeepSeek's MLA layers on Hopper: the attention kernel is the Mosaic-GPU one
    kernels, t = [], 0.0
    for _ in range(10):
        for _ in range(3):
            kernels += [("gemm_fusion", t, 20.0), ("entry_mosaic_gpu_kernel", t + 20, 15.0),
                        ("one_token_expert_ffn", t + 35, 40.0)]
            t += 75
    write_trace(tmp_path, kernels)
    assert step_profile.summarize(str(tmp_path), layers=3, name="engine")["steps"] == 7


def test_no_gpu_trace_says_so(tmp_path, capsys):
    write_trace(tmp_path, [])
    assert step_profile.summarize(str(tmp_path), layers=2, name="engine")["per_kernel_us"] == {}
    assert "no device kernels" in capsys.readouterr().out


def test_cli_runs_on_cpu(tmp_path):
    import importlib
    gen = importlib.import_module("mtpjax.generate")
    shipped = gen._loop
    assert step_profile.main(["--model-shape", "tiny", "--layers", "2", "--new-tokens", "4",
                              "--k", "2", "--out", str(tmp_path)]) == 0
    assert [r["name"] for r in json.loads((tmp_path / "step_profile.json").read_text())] == \
        ["generate", "engine"]
    assert gen._loop is shipped               # the profiling loop is swapped back


def test_profiled_loop_has_no_loop_command_buffers():
    """The default profiling loop: the same function without the WHILE/CONDITIONAL command
    buffers (a profiler cannot see into a CUDA graph); --loop-graph keeps the shipped one."""
    import importlib
    from mtpjax.step_jit import LOOP_COMPILER_OPTIONS, compiler_options_of
    gen = importlib.import_module("mtpjax.generate")
    shipped = gen._loop
    restore = step_profile.profile_loop_kernel_by_kernel()
    try:
        assert gen._loop.__wrapped__ is shipped.__wrapped__
        assert not set(LOOP_COMPILER_OPTIONS) & set(compiler_options_of(gen._loop))
        assert set(LOOP_COMPILER_OPTIONS) <= set(compiler_options_of(shipped))
    finally:
        restore()
    assert gen._loop is shipped


def test_engine_paths_report_their_host_split(tmp_path, capsys, monkeypatch):
    """--paths engine-plain,engine-k0: a plain engine beside the MTP engine held at zero
    draft passes (requests asking num_speculative_tokens=0), each with its host split."""
    made = []
    real = mtpjax.LLM

    def spy(*args, **kwargs):
        made.append(kwargs["async_scheduling"])
        return real(*args, **kwargs)
    monkeypatch.setattr(mtpjax, "LLM", spy)
    assert step_profile.main(["--model-shape", "tiny", "--layers", "2", "--new-tokens", "6",
                              "--k", "2", "--paths", "engine-plain,engine-k0",
                              "--no-async-scheduling", "--out", str(tmp_path)]) == 0
    assert made == [False, False]
    reports = json.loads((tmp_path / "step_profile.json").read_text())
    assert [r["name"] for r in reports] == ["engine-plain", "engine-k0"]
    for r in reports:
        assert r["host_ms_per_step"] > 0 and r["wait_ms_per_step"] >= 0
        assert r["ms_per_step"] >= r["host_ms_per_step"] * 0.5
    assert set(reports[1]["passes_used"]) == {"0"}            # JSON keys: zero passes only
    out = capsys.readouterr().out
    assert "engine-k0: untraced" in out and "engine-plain: untraced" in out


@pytest.mark.parametrize("argv, message", [
    (["--paths", "engine,nope"], "--paths takes distinct names"),
    (["--paths", "engine,engine"], "--paths takes distinct names"),
    (["--paths", "engine-k0", "--k", "0"], "needs an MTP engine"),
])
def test_paths_are_checked_before_any_work(argv, message):
    with pytest.raises(SystemExit, match=message):
        step_profile.main(["--model-shape", "tiny", "--layers", "2"] + argv)
