"""Every ```python block of README.md and docs/getting-started.md runs as written.

A newcomer pastes one block into a fresh interpreter, so each block must be self-contained (no
names from an earlier block) and small enough for a CPU. A block that cannot run on a CPU is
marked with `<!-- not run: REASON -->` on the line before its fence; only those are skipped, and
the count of them is checked so a marker cannot silently swallow more blocks.

A block that sets XLA_FLAGS (the multi-device example) runs in a subprocess: the flag only takes
effect before jax starts, and it must not change this test process's devices. The others run
in-process in a fresh namespace, which saves a jax import and start-up per block.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ("README.md", os.path.join("docs", "getting-started.md"))
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```python\s*\n(.*?)^```\s*$", re.S | re.M)
# blocks each file may leave unrun (with a visible reason); raising it is a deliberate edit
ALLOWED_NOT_RUN = {"README.md": 0, os.path.join("docs", "getting-started.md"): 0}


def python_blocks(path: str) -> list[tuple[int, str, str | None]]:
    """[(line number of the fence, code, not-run reason or None)] of one markdown file."""
    text = open(os.path.join(ROOT, path)).read()
    blocks = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = NOT_RUN.search(before)
        blocks.append((line, m.group(1), reason.group(1) if reason else None))
    return blocks


CASES = [pytest.param(path, line, code, reason, id=f"{os.path.basename(path)}:{line}")
         for path in FILES if os.path.exists(os.path.join(ROOT, path))
         for line, code, reason in python_blocks(path)]


def test_found_the_blocks():
    assert sum(1 for c in CASES if c.values[0] == "README.md") >= 5


@pytest.mark.parametrize("path", [p for p in FILES if os.path.exists(os.path.join(ROOT, p))])
def test_not_run_markers_are_counted(path):
    text = open(os.path.join(ROOT, path)).read()
    markers = len(NOT_RUN.findall(text))
    marked = sum(1 for _, _, reason in python_blocks(path) if reason)
    assert markers == marked, f"{path}: a `<!-- not run: ... -->` marker not right before a block"
    assert marked <= ALLOWED_NOT_RUN[path], f"{path}: {marked} blocks marked not run"


@pytest.mark.parametrize("path,line,code,reason", CASES)
def test_block_runs_as_written(path, line, code, reason):
    if reason:
        pytest.skip(f"{path}:{line} not run: {reason}")
    name = f"{path}:{line}"
    if "XLA_FLAGS" in code:
        # the parent's XLA_FLAGS (the suite's fast-compile flags) are kept: the block appends
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        out = r.stdout
    else:
        buf = io.StringIO()
        cwd = os.getcwd()
        try:
            os.chdir(ROOT)
            with contextlib.redirect_stdout(buf):
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
        finally:
            os.chdir(cwd)
        out = buf.getvalue()
    assert out.strip(), f"{name} printed nothing"


SPEED = re.compile(r"tokens/s|tok/s|\d(\.\d+)?x plain")


def test_speed_numbers_say_where_acceptance_came_from():
    """A speed-up with MTP depends on the acceptance rate; a reader must see whether a figure
    came from a trained model or from the benchmark-only synthetic acceptance."""
    text = open(os.path.join(ROOT, "README.md")).read()
    for para in re.split(r"\n\s*\n", text):
        if SPEED.search(para) and not para.lstrip().startswith(("```", "    ")):
            assert "synthetic" in para or "trained" in para, para[:300]
