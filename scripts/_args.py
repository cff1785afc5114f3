"""`--name=value` options of the probe scripts (run as `python scripts/<probe>.py --rows=1,16`)."""

from __future__ import annotations

import sys


def arg(name: str, default: str) -> str:
    """The value of `--name=value` on the command line, else `default`."""
    return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), default)
