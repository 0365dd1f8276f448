"""`python -m ferry validate`: predictions checked against real runs (docs/validation.md).

MODEL is a bundled example (``ferry.examples``) or a factory ``pkg.module:function``
returning ``(model, inputs[, loss_fn])``. The model is trained for real under each policy on
the CPU loopback device (or a CUDA device, ``--real-device cuda``), traced, and the trace
simulated under the same policies; one table shows both sides. Exit status: 0 when every count
and byte agrees, 1 when one differs, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from .._validate import BYTES, COUNTERS, POLICIES, REAL_DEVICES, ModelSpecError, validate


def _parser() -> argparse.ArgumentParser:
    from ..examples import EXAMPLES

    parser = argparse.ArgumentParser(
        prog="python -m ferry validate",
        description="Train a model for real under each policy (CPU loopback device or CUDA), trace "
        "it, simulate the trace under the same policies and compare.",
    )
    parser.add_argument(
        "model",
        help="a bundled example (" + ", ".join(EXAMPLES) + ") or a "
        "factory pkg.module:function returning (model, inputs[, loss_fn])",
    )
    parser.add_argument(
        "--steps", type=int, default=2, help="training steps per policy (default 2)"
    )
    parser.add_argument(
        "--policy",
        action="append",
        choices=list(POLICIES),
        help="a policy to run (repeatable; default: all)",
    )
    parser.add_argument("--device", help="the simulator's device profile (name or file)")
    parser.add_argument(
        "--horizon",
        choices=("auto", "none"),
        default="auto",
        help="the ferry policy's offload horizon: the one the simulator derives, "
        "given to the real run too (auto), or none on either side",
    )
    parser.add_argument(
        "--real-device",
        choices=REAL_DEVICES,
        default="loopback",
        help="where the real run trains: the CPU loopback device (default) or the current "
        "CUDA device, where peak allocated and reserved memory are measured",
    )
    parser.add_argument("--keep", metavar="PATH", help="also write the traced model to PATH")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    return parser


def table(report: dict[str, Any]) -> str:
    """The report as text: one row per policy, then the counts that differ."""
    steps = f"{report['steps']} step" + ("s" if report["steps"] != 1 else "")
    cuda = report.get("real_device") == "cuda"
    where = (
        "CUDA device"
        if cuda
        else "CPU loopback device (times reported, not compared: loopback copies are synchronous)"
    )
    lines = [f"model {report['model']}, {steps}, {where}", ""]
    header = (
        f"{'policy':<18}{'step ms pred':>13}{'step ms meas':>13}{'error':>9}"
        f"{'peak alloc pred':>17}{'peak meas':>15}{'error':>9}{'counts':>9}"
    )
    lines += [header, "-" * len(header)]

    def error(pred, meas):
        return f"{(pred - meas) / meas:+.1%}" if cuda and meas else "-"

    for name, row in report["policies"].items():
        sim, real = row["simulated"], row["real"]
        agree = "exact" if not row["mismatches"] else f"{len(row['mismatches'])} off"
        peak = real.get("peak_allocated_bytes")
        lines.append(
            f"{name:<18}{sim['step_time_ns'] / 1e6:>13.3f}{real['step_time_ns'] / 1e6:>13.3f}"
            f"{error(sim['step_time_ns'], real['step_time_ns']):>9}"
            f"{sim['peak_allocated_bytes']:>17,}{'n/a' if peak is None else f'{peak:,}':>15}"
            f"{error(sim['peak_allocated_bytes'], peak):>9}{agree:>9}"
        )
    saved = report["saved_at_end_of_forward"]
    equal = saved["real"] == saved["traced"] == saved["simulated"]
    lines += [
        "",
        "saved activations held at the end of forward: "
        f"real {saved['real']:,} B, traced {saved['traced']:,} B, simulated peak "
        f"{saved['simulated']:,} B ({'equal' if equal else 'differ'})",
    ]
    lines += [
        "",
        "counts and bytes, real / simulated (the output head's saves taken off the "
        "simulated packed and kept):",
    ]
    names = COUNTERS + BYTES
    head = report["head_saves_per_step"] * report["steps"]
    rows = []
    for name, row in report["policies"].items():
        sim, real = row["simulated"], row["real"]
        pool = POLICIES[name][0] == "ferry"  # only ferry's policy has a host pool
        sim = {n: sim[n] - head if n in ("packed", "kept") else sim[n] for n in names}
        rows.append(
            [name]
            + [f"{real[n] if n != 'pinned_peak' or pool else 'n/a'} / {sim[n]}" for n in names]
        )
    widths = [
        max(len(r[k]) for r in [["policy", *names], *rows]) + 2 for k in range(len(names) + 1)
    ]
    for r in [["policy", *names], *rows]:
        lines.append(
            f"{r[0]:<{widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(r[1:], widths[1:]))
        )
    for name, row in report["policies"].items():
        for m in row["mismatches"]:
            lines.append(f"MISMATCH {name}: {m}")
    return "\n".join(lines) + "\n"


def _exact(report: dict[str, Any]) -> bool:
    saved = report["saved_at_end_of_forward"]
    return saved["real"] == saved["traced"] == saved["simulated"] and all(
        not row["mismatches"] for row in report["policies"].values()
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status (0 all agree, 1 one differs, 2 bad arguments)."""
    args = _parser().parse_args(argv)
    if args.steps < 1:
        print(
            f"python -m ferry validate: --steps must be at least 1 (got {args.steps})",
            file=sys.stderr,
        )
        return 2
    try:
        report = validate(
            args.model,
            policies=args.policy,
            steps=args.steps,
            device=args.device,
            keep=args.keep,
            horizon=args.horizon,
            real_device=args.real_device,
        )
    except (ModelSpecError, ImportError, ValueError) as e:
        print(f"python -m ferry validate: {e}", file=sys.stderr)
        return 2
    if args.json:
        report["exact"] = _exact(report)
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
    else:
        sys.stdout.write(table(report))
    return 0 if _exact(report) else 1
