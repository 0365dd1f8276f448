"""``ferry.auto``: trace a model, plan it under a memory budget with ``ferry plan``, and apply the
plan to the real forward (docs/plan.md, "Applying a plan")."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._offload import offload
from ._plan import PlanError, load_plan
from ._sim import CliNotFound, find_cli
from ._trace import TracedModel, trace

# `ferry plan`'s exit code for a budget no plan fits.
EXIT_INFEASIBLE = 1
# How `ferry plan` names the floor when it refuses a budget below it.
_FLOOR = re.compile(
    r"the floor \(the smallest peak reserved the planner reached\) is [^(]*\((\d+) bytes\)"
)


class AutoOffload(offload):
    """An ``offload`` applying the plan ``ferry.auto`` made.

    Attributes:
        plan: The ``ferry.plan/1`` dict.
        report: What ``ferry plan`` printed: predicted step time, peaks, lower bound.
        traced: The ``TracedModel`` it was planned from.

    Args:
        plan: The plan.
        model: The model the plan was traced from.
        report: What ``ferry plan`` printed.
        traced: The traced model.
        **options: Further ``offload`` options.
    """

    def __init__(
        self,
        plan: dict[str, Any],
        model: torch.nn.Module,
        report: str,
        traced: TracedModel,
        **options: Any,
    ) -> None:
        super().__init__(plan=plan, model=model, **options)
        self.plan = plan
        self.report = report
        self.traced = traced


def _on_cpu(model: torch.nn.Module, example_inputs: Sequence[Any]) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    tensors += [x for x in example_inputs if isinstance(x, torch.Tensor)]
    return all(t.device.type in ("cpu", "meta") for t in tensors)


def check_budget(value: object, what: str) -> None:
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


def run_planner(
    model_path: str | os.PathLike[str],
    budget: str | int,
    out_path: str | os.PathLike[str],
    device: str | None = None,
    host_budget: str | int | None = None,
) -> str:
    """Runs ``ferry plan`` on a ``ferry.model/1`` file and returns what it printed; raises
    ``PlanError`` with its message, ``exit_code`` and ``floor`` when it refuses (exit code 1:
    no plan fits the budget; ``floor`` is the smallest peak reserved in bytes the planner
    reached, above the budget, when it names one, else None)."""
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
    model: torch.nn.Module,
    *example_inputs: Any,
    budget: str | int = "40GiB",
    device: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    host_budget: str | int | None = None,
    loopback: bool | None = None,
    **options: Any,
) -> AutoOffload:
    """Traces one training step of ``model``, plans it under a budget and applies the plan.

    The step is traced on ``example_inputs`` and planned with ``ferry plan`` to fit ``budget``;
    the result applies the plan: ``with ctx: loss = loss_fn(model(*inputs))``, then
    ``loss.backward()``. The CLI is ``$FERRY_CLI``, else the package's ``ferry/bin/ferry``,
    else ``ferry`` on PATH.

    Args:
        model: The model to plan.
        *example_inputs: The inputs of one step.
        budget: Peak reserved device memory: ``"40GiB"``, bytes, ...
        device: The device profile to plan for (the CLI's default when None).
        loss_fn: A function of the model's output that returns the scalar loss.
        host_budget: The pinned host memory budget.
        loopback: Run on the CPU loopback device (default: when the model is on the CPU).
        **options: Further ``ferry.offload`` options.

    Returns:
        The ``offload`` region that applies the plan.

    Raises:
        TypeError: A budget that is no byte count.
        ValueError: An empty budget.
        PlanError: ``ferry plan`` refused (a budget below the floor: the message names the
            floor, also in ``floor``), or there is no CLI.
    """
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
