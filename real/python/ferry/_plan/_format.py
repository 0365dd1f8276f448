"""A ``ferry.plan/1`` as Python reads it (docs/plan-format.md): ``load_plan`` checks one with the
simulator's own code, ``CheckedPlan`` is what it hands back, ``PlanError`` what it raises.
Free of torch: the simulator's bridge (``ferry._sim``) needs these and nothing of applying a
plan."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, NoReturn

from .. import _simulator

# The op a trace adds when ops ran after the loss: it hands the loss on and runs nothing.
LOSS_OP = "loss"


class PlanError(ValueError):
    """A plan that cannot be read, or that does not fit the model it is applied to.

    From ``ferry.plan`` and ``ferry.auto``, a budget no plan fits: ``exit_code`` 1 (2 for a
    model, device or budget the planner refuses) and, as ``ferry plan --json``'s
    ``ferry.plan-refusal/1`` names them (docs/plan.md, "A budget below the floor"):

    Attributes:
        floor: The smallest budget that plans, in bytes: the smallest peak reserved the
            planner reached with the margin added back, rounded up, so that
            ``budget=e.floor`` plans and one byte less does not. None where no budget on the
            device plans (then ``device_memory_needed``) or none is known.
        smallest_budget: The same as ``floor``.
        peak_floor: The smallest peak reserved the planner reached, without the margin.
        device_memory_needed: Where the smallest budget that plans is above the device's
            memory, that budget (a device with that much memory plans; the message says what
            else would); else None.
    """

    exit_code: int | None = None
    floor: int | None = None
    smallest_budget: int | None = None
    peak_floor: int | None = None
    device_memory_needed: int | None = None


def fail(where: str, message: str) -> NoReturn:
    """Raises the ``PlanError`` of ``ferry.offload(plan=...)`` at ``where`` in the plan."""
    raise PlanError(f"ferry.offload(plan=...): {where}: {message}")


class CheckedPlan(dict):
    """A ``ferry.plan/1`` that ``load_plan`` checked: every field present, as ``ferry plan
    --out`` writes it. ``load_plan`` hands one back as it is, so a plan is checked once.

    Args:
        plan: The checked plan's fields.
        lowered: The ``ferry.offload`` options the planner lowered the plan to for its checked
            run (``ferry.plan`` hands them over with the plan), or None for a plan read from a
            file or a dict, which ``offload_options`` then lowers.
    """

    def __init__(self, plan: Mapping[str, Any], lowered: dict[str, Any] | None = None) -> None:
        super().__init__(plan)
        self.lowered = lowered


def load_plan(plan: str | os.PathLike[str] | Mapping[str, Any]) -> CheckedPlan:
    """Reads and checks a ``ferry.plan/1`` (docs/plan-format.md).

    The checks are the simulator's own (``ferry simulate --plan`` reads plans with the same
    code, in ``ferry._simulator``).

    Args:
        plan: A path to the plan, or an already loaded one.

    Returns:
        The plan as a checked dict, with every field the format has.

    Raises:
        PlanError: The file cannot be read, is not JSON, or is not a valid ``ferry.plan/1``;
            the message names the place.
    """
    if isinstance(plan, CheckedPlan):
        return plan
    where = "plan"
    if isinstance(plan, (str, os.PathLike)):
        where = os.fspath(plan)
        try:
            with open(plan, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            fail(where, f"cannot read it ({e.strerror})")
    elif isinstance(plan, Mapping):
        text = json.dumps(dict(plan))
    else:
        fail(where, f"a plan is a JSON object or a path, got {type(plan).__name__}")
    try:
        return CheckedPlan(_simulator.validate_plan(text, where))
    except ValueError as e:
        raise PlanError(f"ferry.offload(plan=...): {e}") from None


def offload_options(plan: CheckedPlan) -> dict[str, Any]:
    """``ferry.offload``'s options that the plan fixes: its knobs, its pinned host budget, and
    the ferry policy when anything offloads (``ferry::plan_offload_options``, which the
    simulator's replay of a plan applies too). A plan the planner handed over comes with them
    (``CheckedPlan.lowered``); only a plan read from elsewhere is sent to the simulator."""
    lowered = getattr(plan, "lowered", None)
    if lowered is not None:
        return dict(lowered)
    return _simulator.plan_offload_options(json.dumps(plan), "plan")
