"""Executes every notebooks/*.ipynb (in memory) and fails if a cell errors.

Each notebook ends with `assert` cells on its key result, so a change that breaks what a notebook
shows fails here. The kernel runs this test's own interpreter (`sys.executable`, through a
kernelspec written into a tmp folder, so no kernelspec installed on the machine can pick another
Python) with this process' environment (conftest's XLA flags and no persistent compilation
cache), cwd notebooks/. Figures go to a tmp folder (`MTPJAX_NOTEBOOK_FIGURES`), and the executed
notebook is never written back: the repository stays as it was.

`python tests/project/test_notebooks.py [NAME ...] --write` executes notebooks and saves them with their
outputs and figures (what is committed, so readers see the plots).
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

import pytest

NOTEBOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "notebooks")
NOTEBOOKS = sorted(glob.glob(os.path.join(NOTEBOOK_DIR, "*.ipynb")))
KERNEL_NAME = "mtpjax-test-python"
CELL_TIMEOUT_S = 240


def _kernel_manager(spec_root: str):
    """A kernel manager whose only kernelspec runs `sys.executable -m ipykernel_launcher`."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager
    spec_dir = os.path.join(spec_root, KERNEL_NAME)
    os.makedirs(spec_dir, exist_ok=True)
    with open(os.path.join(spec_dir, "kernel.json"), "w") as f:
        json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "mtpjax tests", "language": "python"}, f)
    ksm = KernelSpecManager(kernel_dirs=[spec_root], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)


def execute_notebook(path: str, figures_dir: str, spec_root: str):
    """Runs the notebook at `path` in a fresh kernel; returns (executed notebook, seconds).
    Raises nbclient's CellExecutionError naming the failing cell."""
    import nbformat
    from nbclient import NotebookClient
    nb = nbformat.read(path, as_version=4)
    # first cell, in memory only: the kernel must be this interpreter
    nb.cells.insert(0, nbformat.v4.new_code_cell(
        f"import sys\nassert sys.executable == {sys.executable!r}, sys.executable"))
    env = dict(os.environ, MTPJAX_NOTEBOOK_FIGURES=figures_dir, MPLBACKEND="Agg")
    client = NotebookClient(nb, km=_kernel_manager(spec_root), timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": NOTEBOOK_DIR}})
    t0 = time.perf_counter()
    client.execute(cwd=NOTEBOOK_DIR, env=env)
    nb.cells.pop(0)
    return nb, time.perf_counter() - t0


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[os.path.basename(p) for p in NOTEBOOKS])
def test_notebook_runs_and_its_checks_pass(path, tmp_path):
    figures = tmp_path / "figures"
    nb, seconds = execute_notebook(path, str(figures), str(tmp_path / "kernels"))
    saved = sorted(p.name for p in figures.glob("*.png")) if figures.is_dir() else []
    assert saved, f"{os.path.basename(path)} saved no figure into $MTPJAX_NOTEBOOK_FIGURES"
    shown = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                if "image/png" in o.get("data", {}))
    assert shown >= len(saved), f"{os.path.basename(path)}: {len(saved)} figures saved, {shown} shown"
    print(f"{os.path.basename(path)}: {seconds:.1f} s, figures {saved}")


def test_notebooks_exist():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS


def main(argv=None):
    """Executes notebooks (all, or the named ones) and writes them back with their outputs; the
    figures go to notebooks/figures/."""
    import argparse
    import tempfile

    import nbformat
    ap = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="notebook names (default: all)")
    ap.add_argument("--write", action="store_true", help="save the executed notebooks")
    args = ap.parse_args(argv)
    os.environ.setdefault("MTPJAX_COMPILATION_CACHE", "0")      # as in the tests (conftest.py)
    os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                          "--xla_llvm_disable_expensive_passes=true")
    paths = [p for p in NOTEBOOKS if not args.names or
             os.path.splitext(os.path.basename(p))[0] in args.names]
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            nb, seconds = execute_notebook(path, os.path.join(NOTEBOOK_DIR, "figures"), tmp)
            print(f"{os.path.basename(path)}: {seconds:.1f} s", flush=True)
            if args.write:
                nbformat.write(nb, path)


if __name__ == "__main__":
    main()
