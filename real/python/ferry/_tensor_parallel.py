"""A model that torch's ``parallelize_module`` parallelized, as ``ferry.auto`` plans it: the
degree read from its DTensor parameters' mesh (``degree_of``), and the whole model's structure
for the trace, with the parallel styles' hooks left out (``whole_model``). The planner then
cuts the traced model for one rank (``--tp``, docs/parallelism.md) and ``ferry.offload``
applies the plan to the rank's modules (Note [A plan for a rank's cut] in ``_plan/_run.py``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _is_fsdp(model: torch.nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def degree_of(model: torch.nn.Module, tp: int | None, who: str) -> int:
    """The tensor-parallel degree of ``model``: the size of the mesh its DTensor parameters
    lie on (``parallelize_module``'s), 1 without any; ``tp``, when given, must be it. ``who``
    starts the messages.

    Raises:
        TypeError: ``tp`` is no positive int.
        ValueError: ``tp`` differs from the model's degree, the parameters lie on several
            meshes or on one of more than one dimension, or the model is sharded by FSDP2.
    """
    if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
        raise TypeError(f"{who}: tp: {tp!r} is not a number of ranks (an int >= 1)")
    meshes = []
    for name, p in model.named_parameters():
        if is_dtensor(p) and all(p.device_mesh != m for _, m in meshes):
            meshes.append((name, p.device_mesh))
    if meshes and _is_fsdp(model):
        raise ValueError(
            f"{who}: the model's parameters are sharded by FSDP2 (fully_shard); ferry.auto "
            "plans a model on one device or one that parallelize_module parallelized (its "
            "DTensor parameters' mesh is tensor parallelism's). For FSDP2, trace the model "
            "before fully_shard (ferry.trace) and plan it with ferry.plan(traced, fsdp=N)"
        )
    if len(meshes) > 1:
        (a, mesh_a), (b, mesh_b) = meshes[:2]
        raise ValueError(
            f"{who}: parameters {a} and {b} lie on different device meshes ({mesh_a} and "
            f"{mesh_b}); tensor parallelism puts all of them on the one mesh given to "
            "parallelize_module"
        )
    degree = 1
    if meshes:
        name, mesh = meshes[0]
        if mesh.ndim != 1:
            raise ValueError(
                f"{who}: parameter {name} lies on a {mesh.ndim}-dimensional device mesh "
                f"({mesh}); ferry.auto plans tensor parallelism over a 1-dimensional one (the "
                "mesh given to parallelize_module)"
            )
        degree = mesh.size()
    if tp is not None and tp != degree:
        found = (
            f"its parameters lie on a mesh of {degree} ranks"
            if meshes
            else "it has no DTensor parameter (parallelize it with parallelize_module first)"
        )
        raise ValueError(
            f"{who}: tp={tp}, but the model is parallelized over {degree} rank(s): {found}; "
            "leave tp out to take the model's"
        )
    return degree


_TENSOR_PACKAGE = os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep + "tensor"


def _is_parallel_style_hook(hook: object) -> bool:
    """Whether ``hook`` is one torch.distributed.tensor registered (a parallel style's input or
    output hook, ``distribute_module``'s)."""
    code = getattr(hook, "__code__", None)
    if code is None:
        return False
    return os.path.abspath(code.co_filename).startswith(_TENSOR_PACKAGE + os.sep)


@contextlib.contextmanager
def whole_model(model: torch.nn.Module) -> Iterator[None]:
    """Runs ``model`` as the model it was before ``parallelize_module``: the hooks its parallel
    styles registered (which lay inputs and outputs out as DTensors) are left out while inside;
    the trace runs its parameters at their global shapes (``_trace``'s fake DTensors)."""
    saved = []
    try:
        for module in model.modules():
            for attribute in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(module, attribute)
                styles = [k for k, hook in hooks.items() if _is_parallel_style_hook(hook)]
                if styles:
                    saved.append((hooks, dict(hooks)))
                    for k in styles:
                        del hooks[k]
        yield
    finally:
        for hooks, before in saved:
            hooks.clear()
            hooks.update(before)
