"""How the ops of a forward are named (docs/trace.md), once for the trace that writes the names
(``_trace/_record.py``) and for ``offload(plan=...)``, which names the real forward's ops the
same way to find them in the plan (``_plan/_run.py``, Note [Naming the real ops]).

An op is named when it returns a tensor or writes one; the others (``prim.device``, sym sizes)
are queries. Its name is ``<module path>/<aten op>``, with ``#k`` where k ops of that name ran
before it in the forward: ``model.layers.3.mlp.down_proj/mm#1``.
"""

from __future__ import annotations

from typing import Any

import torch


def writes(func: torch._ops.OpOverload) -> bool:
    """Whether an op writes one of its arguments (in place or out=)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def is_named(func: Any, outputs: list[torch.Tensor]) -> bool:
    """Whether the op ``func``, which returned the tensors ``outputs``, is named: it returns a
    tensor or writes one."""
    return bool(outputs) or writes(func)


#: The kernels ``F.scaled_dot_product_attention`` runs fused: one call whichever a device picks
#: (by dtype, head size, mask and GPU: fp32 gets the memory-efficient kernel, bf16 on a Hopper
#: cuDNN's), so each is named as the trace, run on the CPU, names the call. A plan made from a
#: trace then finds its attention on any device.
FUSED_ATTENTION = frozenset(
    {
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_scaled_dot_product_flash_attention_for_cpu",
    }
)
TRACED_ATTENTION = "_scaled_dot_product_flash_attention_for_cpu"


class OpNames:
    """The names of one forward's ops, given in the order they run."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}

    def next(self, path: str, func: Any) -> tuple[str, str]:
        """The base name (without ``#k``) and the name of the op ``func`` about to run in the
        module at ``path`` (``""``: the model itself or no module). It is not counted until
        ``count``."""
        packet = getattr(func, "_overloadpacket", None)
        packet = packet.__name__ if packet is not None else func.name()
        if packet in FUSED_ATTENTION:
            packet = TRACED_ATTENTION
        base = f"{path}/{packet}" if path else packet
        count = self._counts.get(base, 0)
        return base, (base if count == 0 else f"{base}#{count}")

    def count(self, base: str) -> None:
        """An op of base name ``base`` ran: the next one is its repeat."""
        self._counts[base] = self._counts.get(base, 0) + 1


def base_of(name: str) -> str:
    """An op's name without its repeat count ``#k``."""
    return name.partition("#")[0]


def path_of(name: str) -> str:
    """The path of the module an op of this name ran in (``""``: none)."""
    return name.rpartition("/")[0]


#: The collectives a rank's cut inserts (docs/parallelism.md, "A rank's model"): the suffix of
#: the op name they are named after, and the ``_c10d_functional`` op that issues each on a rank.
CUT_COLLECTIVES = {
    "tp.all_gather": "all_gather_into_tensor",
    "tp.reduce_scatter": "reduce_scatter_tensor",
    "cp.all_gather": "all_gather_into_tensor",
    "ep.dispatch": "all_to_all_single",
    "ep.combine": "all_to_all_single",
}


def cut_collective(name: str) -> tuple[str, str] | None:
    """For the name of a collective a rank's cut inserted (``<op name>/tp.all_gather``): the
    name of the op it was inserted for and the ``_c10d_functional`` op that issues it on a rank;
    None for any other op."""
    op, _, suffix = name.rpartition("/")
    kind = CUT_COLLECTIVES.get(suffix)
    if not op or kind is None:
        return None
    return op, kind


def op_path(name: str) -> str:
    """The path of the module the op of this plan name runs in: a collective a rank's cut
    inserted runs in the module of the op it was inserted for."""
    collective = cut_collective(name)
    return path_of(collective[0] if collective is not None else name)
