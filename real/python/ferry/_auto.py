"""``ferry.auto``: trace a model, plan it under a memory budget with ``ferry plan``, and apply the
plan to the real forward (docs/plan.md, "Applying a plan")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._offload import offload
from ._plan import PlanError
from ._sim import DEFAULT_DEVICE, percentage, read_bytes, run_planner
from ._tensor_parallel import degree_of
from ._trace import TracedModel, trace


class AutoOffload(offload):
    """An ``offload`` applying the plan ``ferry.auto`` made.

    Attributes:
        plan: The ``ferry.plan/1`` dict.
        report: What ``ferry plan`` prints of the plan: predicted step time, peaks, lower
            bound, the fixed configurations it beat.
        traced: The ``TracedModel`` it was planned from.

    Args:
        plan: The plan.
        model: The model the plan was traced from.
        report: The planner's report.
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


def auto(
    model: torch.nn.Module,
    *example_inputs: Any,
    budget: str | int = "40GiB",
    device: str = DEFAULT_DEVICE,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    host_budget: str | int | None = None,
    loopback: bool | None = None,
    margin: str | float | None = None,
    traced: TracedModel | None = None,
    tp: int | None = None,
    **options: Any,
) -> AutoOffload:
    """Traces one training step of ``model``, plans it under a budget and applies the plan.

    The step is traced on ``example_inputs`` and planned in this process (``ferry.plan``, the
    planner of ``ferry plan``) to fit ``budget``; the result applies the plan: ``with ctx: loss
    = loss_fn(model(*inputs))``, then ``loss.backward()``.

    A model that ``parallelize_module`` parallelized (its parameters DTensors on a 1-D device
    mesh) is planned for one rank of that mesh: the whole model is traced, without the
    parallel styles' hooks, and the planner cuts it as ``ferry plan --tp N`` does; the plan
    applies to the rank's modules (docs/real.md, "Plans under tensor parallelism"). Call it
    on every rank, with the same inputs: each makes the same plan.

    Args:
        model: The model to plan.
        *example_inputs: The inputs of one step.
        budget: Peak reserved device memory: ``"40GiB"``, bytes, ...
        device: The device profile to plan for.
        loss_fn: A function of the model's output that returns the scalar loss.
        host_budget: The pinned host memory budget.
        loopback: Run on the CPU loopback device (default: when the model is on the CPU).
        margin: Plan to the budget less this percent of it (``ferry.plan``'s ``margin``);
            None: the default that docs/validation.md's table supports.
        traced: This model's step as traced before (an earlier result's ``traced``, or
            ``ferry.trace`` of the model on these inputs with this ``loss_fn``), planned
            instead of tracing again: another budget then costs only the simulations it adds
            (``TracedModel.planners``). It must hold the model's parameters.
        tp: The tensor-parallel degree; None: the size of the mesh the model's DTensor
            parameters lie on (1 without any). Given, it must be that size.
        **options: Further ``ferry.offload`` options.

    Returns:
        The ``offload`` region that applies the plan.

    Raises:
        TypeError: A budget that is no byte count, ``traced`` that is no ``TracedModel``, or
            ``tp`` that is no positive int.
        ValueError: A budget ``ferry plan`` refuses (empty, unreadable or out of range),
            ``traced`` lacks a parameter of the model or has it at another size, or ``tp``
            is not the model's degree (or its parameters lie on a mesh ferry.auto does not
            plan: several meshes, one of several dimensions, FSDP2's).
        PlanError: The planner refused (a budget below the floor: the message names the
            floor, the smallest budget that plans, also in ``floor``: ``budget=e.floor``
            plans; ``peak_floor`` is the smallest peak reserved, without the margin).
    """
    # Read once, before anything is traced; the planner takes them as read.
    budget_bytes = read_bytes(budget, "ferry.auto: budget", required=True)
    host_bytes = read_bytes(host_budget, "ferry.auto: host_budget")
    percentage(margin, "ferry.auto: margin")
    degree = degree_of(model, tp, "ferry.auto")
    on_cpu = _on_cpu(model, example_inputs)
    if traced is None:
        traced = trace(
            model, *example_inputs, loss_fn=loss_fn, target="host" if on_cpu else "device"
        )
    else:
        _check_traced(traced, model)
    parallel = {"tp": degree} if degree > 1 else {}
    try:
        made = run_planner(traced, budget_bytes, device, host_bytes, margin=margin, **parallel)
    except PlanError as e:
        raise _prefixed(e, "ferry.auto") from None
    if loopback is None:
        loopback = on_cpu
    return AutoOffload(
        made["report"]["plan"], model, made["text"], traced, loopback=loopback, **options
    )


def _check_traced(traced: Any, model: torch.nn.Module) -> None:
    """Refuses a ``traced`` that is no ``TracedModel``, or that was traced from another model:
    one that lacks a parameter of the model, by name and size."""
    if not isinstance(traced, TracedModel):
        raise TypeError(
            f"ferry.auto: traced: a TracedModel (ferry.trace's, or an earlier ferry.auto's "
            f"traced), got {type(traced).__name__}"
        )
    tensors = traced._tensor_table()
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if size == 0:
            continue  # the trace records no empty tensor
        if name not in tensors:
            raise ValueError(
                f"ferry.auto: traced: it has no parameter {name}: it was traced from another model"
            )
        if tensors[name]["bytes"] != size:
            raise ValueError(
                f"ferry.auto: traced: its parameter {name} has {tensors[name]['bytes']} bytes, "
                f"this model's {size}: it was traced from another model"
            )


def _prefixed(error: PlanError, who: str) -> PlanError:
    """``error`` again, its message starting with ``who``."""
    again = PlanError(f"{who}: {error}")
    for name in ("exit_code", "floor", "smallest_budget", "peak_floor", "device_memory_needed"):
        setattr(again, name, getattr(error, name))
    return again
