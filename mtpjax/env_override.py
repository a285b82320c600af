"""`env_override(name, value)`: an environment variable set inside a `with` block and restored
after it. The kernel-path switches (`MTPJAX_MOE_MATMUL`, `MTPJAX_FUSED_MOE_TOKENS`,
`MTPJAX_FUSED_SHARED`, `MTPJAX_FP8_MATMUL`, `MTPJAX_FP8_ACTIVATIONS`, `MTPJAX_FP8_KERNEL`) are
read when a step is traced, so only programs traced inside the block see the override."""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def env_override(name: str, value: str | None):
    """`name=value` inside the block, its previous value (or absence) after; None: left as it
    is."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
