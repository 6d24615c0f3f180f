"""``python -m stragglerwatch.cli``: the ``stragglerwatch`` command, as ``python -m stragglerwatch``."""

from __future__ import annotations

import sys

from stragglerwatch.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
