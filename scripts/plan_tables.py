#!/usr/bin/env python3
"""Writes the tables of docs/validation-planner.md: `ferry plan` against the fixed policies.

For each model and device: `ferry compare --keep-grads --json` gives every fixed configuration's
time and peak reserved (the gradients held between steps, as the planner holds them); the budgets
are the peaks of the fixed rows that fit the device, at or above the smallest of them, and eight
evenly spaced budgets from that smallest peak to the no-offload peak. Each budget is planned with
`ferry plan --budget BYTES --margin 0 --json`; the row gives the plan's time, its ratio to no
offload, the fastest fixed row whose peak fits, the lower bound, and the bound over per-layer
options (its ratio only where the plan is one of them).

Usage: scripts/plan_tables.py [--cli build/release/sim/ferry] > tables.md
"""

import argparse
import json
import subprocess
import sys

CASES = (
    ("llama3-8b-s8192", "h100-sxm-pcie5"),
    ("llama3-8b-s8192", "a100-pcie4"),
    ("llama3-8b-s8192", "gh200"),
    ("gpt2-small-s1024", "h100-sxm-pcie5"),
    ("gpt2-small-s1024", "a100-pcie4"),
    ("gpt2-small-s1024", "gh200"),
)
GIB = 1 << 30
#: The checkpoint rows as the tables name them (the page's introduction says so).
SHORT = {"checkpoint every layer": "every layer", "checkpoint selective": "selective"}


def run(cli, *args):
    out = subprocess.run([cli, *args, "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def duration(ns, unit):
    """Milliseconds, the unit the table's heading names: whole ones for long steps."""
    return f"{ns / 1e6:.0f}" if unit == "ms" else f"{ns / 1e6:.2f}"


def table(cli, model, device):
    rows = run(cli, "compare", "--model", model, "--device", device, "--keep-grads")["rows"]
    none = next(r for r in rows if r["name"] == "none")
    fixed = [r for r in rows if r["fits"] and r["failure"] is None]
    low = min(r["peak_reserved_bytes"] for r in fixed)
    high = none["peak_reserved_bytes"]
    budgets = {r["peak_reserved_bytes"] for r in fixed}
    budgets |= {low + (high - low) * i // 7 for i in range(8)}
    unit = "ms" if none["step_time_ns"] >= 100e6 else "small"
    rows = [
        [
            "budget, GiB",
            "plan",
            "plan / none",
            "best fixed that fits",
            "its time",
            "bound",
            "plan / bound",
            "options bound",
            "plan / options bound",
        ]
    ]
    for budget in sorted(b for b in budgets if low <= b <= high):
        plan = run(
            cli,
            "plan",
            "--model",
            model,
            "--device",
            device,
            "--budget",
            str(budget),
            "--margin",
            "0",
        )
        fits = [r for r in fixed if r["peak_reserved_bytes"] <= budget]
        best = min(fits, key=lambda r: r["step_time_ns"])
        t, bound = plan["step_time_ns"], plan["lower_bound_ns"]
        options = plan["options_lower_bound_ns"]
        in_space = f"{t / options:.3f}" if plan["plan_in_option_space"] else "–"
        rows.append(
            [
                f"{budget / GIB:.2f}",
                duration(t, unit),
                f"{t / none['step_time_ns']:.3f}",
                SHORT.get(best["name"], best["name"]),
                duration(best["step_time_ns"], unit),
                duration(bound, unit),
                f"{t / bound:.3f}",
                duration(options, unit),
                in_space,
            ]
        )
        print(f"{model} on {device}: {budget} bytes planned", file=sys.stderr)
    # An aligned text block, as the page shows it: columns two spaces apart.
    widths = [max(len(row[k]) for row in rows) for k in range(len(rows[0]))]
    body = ["  ".join(c.ljust(widths[k]) for k, c in enumerate(row)).rstrip() for row in rows]
    return "\n".join([f"**{model} on {device}** (ms)", "", "```text", *body, "```"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cli", default="build/release/sim/ferry")
    args = parser.parse_args()
    print("\n\n".join(table(args.cli, model, device) for model, device in CASES))


if __name__ == "__main__":
    main()
