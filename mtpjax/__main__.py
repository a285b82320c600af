"""`python -m mtpjax ...`: the `mtpjax` command (mtpjax/cli.py)."""

import sys

from mtpjax.cli import main

sys.exit(main())
