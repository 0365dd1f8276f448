"""``python -m ferry auto``: trace a Hugging Face config and plan it under a memory budget.

``python -m ferry auto CONFIG --seq N --budget B --out scenario.json --plan plan.json`` is
``python -m ferry trace`` (every option of it, the scenario written to ``--out``) followed by
the planner of ``ferry plan --model scenario.json --budget B --out plan.json`` (with
``--device``, ``--host-budget`` and ``--margin`` when given), run in this process; it prints the
planner's report. Apply the plan to the model with
``ferry.offload(plan="plan.json", model=model)`` (docs/plan.md, "Applying a plan").

Exit codes: 0 planned; 1 the budget is below the floor (the message names it: the smallest
budget that plans); 2 bad arguments or config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._plan import PlanError
from .._sim import DEFAULT_DEVICE, read_bytes, run_planner
from . import trace as trace_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ferry auto",
        description="Trace a Hugging Face config (every option of `python -m ferry trace`), then "
        "plan it with `ferry plan` under a budget of peak reserved device memory.",
        epilog="The other options are those of `python -m ferry trace` (see its --help).",
    )
    parser.add_argument("--budget", required=True, help="device budget: 40GiB, 4e10, ...")
    parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help=f"the device profile to plan for ({DEFAULT_DEVICE})",
    )
    parser.add_argument("--host-budget", help="pinned host memory budget")
    parser.add_argument(
        "--margin",
        help="plan to the budget less this percent of it, 0..50 (default: what "
        "docs/validation.md's table supports; docs/plan.md)",
    )
    parser.add_argument("--plan", required=True, help="where to write the plan (ferry.plan/1)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; returns the exit status."""
    args, rest = _parser().parse_known_args(argv)
    try:  # read once, before anything is traced; the planner takes them as read
        budget = read_bytes(args.budget, "--budget", required=True)
        host_budget = read_bytes(args.host_budget, "--host-budget")
    except ValueError as e:
        print(f"python -m ferry auto: {e}", file=sys.stderr)
        return 2
    trace_args = trace_cli._parser().parse_args(rest)
    if trace_args.out == "-":
        print(
            "python -m ferry auto: --out must name a file (the planner reads it)", file=sys.stderr
        )
        return 2
    code = trace_cli.main(rest)
    if code != 0:
        return code
    try:
        made = run_planner(trace_args.out, budget, args.device, host_budget, margin=args.margin)
    except PlanError as e:
        print(f"python -m ferry auto: {e}", file=sys.stderr)
        return e.exit_code
    try:
        with open(args.plan, "w", encoding="utf-8") as f:
            f.write(made["plan_text"])
    except OSError as e:
        print(f"python -m ferry auto: cannot write the plan to {args.plan}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(made["text"])
    print(f"plan written to {args.plan}", file=sys.stderr)
    return 0
