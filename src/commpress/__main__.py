"""``python -m commpress …``: the CLI without an installed entry point (a copied tree
with ``PYTHONPATH=src``, as on a machine that installs nothing)."""

import sys

from commpress.cli import main

sys.exit(main())
