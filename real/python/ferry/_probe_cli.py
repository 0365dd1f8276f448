"""`python -m ferry probe`: measure this device and write a device profile (docs/devices.md).

The command line is ferry-probe's own (``ferry._C._probe_main``): the same options, output and
exit codes as ``ferry probe``. Without a GPU it measures the CPU loopback device.
"""

import json
import sys

from . import _C


def probe(
    device=None, *, repeats=5, bytes=None, matmul=None, name="probe", out=None, progress=False
):
    """Measures the device ("cpu", "cuda" or "cuda:N"; default: cuda when a GPU is visible,
    else cpu) and returns the ``ferry.probe/1`` report as a dict: each measurement's samples
    and spread (min, median, max), each profile key's value and whether it was measured or
    assumed, and the device profile under ``"profile"``. ``bytes`` (an int or a string such as
    "64MiB") sizes the large copies, ``matmul`` is an ``(m, k, n)`` shape, ``out`` a path to
    write the profile to (as ``ferry probe --out`` writes it). Raises ValueError for a bad
    argument or an absent device."""
    report, profile = _C._probe(
        device=device or "",
        repeats=int(repeats),
        bytes="" if bytes is None else str(bytes),
        matmul=[] if matmul is None else [int(d) for d in matmul],
        name=name,
        progress=progress,
    )
    if out is not None:
        with open(out, "w", encoding="utf-8") as f:
            f.write(profile)
    return json.loads(report)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # The probe writes through C's stdio: what Python buffered goes first.
    sys.stdout.flush()
    sys.stderr.flush()
    return _C._probe_main(["python -m ferry probe", *argv])
