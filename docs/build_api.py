"""Builds the API reference from the docstrings: `python docs/build_api.py OUT_DIR` (pdoc, in the
`test` extra), then open OUT_DIR/index.html. tests/project/test_api_docs.py builds it and fails on any
warning.

`pdoc mtpjax` alone documents only what `mtpjax.__all__` names, so every public module is
given; but a module that a package spec already brings in must not be given again, or pdoc
warns that it was added twice. The specs are therefore chosen against pdoc's own expansion.
"""

from __future__ import annotations

import os
import pkgutil
import sys
from pathlib import Path

PACKAGES = ("mtpjax", "pallas_kernels")


def module_specs(packages=PACKAGES) -> list[str]:
    """The fewest module names whose pdoc expansion covers every public module of `packages`."""
    import importlib

    from pdoc.extract import walk_specs

    chosen: list[str] = []
    for package in packages:
        chosen.append(package)
        covered = set(walk_specs(chosen))
        path = importlib.import_module(package).__path__
        for m in pkgutil.walk_packages(path, package + "."):
            if any(part.startswith("_") for part in m.name.split(".")) or m.name in covered:
                continue
            chosen.append(m.name)
            covered = set(walk_specs(chosen))
    return chosen


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    import pdoc
    import pdoc.render

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    # no "View Source" blocks: highlighting every function's source is most of the build time
    pdoc.render.configure(docformat="markdown", footer_text="mtpjax", show_source=False)
    pdoc.pdoc(*module_specs(), output_directory=Path(argv[0]))
    print(f"wrote {argv[0]}/index.html")
    return 0


if __name__ == "__main__":
    sys.exit(main())
