"""bench.register_report: the Triton IR of every case lowers on this (CPU) machine; the
compile-and-ptxas half needs a Python with the triton wheel and is skipped without one."""

import glob
import os

import pytest

from mtpjax.bench import register_report


def test_every_case_lowers_to_triton_ir(tmp_path):
    assert register_report.main(["--out", str(tmp_path)]) == 0
    files = sorted(glob.glob(str(tmp_path / "*.ttir")))
    assert {os.path.basename(f).rsplit("_", 1)[0] for f in files} == set(register_report.CASES)
    for f in files:
        text = open(f).read()
        assert "tt.func" in text and ("tt.dot" in text), f


def test_unknown_case_is_refused():
    with pytest.raises(SystemExit, match="unknown cases \\['nope'\\]"):
        register_report.main(["--cases", "nope"])


@pytest.mark.skipif(not os.environ.get("MTPJAX_TRITON_PYTHON"),
                    reason="needs MTPJAX_TRITON_PYTHON: a Python with the triton wheel")
def test_report_with_triton(tmp_path, capsys):
    assert register_report.main(["--cases", "gmm_decode", "--configs", "4/1",
                                 "--out", str(tmp_path)]) == 0
    assert "| gmm_decode | 4 | 1 |" in capsys.readouterr().out


def test_ctas_per_sm_counts_registers_and_shared_memory():
    ctas = register_report.ctas_per_sm
    assert ctas(255, 8, 155648) == 1          # the MLA 64-row tile: one CTA per SM
    assert ctas(128, 4, 20480) == 4           # 128 registers x 128 threads: 4 by registers
    assert ctas(163, 4, 51200) == 3
    assert ctas(64, 4, 20480) == 8            # 8 by registers, 10 by shared memory
    assert ctas(100, 8, 286720) == 0          # over 227 KB: cannot launch


def test_cli_runs_it(tmp_path):
    from mtpjax.cli import BENCHES, main
    assert main(["bench", "registers", "--cases", "gmm_decode", "--out", str(tmp_path)]) == 0
    assert glob.glob(str(tmp_path / "gmm_decode_*.ttir"))
    import importlib
    for module in BENCHES.values():                  # every bench the CLI names has a main
        assert callable(importlib.import_module(module).main), module
