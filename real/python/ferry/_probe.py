"""``ferry.probe``: measure this device (a GPU, or the CPU loopback device) and return its
``ferry.probe/1`` report (docs/devices.md, "Measuring a device: ferry probe")."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from . import _C


def probe(
    device: str | None = None,
    *,
    repeats: int = 5,
    bytes: int | str | None = None,
    matmul: Sequence[int] | None = None,
    name: str = "probe",
    out: str | os.PathLike[str] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Measures the device and returns the ``ferry.probe/1`` report.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; default: cuda when a GPU is visible,
            else cpu (the loopback device).
        repeats: How many times each measurement is taken.
        bytes: The size of the large copies (an int or a string such as ``"64MiB"``).
        matmul: An ``(m, k, n)`` shape for the compute measurement.
        name: The profile's name.
        out: A path to write the device profile to (as ``ferry probe --out`` writes it).
        progress: Report each measurement on stderr as it runs.

    Returns:
        The report: each measurement's samples and spread (min, median, max), each profile
        key's value and whether it was measured or assumed, and the device profile under
        ``"profile"``.

    Raises:
        ValueError: A bad argument or an absent device.
    """
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
