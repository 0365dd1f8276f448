"""The costs of a compiled step: a traced document whose chains of fusible ops are timed as the
fused kernels torch.compile makes of them (``ferry.trace(..., compiled=True)``,
docs/trace.md, Compiled steps); and of an eager step whose norms are fused kernels
(``fused_norms=True``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

# Note [Costs of a compiled step]
# torch.compile (Inductor) runs a library kernel for each matmul, convolution, attention and
# collective (an "extern" kernel) and generates one kernel for each chain of pointwise ops,
# reductions, norms, casts and copies between them. The eager trace lists that chain op by op,
# each reading its inputs and writing its outputs; the fused kernel reads what the chain takes
# from outside and writes what leaves it. With `compiled=True` a trace keeps every tensor, op,
# saved list and FLOP count of the eager trace (so memory, plans and checkpoint decisions are
# unchanged) and changes only `bytes` and `backward_bytes`:
#
# * Which ops fuse is decided by what an op is (`OpRecord.fusible` in `_record`): an op with
#   FLOPs from a formula (matmuls, convolutions, attention) is extern, and so is one that moves
#   data without a cost model (collectives, the trace's uncosted ops); every other op is
#   pointwise, a reduction or a copy that Inductor fuses, or a view, which moves nothing.
# * A group is a maximal run of consecutive fusible ops of one layer, in forward order: an extern
#   op or a change of `layer` ends it (compiled regions do not cross layers).
# * Forward bytes of a group: the bytes of the distinct tensors its ops read that it did not
#   produce (activations of other ops, parameters, buffers, inputs), plus the bytes of the
#   distinct tensors it produces that are read by an op outside it, saved for backward by any
#   op, or are the loss. Tensors on one storage count the union of their byte ranges once. Only
#   ops that move data (eager `bytes` or `flops` above 0) read: a view op's read is the read of
#   whoever uses the view, and a view is listed with the op that writes its storage.
# * Backward bytes of a group: the gradient of each of its outputs that needs one, once for each
#   op outside the group that reads it (each consumer's backward writes its own gradient, which
#   the fused backward reads and sums), and of the loss; plus the tensors its ops saved (the
#   union of their ranges); plus a gradient written for each tensor it read from outside that
#   needs one (activations or inputs that require grad, trainable parameters; the union of
#   ranges).
# * The forward bytes go on the group's first op that moves data and the backward bytes on its
#   last one; every other op of the group gets 0 of each. Forward runs the group's ops in order,
#   so its outputs are all ready when the first op's time is over, as a fused kernel's are at its
#   end, and a checkpointed region replaying any of the group replays the first op; backward runs
#   them in reverse, so the last op's node runs first and the tensors the group saved are held
#   until the fused backward is over. Extern ops keep their eager bytes.
#
# Not modelled: which tensors AOTAutograd's partitioner would save (it may recompute a cast or a
# norm in backward rather than save it; the document saves what eager autograd saves), Inductor
# fusing across an extern kernel that does not depend on the chain (SiLU before the up
# projection's matmul and the product after it stay two groups), launch counts and launch
# latency, an in-place op's write to a tensor it did not produce (listed as read, as eager
# counts it), and memory-bound ops Inductor runs as library fallbacks (`nonzero`, some sorts),
# fused here like the others.


# Note [Fused norms]
# Trainers run a norm as one kernel forward and one backward where the model writes it in
# PyTorch ops: torchtitan's `norm_type = "fused_rmsnorm"` (a Triton kernel, its Llama configs of
# April 2024), Liger Kernel's RMSNorm and LayerNorm (`use_liger_kernel` in TRL and axolotl), apex
# and Transformer Engine. With `fused_norms=True` each call of a normalization module is one
# group of Note [Costs of a compiled step], costed as there; nothing else fuses.
#
# * A normalization module is known by what it is, not by its name: a module without
#   submodules whose parameters, at least one, are all vectors (an RMSNorm's weight, a
#   LayerNorm's weight and bias, Gemma's offset scale). A module with a matrix (a projection, an
#   embedding, a convolution) or without parameters (an activation, dropout) is none.
# * A group is a run of consecutive fusible ops of one call (`OpRecord.norm_call`): a library
#   kernel inside the module would end it, as an extern op ends a compiled group.
# * Tensors, saved lists and FLOPs stay the eager trace's, as with `compiled`: a fused RMSNorm
#   saves its input and the per-row statistics where the eager trace lists a float32 copy of
#   the input and the normalized tensor too, so the trace's memory is the eager step's.


def is_normalization(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a normalization (Note [Fused norms]): no submodules, and parameters,
    at least one, that are all vectors."""
    if next(module.children(), None) is not None:
        return False
    shapes = [p.dim() for p in module.parameters(recurse=False)]
    return bool(shapes) and all(d == 1 for d in shapes)


class FusedCosts(NamedTuple):
    """What fusing changed in a document: its groups and its bytes before and after."""

    groups: tuple[range, ...]  #: the op indices of each fused group, in forward order
    bytes_before: int  #: total forward bytes of the eager trace
    bytes_after: int  #: total forward bytes with every group fused
    backward_bytes_before: int  #: total backward bytes of the eager trace
    backward_bytes_after: int  #: total backward bytes with every group fused


def fused_groups(
    ops: Sequence[dict[str, Any]],
    fusible: Sequence[bool],
    norm_calls: Sequence[int | None] | None = None,
) -> list[range]:
    """The groups torch.compile fuses (Note [Costs of a compiled step]), or with ``norm_calls``
    the fused norms (Note [Fused norms]).

    Args:
        ops: The document's ops, in forward order.
        fusible: For each op, whether it is one Inductor fuses (not a library kernel).
        norm_calls: For each op, the call of a normalization module it ran in, or None.

    Returns:
        Each maximal run of consecutive fusible ops of one layer (and of one norm call, with
        ``norm_calls``), as a range of op indices.
    """

    def key(i: int) -> tuple[int, int | None]:
        return ops[i].get("layer", -1), None if norm_calls is None else norm_calls[i]

    def fuses(i: int) -> bool:
        return fusible[i] and (norm_calls is None or norm_calls[i] is not None)

    groups = []
    start = None
    for i in range(len(ops)):
        if start is not None and not (fuses(i) and key(start) == key(i)):
            groups.append(range(start, i))
            start = None
        if fuses(i) and start is None:
            start = i
    if start is not None:
        groups.append(range(start, len(ops)))
    return groups


def span_bytes(tensors: dict[str, dict[str, Any]], names: Iterable[str]) -> int:
    """Bytes of the named tensors (``tensors``: the document's tensors by name), the union of
    their byte ranges on each storage, so that two views of one storage count its bytes once."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        t = tensors[name]
        start = t.get("view_offset", 0)
        ranges.setdefault(t.get("view_of", name), []).append((start, start + t["bytes"]))
    total = 0
    for spans in ranges.values():
        end = 0
        for lo, hi in sorted(spans):
            lo = max(lo, end)
            if hi > lo:
                total += hi - lo
                end = hi
    return total


class _Facts:
    """What the costs of every group read from one document, built once."""

    def __init__(self, document: dict[str, Any], needs_grad: set[str]) -> None:
        self.ops = document["ops"]
        self.tensors = {t["name"]: t for t in document["tensors"]}
        self.loss = document["loss"]
        self.needs_grad = needs_grad
        self.saved = {n for op in self.ops for n in op["saved"]}
        # Each tensor's readers among the ops that move data, each op once.
        self.readers: dict[str, list[int]] = {}
        for i, op in enumerate(self.ops):
            if _moves(op):
                for n in dict.fromkeys(op["inputs"]):
                    self.readers.setdefault(n, []).append(i)

    def root(self, name: str) -> str:
        return self.tensors[name].get("view_of", name)


def _moves(op: dict[str, Any]) -> bool:
    """Whether an op moves data in the eager trace (a view op does not)."""
    return op["bytes"] > 0 or op["flops"] > 0


def _group_costs(facts: _Facts, group: range) -> tuple[int, int]:
    """Forward and backward bytes of one fused group (Note [Costs of a compiled step])."""
    ops, tensors = facts.ops, facts.tensors
    outputs = {n: None for i in group for n in ops[i]["outputs"]}
    produced = {facts.root(n) for n in outputs}
    reads = {
        n
        for i in group
        if _moves(ops[i])
        for n in ops[i]["inputs"]
        if facts.root(n) not in produced
    }
    readers_outside = {n: [j for j in facts.readers.get(n, ()) if j not in group] for n in outputs}
    written = [n for n in outputs if readers_outside[n] or n in facts.saved or n == facts.loss]
    forward = span_bytes(tensors, reads) + span_bytes(tensors, written)

    gradients_in = sum(
        tensors[n]["bytes"] * len(readers_outside[n]) for n in outputs if n in facts.needs_grad
    )
    if facts.loss in outputs:
        gradients_in += tensors[facts.loss]["bytes"]
    group_saved = {n for i in group for n in ops[i]["saved"]}
    gradients_out = [n for n in reads if n in facts.needs_grad]
    backward = gradients_in + span_bytes(tensors, group_saved) + span_bytes(tensors, gradients_out)
    return forward, backward


def fuse(
    document: dict[str, Any],
    fusible: Sequence[bool],
    needs_grad: set[str],
    norm_calls: Sequence[int | None] | None = None,
) -> FusedCosts:
    """Times each group of fusible ops as one fused kernel: rewrites the document's ``bytes``
    and ``backward_bytes`` in place, and nothing else (Note [Costs of a compiled step]); with
    ``norm_calls``, only the norms' groups (Note [Fused norms]).

    Args:
        document: An eager ``ferry.model/1`` document.
        fusible: For each op, whether it is one Inductor fuses.
        needs_grad: The tensors that get a gradient.
        norm_calls: For each op, the call of a normalization module it ran in, or None.

    Returns:
        The groups and the document's bytes before and after.
    """
    ops = document["ops"]
    if len(fusible) != len(ops):
        raise ValueError(f"ferry.trace: {len(fusible)} fusible flags for {len(ops)} ops")
    if norm_calls is not None and len(norm_calls) != len(ops):
        raise ValueError(f"ferry.trace: {len(norm_calls)} norm calls for {len(ops)} ops")
    before = (sum(op["bytes"] for op in ops), sum(op["backward_bytes"] for op in ops))
    groups = fused_groups(ops, fusible, norm_calls)
    facts = _Facts(document, needs_grad)
    costs = [_group_costs(facts, group) for group in groups]
    for group, (forward, backward) in zip(groups, costs):
        movers = [i for i in group if ops[i]["bytes"] > 0] or list(group)
        for i in group:
            ops[i]["bytes"] = 0
            ops[i]["backward_bytes"] = 0
        ops[movers[0]]["bytes"] = forward
        ops[movers[-1]]["backward_bytes"] = backward
    after = (sum(op["bytes"] for op in ops), sum(op["backward_bytes"] for op in ops))
    return FusedCosts(tuple(groups), before[0], after[0], before[1], after[1])
