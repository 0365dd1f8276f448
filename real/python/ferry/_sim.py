"""The simulator and planner from Python: ``ferry.simulate``, ``ferry.compare`` and
``ferry.plan`` run them in this process (``ferry._simulator``, the CLI's own code) and return the
documents ``ferry simulate / compare / plan --json`` print, as dicts. ``find_cli`` finds the
``ferry`` CLI binary, which ``python -m ferry`` runs for the CLI's commands."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import time
from typing import Any

from . import _simulator
from ._plan._format import CheckedPlan, PlanError
from ._trace import TracedModel

#: A model to simulate: a bundled preset's name (``llama3-8b-s8192``), a path to a
#: ``ferry.model/1`` file, or a traced model (``ferry.trace``).
ModelSource = str | os.PathLike[str] | TracedModel

#: ``ferry plan``'s exit codes, which ``PlanError.exit_code`` carries: no plan fits; bad input.
EXIT_INFEASIBLE = 1
EXIT_BAD_INPUT = 2

#: The device profile the CLI and these functions use when none is named.
DEFAULT_DEVICE: str = _simulator.default_device

#: The bundled scenarios (devices/, models/) the package ships, else the source tree's.
_PACKAGED_SCENARIOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios")


def scenarios_dir() -> str:
    if os.path.isdir(os.path.join(_PACKAGED_SCENARIOS, "devices")):
        return _PACKAGED_SCENARIOS
    return _simulator.source_scenarios


def model_args(model: ModelSource) -> tuple[str, str | None]:
    """(the name or path errors name it by, the document's text when it is traced)."""
    if isinstance(model, TracedModel):
        return model.document.get("name", "traced model"), model.to_json()
    if isinstance(model, (str, os.PathLike)):
        return os.fspath(model), None
    raise TypeError(
        f"a model is a preset name, a path to a ferry.model/1 file or a TracedModel, got "
        f"{type(model).__name__}"
    )


def byte_count(value: str | int | None, what: str) -> str | int | None:
    """``value``, checked to be a byte count's kind: a string, an integer or None; ``what``
    names the argument in the message. The simulator reads it as ``ferry plan`` reads the
    option, and checks the rest (a blank one too)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
        raise TypeError(
            f'{what}: {value!r} is not a byte count; give a string such as "40GiB" or an '
            "integer number of bytes"
        )
    return value


def read_bytes(value: str | int | None, what: str, required: bool = False) -> Any:
    """``value``, a byte count's text or an int, read and checked once by the simulator as
    ``ferry plan`` reads its option (ValueError for a value it refuses, TypeError for no byte
    count's kind, each naming ``what``): a ``ReadBytes`` that ``run_planner`` hands on as read,
    or None for None unless ``required``. For a caller that must refuse a budget before it does
    anything else (``ferry.auto`` checks it before it traces)."""
    return _simulator.read_bytes(value, what, required=required)


def percentage(value: str | float | None, what: str) -> str | float | None:
    """``value``, checked to be a percentage's kind: a number or its text (or None)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what}: {value!r} is not a percentage (a number or a string like '6%')")
    return value


#: The mesh's keywords of ``simulate``, ``compare`` and ``plan``, in the simulator's order: the
#: fields of ``Mesh``.
MESH_FIELDS: tuple[str, ...] = tuple(_simulator.mesh_fields)


def _mesh_init(self: Any, **fields: Any) -> None:
    """A mesh of the fields given, each left out None (not given)."""
    unknown = [name for name in fields if name not in MESH_FIELDS]
    if unknown:
        raise TypeError(
            f"ferry.Mesh has no field {unknown[0]!r} (its fields: {', '.join(MESH_FIELDS)})"
        )
    for name in MESH_FIELDS:
        object.__setattr__(self, name, fields.get(name))


#: ``ferry.Mesh``: a frozen dataclass whose fields are the binding's mesh keywords.
Mesh = dataclasses.make_dataclass(
    "Mesh",
    [(name, Any, dataclasses.field(default=None)) for name in MESH_FIELDS],
    namespace={"__init__": _mesh_init},
    init=False,
    frozen=True,
)
Mesh.__module__ = __name__
Mesh.__doc__ = """The mesh keywords of ``simulate``, ``compare`` and ``plan`` as one frozen
    value: ``mesh=Mesh(fsdp=8, tp=2)``.

    Fields, each None (not given) when left out: {fields}; the simulator's mesh keywords, in
    its order, each taking what ``simulate`` says it takes. A call that gives a field both in
    its mesh and as a keyword raises TypeError.

    Args:
        **fields: The mesh's fields, by name.

    Raises:
        TypeError: A name that is no field of a mesh.
    """.format(fields=", ".join(f"``{name}``" for name in MESH_FIELDS))


def mesh_options(function: str, mesh: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the fields ``mesh`` gives (a ``Mesh`` or None) added, for ``function``'s
    call: TypeError for a mesh of another type or a field also given in ``options``."""
    if mesh is None:
        return options
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{function}: mesh={mesh!r} is not a ferry.Mesh")
    given = {name: getattr(mesh, name) for name in MESH_FIELDS}
    given = {name: value for name, value in given.items() if value is not None}
    both = [name for name in given if name in options]
    if both:
        raise TypeError(
            f"{function}() got {both[0]!r} both in mesh= and as a keyword argument; give it once"
        )
    return {**options, **given}


def fsdp_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options``, with ``reshard_after_forward`` (when given) checked to be True, False or a
    number of ranks K."""
    value = options.get("reshard_after_forward")
    if value is not None and not isinstance(value, int):
        raise TypeError(
            f"reshard_after_forward: {value!r} is not True, False or a number of ranks (int)"
        )
    return options


def simulate(
    model: ModelSource, device: str = DEFAULT_DEVICE, *, mesh: Mesh | None = None, **options: Any
) -> dict[str, Any]:
    """Simulates training steps of a model under one offload policy (``ferry simulate``).

    Args:
        model: A preset name, a ``ferry.model/1`` file or a ``TracedModel``.
        device: A bundled device profile's name or a profile file.
        mesh: A ``ferry.Mesh``: the mesh keywords below (``fsdp`` to ``pp``) as one value; a
            field given both there and as a keyword is a TypeError.
        **options: The run's options, as ``ferry simulate`` names them: ``policy`` ("none", "trl",
            "trl-seed", "trl-1.7", "ferry"), ``checkpoint`` ("none", "every:K", "selective", ...),
            ``horizon`` ("auto", "none", bytes), ``steps``, ``min_bytes``, ``window_mib``,
            ``prefetch_mib``, ``host_cap_gib``, ``stash``, and the switches ``prefetch``, ``dedup``,
            ``early_stop`` and ``check`` (hazard and content checks), all True by default, and
            ``set_to_none`` (what ``optimizer.zero_grad()`` does between steps: None, the default,
            is torch's, gradients freed, where the run models it (a pipeline keeps them); True asks
            for it (``--set-to-none``); False keeps them from set-up on (``--keep-grads``, as
            ``set_to_none=False`` and Megatron-Core's buffers do)); FSDP2 as ``--fsdp`` sets it:
            ``fsdp`` (ranks), ``nodes``, ``hsdp``, ``reshard_after_forward`` (True, False or K) and
            ``fsdp_impl`` ("fsdp2", "simple": torchtitan's SimpleFSDP, or "fsdp2-torch2.4": torch
            2.4's FSDP2) and ``reduce_dtype`` (the gradients' reduce-scatter dtype: "param", the
            parameters' compute dtype as torch's and accelerate's policies reduce, or "float32",
            torchtitan's), where a traced model's recorded parallelism is the default
            (docs/fsdp.md); ``tp``, tensor parallelism over that many GPUs a rank (``--tp``,
            docs/parallelism.md); ``cp``, context parallelism over that many GPUs a rank, with
            ``fsdp`` (``--cp``); ``ep``, expert parallelism over that many
            GPUs of the shard group and their tensor-parallel ones (a multiple of ``tp``), with
            ``fsdp`` (``--ep``); ``expert_capacity``, a static dispatcher's capacity factor
            (1..1024) that pads each GPU's routed rows, with ``ep`` (``--expert-capacity``; 0:
            none), and ``paged_stash``, Megatron-Core's paged stash of the padded saved tensors
            (``--paged-stash``; docs/parallelism.md, Static capacity and the paged stash); ``pp``, a
            pipeline of that many stages (1..64), each run by that mesh (``--pp``,
            docs/pipeline.md), with ``micro_batches``, ``schedule``, ``virtual_stages``, ``split``
            and ``pipeline_checkpoint`` as their flags; ``allocator``, "default" or "expandable"
            (the caching allocator with ``expandable_segments:True``, where a traced model's
            recorded setting is the default; docs/allocators.md). Numbers have the command line's
            bounds (``steps`` 1..1000, ``stash`` 1..2^20, ``min_bytes`` 0..2^50, ``window_mib`` and
            ``prefetch_mib`` 0..2^30, ``host_cap_gib`` 0..2^20, ``fsdp``, ``nodes`` and ``hsdp``
            1..1000000; None for ``fsdp``, ``nodes`` and ``allocator``: not given). ``trainer``
            ("hf", "torchtitan" or "megatron") with ``trainer_flags`` (that trainer's command-line
            flags, as ``ferry plan --for`` writes them) runs the trainer's own activation
            checkpointing instead of ``policy`` and ``checkpoint`` (``ferry simulate --for T
            --trainer-config FILE``).

    Returns:
        The document ``ferry simulate --json`` prints (``result`` holds the figures, one
        rank's under FSDP).

    Raises:
        ValueError: A model, device or option the simulator refuses; the message is what
            ``ferry simulate`` prints after "error: " (``--steps: 0 is not in 1..1000``).
        TypeError: An option it does not know, or one given both in ``mesh`` and as a keyword.
    """
    options = mesh_options("simulate", mesh, options)
    return simulate_with_snapshot(model, device, False, **options)[0]


def simulate_with_snapshot(
    model: ModelSource, device: str, memory_snapshot: bool, **options: Any
) -> tuple[dict[str, Any], bytes | None]:
    """``simulate``'s run: (the document, the run's PyTorch memory snapshot pickle when
    ``memory_snapshot``, else None)."""
    name, text = model_args(model)
    return _simulator.simulate(
        name,
        text,
        device,
        scenarios_dir(),
        memory_snapshot=memory_snapshot,
        **fsdp_options(options),
    )


def compare(
    model: ModelSource, device: str = DEFAULT_DEVICE, *, mesh: Mesh | None = None, **options: Any
) -> dict[str, Any]:
    """Simulates the fixed configurations of a model side by side (``ferry compare``).

    Args:
        model: A preset name, a ``ferry.model/1`` file or a ``TracedModel``.
        device: A bundled device profile's name or a profile file.
        mesh: A ``ferry.Mesh``, as ``simulate`` takes it.
        **options: ``steps``, ``min_bytes``, ``window_mib``, ``prefetch_mib``,
            ``host_cap_gib``, ``stash``, ``check``, ``set_to_none``, ``paged_stash``,
            ``allocator`` and the mesh options, as ``simulate`` takes them; ``micro_batches``
            (1..1024), ``schedule`` ("1f1b", torchtitan's default, "gpipe", ...) and
            ``virtual_stages``, as ``ferry compare --pp N --micro-batches M --schedule S
            --virtual-stages V`` takes them: with ``pp`` > 1 the pipeline configurations too,
            each stage on the mesh asked for.
            ``split`` cuts the model into stages as ``--split`` does: ``"layers"`` (the
            default), ``"balanced"`` or the layer each stage after the first starts at
            (``"8,16,24"``).

    Returns:
        The document ``ferry compare --json`` prints: one row per configuration, and the
        pipeline rows under "pipeline" when ``pp`` > 1.

    Raises:
        ValueError: A model, device or option the simulator refuses; the message names it.
        TypeError: An option it does not know, or one given both in ``mesh`` and as a keyword.
    """
    options = mesh_options("compare", mesh, options)
    name, text = model_args(model)
    return _simulator.compare(name, text, device, scenarios_dir(), **fsdp_options(options))


def plan(
    model: ModelSource,
    budget: str | int | None = None,
    device: str = DEFAULT_DEVICE,
    host_budget: str | int | None = None,
    steps: int = 2,
    margin: str | float | None = None,
    trainer: str | None = None,
    *,
    mesh: Mesh | None = None,
    **fsdp: Any,
) -> dict[str, Any]:
    """The fastest keep / offload / recompute plan whose peak reserved memory fits a budget
    (``ferry plan``).

    Args:
        model: A preset name, a ``ferry.model/1`` file or a ``TracedModel``. A traced model
            keeps its planner (``TracedModel.planners``): planning it again at another budget,
            with the same device, steps and parallelism, reuses the simulations earlier budgets
            ran, and gives the plan a fresh planner gives or a faster one an earlier, smaller
            budget found.
        budget: Peak reserved device memory: ``"40GiB"``, bytes, ...; None: the device's.
        device: A bundled device profile's name or a profile file.
        host_budget: The pinned host memory budget, as ``budget``; None: no limit.
        steps: Training steps per simulation, 1..100 (the last is measured).
        margin: Plan to the budget less this percent of it, 0..50 with at most one decimal
            (``6``, ``5.5``, ``"6%"``); None: the default that docs/validation.md's table
            supports (docs/plan.md, "What fits promises").
        trainer: ``"hf"``, ``"torchtitan"`` or ``"megatron"`` (``ferry plan --for``): the
            report's ``"trainer"`` member is also the fastest setting of that trainer's own
            activation checkpointing that fits, as its configuration and command-line flags,
            with every setting of its space (docs/plan.md, "A trainer's own settings"); a
            budget none of them fits is refused (``PlanError``, ``floor`` the smallest
            budget at which some setting fits). None: ferry's plan only.
        mesh: A ``ferry.Mesh``, as ``simulate`` takes it: the mesh keywords of ``**fsdp``.
        **fsdp: FSDP2, as ``simulate`` takes it (``fsdp``, ``nodes``, ``hsdp``,
            ``reshard_after_forward``, ``fsdp_impl``, ``reduce_dtype``): the plan is one rank's,
            ``budget`` per rank and ``host_budget`` per node; ``tp``, ``cp``, ``ep`` and
            ``expert_capacity``
            (where it pads the routed rows, the plan is the faster of those with and without
            the paged stash); and ``allocator`` as ``simulate`` takes it. ``pp`` (2 or more),
            ``micro_batches``, ``schedule`` (or ``"auto"``) and ``virtual_stages`` plan a
            pipeline instead, each stage on the mesh asked for: the report is a
            ``ferry.pipeline-plan/1`` document (docs/plan.md, "A pipeline"); ``split`` as
            ``compare`` takes it.

    The planner runs ``FERRY_JOBS`` simulations at once (unset or 0: one per hardware
    thread; the plan is the same for any count), and while stderr is a terminal it shows its
    progress there on one line, erased when it is done.

    Returns:
        The report ``ferry plan --json`` prints; the plan itself is under ``"plan"`` (what
        ``ferry plan --out`` writes), checked: ``ferry.offload(plan=...)`` takes it as it is.

    Raises:
        PlanError: No plan fits the budget (``exit_code`` 1; ``floor`` the smallest budget
            that plans, in bytes: the smallest peak reserved the planner reached, ``peak_floor``,
            with the margin added back, so ``budget=e.floor`` plans; None where no budget on the
            device plans, the message saying what would, or none is known), or the planner
            refuses the model, device or budget (``exit_code`` 2, the rest None).
        TypeError: A budget that is no byte count, or a keyword given both in ``mesh`` and
            as a keyword.
    """
    fsdp = mesh_options("plan", mesh, fsdp)
    budget = byte_count(budget, "budget")
    host_budget = byte_count(host_budget, "host_budget")
    margin = percentage(margin, "margin")
    if trainer is not None:
        fsdp["trainer"] = trainer
    return run_planner(model, budget, device, host_budget, steps, margin, **fsdp)["report"]


def run_planner(
    model: ModelSource,
    budget: Any,
    device: str,
    host_budget: Any,
    steps: int = 2,
    margin: str | float | None = None,
    **fsdp: Any,
) -> dict[str, Any]:
    """``plan``'s run: {report (with the plan under "plan", a ``CheckedPlan`` carrying the
    ``ferry.offload`` options the planner lowered it to), text (what ``ferry plan`` prints),
    plan_text (what ``ferry plan --out`` writes), offload_options (those options)}. The
    caller read ``budget`` and ``host_budget`` with ``read_bytes`` (taken as read), or
    checked their kinds with ``byte_count`` (their values are then the request layer's to
    check), and checked ``margin``'s kind with ``percentage``, under its own names."""
    name, text = model_args(model)
    planners = None
    if isinstance(model, TracedModel):
        # Planning a traced model again (another budget) reuses its earlier simulations.
        if model.planners is None:
            model.planners = _simulator.PlannerCache()
        planners = model.planners
    line = ProgressLine() if sys.stderr.isatty() else None
    try:
        made = _simulator.plan(
            name,
            text,
            device,
            scenarios_dir(),
            budget=budget,
            host_budget=host_budget,
            steps=steps,
            margin=margin,
            planners=planners,
            jobs=planner_jobs(),
            progress=line,
            **fsdp_options(fsdp),
        )
    except ValueError as e:
        error = PlanError(f"ferry plan: {e}")
        error.exit_code = EXIT_BAD_INPUT
        raise error from None
    finally:
        if line is not None:
            line.clear()
    if "refused" in made:
        raise refusal_error(made["document"])
    if "offload_options" in made:
        made["report"]["plan"] = CheckedPlan(made["report"]["plan"], made["offload_options"])
    return made


def refusal_error(document: dict[str, Any]) -> PlanError:
    """The ``PlanError`` of a ``ferry.plan-refusal/1`` document: its message and its floor
    (the smallest budget that plans), as ``ferry plan --json`` names them."""
    error = PlanError(f"ferry plan refused: {document['refusal']}")
    error.exit_code = EXIT_INFEASIBLE
    error.floor = error.smallest_budget = document["floor_bytes"]
    error.peak_floor = document["peak_floor_bytes"]
    error.device_memory_needed = document["device_memory_needed_bytes"]
    return error


def planner_jobs() -> int:
    """FERRY_JOBS: the simulations the planner runs at once, 1..1024; unset or 0: one per
    hardware thread. The plan is the same for any count."""
    text = os.environ.get("FERRY_JOBS", "").strip()
    if not text:
        return 0
    try:
        jobs = int(text)
    except ValueError:
        jobs = -1
    if not 0 <= jobs <= 1024:
        raise ValueError(
            f"FERRY_JOBS: {text!r} is not a number of simulations at once: give 1..1024, "
            "or 0 for one per hardware thread"
        )
    return jobs


class ProgressLine:
    """The planner's progress as one line on stderr, a terminal (``ferry plan``'s): the
    search's stage, the plans it asked about (of how many, where it knows) and the fastest
    plan that fits so far, redrawn at most every tenth of a second; ``clear`` erases it."""

    def __init__(self) -> None:
        self._shown_at = -1.0
        self._shown = False

    def __call__(self, stage: str, done: int, total: int, best_ns: int | None) -> None:
        now = time.monotonic()
        if self._shown_at >= 0 and now - self._shown_at < 0.1:
            return
        self._shown_at = now
        line = f"ferry plan: {stage}"
        if done > 0 or total > 0:
            line += f" {done}/{total}" if total > 0 else f" {done}"
        if best_ns is not None:
            line += f", best {best_ns / 1e6:.1f} ms"
        sys.stderr.write(f"\r\033[K{line}")
        sys.stderr.flush()
        self._shown = True

    def clear(self) -> None:
        if self._shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self._shown = False


#: The CLI binary the package ships (copied from the CMake build at install).
PACKAGED_CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ferry")


def _is_script(path: str) -> bool:
    """Whether the file at ``path`` is an interpreted script (``#!``), not the CLI binary."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


class CliNotFound(Exception):
    """The ``ferry`` CLI binary is not where FERRY_CLI, the package or PATH say."""


def find_cli() -> str:
    """The path of the ``ferry`` CLI binary.

    Returns:
        ``$FERRY_CLI`` when set, else the package's ``ferry/bin/ferry``, else ``ferry`` on
        ``PATH``.

    Raises:
        CliNotFound: None is there; the message names every place searched.
    """
    named = os.environ.get("FERRY_CLI")
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise CliNotFound(f"FERRY_CLI={named} is not an executable file")
    if os.path.isfile(PACKAGED_CLI) and os.access(PACKAGED_CLI, os.X_OK):
        return PACKAGED_CLI
    on_path = shutil.which("ferry")
    # The package's own console script is named ferry too; it runs this function again.
    if on_path and not _is_script(on_path):
        return on_path
    raise CliNotFound(
        "the ferry CLI binary was not found: FERRY_CLI is not set, the package has no "
        f"{PACKAGED_CLI} (it ships one when installed from a CMake build that has the ferry "
        "target), and no `ferry` binary is on PATH"
    )
