"""``python -m stragglerwatch``: the ``stragglerwatch`` command."""

from __future__ import annotations

import sys

from stragglerwatch.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
