"""`python -m ferry probe`: measure this device and write a device profile (docs/devices.md).

The command line is ferry-probe's own (``ferry._C._probe_main``): the same options, output and
exit codes as ``ferry probe``. Without a GPU it measures the CPU loopback device.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .. import _C


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (ferry-probe's)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # The probe writes through C's stdio: what Python buffered goes first.
    sys.stdout.flush()
    sys.stderr.flush()
    return _C._probe_main(["python -m ferry probe", *argv])
