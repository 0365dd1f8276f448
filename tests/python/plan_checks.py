"""What the plan tests of tests/python/test_plan_families.py and test_plan_presets.py check on
one model and device: the plan is never slower than the fastest row of `ferry compare
--keep-grads` (the gradients held between steps, as the planner holds them) that fits the budget
(0.5 % slack), is hazard-free and peaks within the budget (docs/plan.md); in `ferry compare`'s
default, the `ferry` row is no slower than `trl`, and `ferry + checkpoint` is at most 1.02x
checkpointing every layer (docs/offload.md, "The offload horizon", "Tensors in flight")."""

import json
import subprocess

DEVICES = ("a100-pcie4", "h100-sxm-pcie5", "gh200")
FACTORS = (1.0, 1.1, 1.3)
SLACK = 1.005


def cli_json(cli, *args):
    run = subprocess.run([cli, *args, "--json"], capture_output=True, text=True, timeout=600)
    return run.returncode, (json.loads(run.stdout) if run.stdout.strip() else None), run.stderr


def check_plans_and_rows(cli, model, name, device):
    """The checks above for `model` (a preset's name or a model file) on `device`, at budgets
    of 1.0x, 1.1x and 1.3x the peak reserved of checkpointing every layer (gradients held)."""
    code, compare, err = cli_json(cli, "compare", "--model", model, "--device", device)
    assert code == 0, err
    rows = {r["name"]: r for r in compare["rows"]}
    every = rows["checkpoint every layer"]
    assert rows["ferry"]["step_time_ns"] <= rows["trl"]["step_time_ns"], rows["ferry"]
    assert rows["ferry + checkpoint"]["step_time_ns"] * 100 <= every["step_time_ns"] * 102
    # The fixed rows the plan is held against, measured as the planner measures its own.
    code, compare, err = cli_json(
        cli, "compare", "--model", model, "--device", device, "--keep-grads"
    )
    assert code == 0, err
    every = next(r for r in compare["rows"] if r["name"] == "checkpoint every layer")
    for factor in FACTORS:
        budget = int(every["peak_reserved_bytes"] * factor)
        # The simulator's own peaks: no margin below them.
        args = ["--model", model, "--device", device, "--budget", str(budget), "--margin", "0"]
        code, plan, err = cli_json(cli, "plan", *args)
        assert code == 0, f"{name} on {device} at {factor}x: {err}"
        assert plan["hazards"] == 0
        assert plan["peak_reserved_bytes"] <= budget
        fitting = [
            r
            for r in compare["rows"]
            if r["fits"] and r["failure"] is None and r["peak_reserved_bytes"] <= budget
        ]
        fastest = min(fitting, key=lambda r: r["step_time_ns"])
        assert plan["step_time_ns"] <= fastest["step_time_ns"] * SLACK, (
            f"{name} on {device} at {factor}x: plan {plan['step_time_ns']} ns, "
            f"{fastest['name']} {fastest['step_time_ns']} ns"
        )
        assert plan["lower_bound_ns"] <= plan["step_time_ns"]
