"""``ferry.auto``: trace a model, plan it under a memory budget with ``ferry plan``, and apply the
plan to the real forward (docs/plan.md, "Applying a plan")."""

import os
import re
import subprocess
import tempfile

import torch

from . import offload
from ._plan_apply import PlanError, load_plan

# `ferry plan`'s exit code for a budget no plan fits.
EXIT_INFEASIBLE = 1
# How `ferry plan` names the floor when it refuses a budget below it.
_FLOOR = re.compile(
    r"the floor \(the smallest peak reserved the planner reached\) is [^(]*\((\d+) bytes\)"
)


class AutoOffload(offload):
    """An ``offload`` applying the plan ``ferry.auto`` made: ``plan`` (the ``ferry.plan/1``
    dict), ``report`` (what ``ferry plan`` printed: predicted step time, peaks, lower bound)
    and ``traced`` (the ``TracedModel`` it was planned from)."""

    def __init__(self, plan, model, report, traced, **options):
        super().__init__(plan=plan, model=model, **options)
        self.plan = plan
        self.report = report
        self.traced = traced


def _on_cpu(model, example_inputs):
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return all(t.device.type in ("cpu", "meta") for t in tensors)


def check_budget(value, what):
    """Refuses an empty budget (``ferry plan`` would take it as no budget: the device's whole
    memory) and one that is neither a string nor an integer (``None`` would reach the planner
    as the text "None"); ``what`` names the argument in the message. The planner checks the
    rest."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            f'{what}: {value!r} is not a byte count; give a string such as "40GiB" or an '
            "integer number of bytes"
        )
    if isinstance(value, str) and not value.strip():
        raise ValueError(
            f'{what}: "{value}" is not a byte count (empty); write e.g. 40GiB, "40 GiB", 1.5GiB, '
            "512MiB, 40GB or 4e10 (bytes)"
        )


def run_planner(model_path, budget, out_path, device=None, host_budget=None):
    """Runs ``ferry plan`` on a ``ferry.model/1`` file and returns what it printed; raises
    ``PlanError`` with its message, ``exit_code`` and ``floor`` when it refuses (exit code 1:
    no plan fits the budget; ``floor`` is the smallest peak reserved in bytes the planner
    reached, above the budget, when it names one, else None)."""
    from .__main__ import CliNotFound, find_cli

    try:
        cli = find_cli()
    except CliNotFound as e:
        raise PlanError(f"ferry.auto: {e}") from None
    command = [
        cli,
        "plan",
        "--model",
        os.fspath(model_path),
        "--budget",
        str(budget),
        "--out",
        os.fspath(out_path),
    ]
    if device is not None:
        command += ["--device", str(device)]
    if host_budget is not None:
        command += ["--host-budget", str(host_budget)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = " / ".join((done.stderr.strip() or done.stdout.strip()).splitlines())
        floor = _FLOOR.search(said) if done.returncode == EXIT_INFEASIBLE else None
        # Without a floor the planner says why the plans that reached the budget failed.
        what = (
            ("the budget is below the floor" if floor else "no plan fits the budget")
            if (done.returncode == EXIT_INFEASIBLE)
            else f"exit code {done.returncode}"
        )
        error = PlanError(f"ferry.auto: ferry plan refused ({what}): " + said)
        error.exit_code = done.returncode
        error.floor = int(floor.group(1)) if floor else None
        raise error
    return done.stdout


def auto(
    model,
    *example_inputs,
    budget="40GiB",
    device=None,
    loss_fn=None,
    host_budget=None,
    loopback=None,
    **options,
):
    """Traces one training step of ``model`` on ``example_inputs``, plans it with ``ferry plan``
    to fit ``budget`` (peak reserved device memory: ``"40GiB"``, bytes, ...) on the device
    profile ``device`` (the CLI's default when None), and returns an ``AutoOffload`` that
    applies the plan: ``with ctx: loss = loss_fn(model(*inputs))``, then ``loss.backward()``.

    The CLI is ``$FERRY_CLI``, else the package's ``ferry/bin/ferry``, else ``ferry`` on PATH.
    A budget below the floor raises ``PlanError`` with the planner's message, which names the
    floor. ``loopback`` (default: the model is on the CPU) runs on the CPU loopback device; other
    ``options`` go to ``ferry.offload``.
    """
    from . import trace

    check_budget(budget, "ferry.auto: budget")
    if host_budget is not None:
        check_budget(host_budget, "ferry.auto: host_budget")
    on_cpu = _on_cpu(model, example_inputs)
    traced = trace(model, *example_inputs, loss_fn=loss_fn, target="host" if on_cpu else "device")
    with tempfile.TemporaryDirectory(prefix="ferry-auto-") as scratch:
        model_path = os.path.join(scratch, "model.json")
        plan_path = os.path.join(scratch, "plan.json")
        traced.save(model_path)
        report = run_planner(model_path, budget, plan_path, device, host_budget)
        plan = load_plan(plan_path)
    if loopback is None:
        loopback = on_cpu
    return AutoOffload(plan, model, report, traced, loopback=loopback, **options)
