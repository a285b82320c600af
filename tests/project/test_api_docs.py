"""The API reference builds from the docstrings without a warning (`python docs/build_api.py DIR`).

pdoc imports every submodule; a module that fails to import, or a docstring pdoc cannot render,
is a warning on stderr rather than an error, so the build itself would still pass. Run in a
subprocess: importing every benchmark module must not leak into the test process.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("pdoc")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_api_reference_builds_without_warnings(tmp_path):
    r = subprocess.run([sys.executable, os.path.join("docs", "build_api.py"), str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "warn" not in r.stderr.lower(), r.stderr[-4000:]
    assert (tmp_path / "index.html").exists()
    for page in ("mtpjax.html", "mtpjax/engine.html", "mtpjax/engine/llm.html",
                 "mtpjax/checkpoint.html", "mtpjax/train.html", "mtpjax/speculative/accept.html",
                 "pallas_kernels.html"):
        assert (tmp_path / page).exists(), page
    # the public API is documented from its docstrings
    assert "SpecConfig" in (tmp_path / "mtpjax.html").read_text()
