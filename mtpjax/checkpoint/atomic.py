"""Writing an output folder all or nothing.

Writers fill a hidden temporary folder beside the destination and rename it into place at the
end; on any error the temporary folder is removed, so a failed conversion leaves nothing at the
destination (and nothing half-written beside it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from mtpjax.checkpoint.errors import CheckpointError


def check_free(dst: str) -> None:
    """Raises unless `dst` is absent or an empty folder."""
    if os.path.lexists(dst) and not (os.path.isdir(dst) and not os.listdir(dst)):
        raise CheckpointError(f"output folder {os.path.abspath(dst)} already exists and is not empty")


@contextlib.contextmanager
def atomic_dir(dst: str):
    """Yields a fresh folder; it becomes `dst` when the block succeeds. `dst` must not exist
    (an empty folder is replaced)."""
    dst = os.path.abspath(dst)
    check_free(dst)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.partial-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(dst):
            os.rmdir(dst)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
