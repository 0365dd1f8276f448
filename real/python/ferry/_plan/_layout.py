"""Where a plan's checkpoint regions lie in the model: each region is the call of one module,
found from the module paths in its ops' names (``regions_of``) and, once the model is known,
moved up past containers that are never called (``called_module``)."""

from __future__ import annotations

import torch

from .._names import op_path
from ._format import fail


def under(path, prefix):
    """Whether the module at ``path`` is the one at ``prefix`` or inside it."""
    return path == prefix or path.startswith(prefix + ".")


class PlanRegion:
    """A checkpoint region of the plan: ops [first, end) of one module's call."""

    def __init__(self, index, first, end, inputs, path):
        self.index = index
        self.first = first
        self.end = end
        self.inputs = inputs
        self.path = path


def _ops_outside(ops, first, end, path):
    """The plan ops outside ``first..end - 1`` that run in the module at ``path``."""
    return [
        i
        for i in list(range(first)) + list(range(end, len(ops)))
        if under(op_path(ops[i]["name"]), path)
    ]


def regions_of(plan):
    """Each region of the plan, with the module whose call it is: the deepest module holding
    all its ops and no op outside it."""
    ops = plan["ops"]
    paths = [op_path(op["name"]) for op in ops]
    regions = []
    for r, region in enumerate(plan.get("regions", [])):
        first, end = region["first_op"], region["end_op"]
        parts = paths[first].split(".") if paths[first] else []
        for p in paths[first + 1 : end]:
            other = p.split(".") if p else []
            k = 0
            while k < min(len(parts), len(other)) and parts[k] == other[k]:
                k += 1
            parts = parts[:k]
        prefix = ".".join(parts)
        outside = _ops_outside(ops, first, end, prefix) if prefix else []
        if not prefix or outside:
            why = (
                f"op {ops[outside[0]]['name']!r} (ops[{outside[0]}]) lies outside it"
                if outside
                else "its ops belong to no one submodule"
            )
            fail(
                f"regions[{r}]",
                f"ops {first}..{end - 1} are not the call of one module "
                f"({why}); a region is applied by checkpointing a module's call",
            )
        regions.append(PlanRegion(r, first, end, region.get("inputs", "keep"), prefix))
    return regions


def _callable(module):
    """Whether calling ``module`` runs code of its own: a container (``ModuleList``,
    ``ModuleDict``) has no forward and is never called; its children are."""
    return type(module).forward is not torch.nn.Module.forward


def called_module(ops, modules, region):
    """The module whose call the region is: the deepest module holding all its ops, or, when
    that one is never called (a container such as a ``ModuleList`` of sublayers, as in T5's
    blocks), the nearest module above it that is, provided it runs no op outside the region."""
    path = region.path
    while path in modules and not _callable(modules[path]):
        path = path.rpartition(".")[0]
        if not path:
            break
    if path == region.path:
        return path
    outside = _ops_outside(ops, region.first, region.end, path)
    if not path or outside:
        why = (
            f"the nearest module called around it, {path!r}, also runs op "
            f"{ops[outside[0]]['name']!r} (ops[{outside[0]}])"
            if outside
            else "no module called around it holds only its ops"
        )
        fail(
            f"regions[{region.index}]",
            f"ops {region.first}..{region.end - 1} lie in {region.path!r}, which is never called "
            f"(a container of modules), and {why}; a region is applied by checkpointing a "
            "module's call",
        )
    return path
