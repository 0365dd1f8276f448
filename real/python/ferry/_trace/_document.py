"""The traced model: the ``ferry.model/1`` document a trace writes, and the counts taken on the
way (docs/trace.md)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from ._compiled import FusedCosts, fuse, span_bytes
from ._record import DTYPES, FORMAT, OpRecord, TensorRecord, Tracer, byte_count


class TracedModel:
    """A traced model: the ``ferry.model/1`` document and what the trace counted on the way.

    ``document`` is the JSON object (a dict with the format's key order). ``packed_count`` and
    ``packed_bytes`` are the saved tensors the pack hook received (logical bytes, each pack
    counted), ``optimizer_state_bytes`` the optimizer state written as static memory, and
    ``unattributed_backward_flops`` the FLOPs of backward ops run by no forward op's node
    (gradient accumulation), which no op carries, and ``uncosted`` the operators, forward or
    backward, that move data but have no cost model (Note [What an op costs] in ``_costs``),
    each with its number of calls: their time is counted too low. ``compiled`` is what fusing
    changed where the costs are a compiled step's (``ferry.trace(..., compiled=True)``) or its
    norms are fused (``fused_norms=True``), else None. ``planners`` are the planners
    ``ferry.plan`` and ``ferry.auto`` keep for the model, made at its first plan: planning it
    again at another budget reuses the simulations the earlier budgets ran (a copy or a pickle
    starts without them).

    Args:
        document: The ``ferry.model/1`` document.
        packed_count: Saved tensors the pack hook received.
        packed_bytes: Their logical bytes, each pack counted.
        optimizer_state_bytes: The optimizer state written as static memory.
        unattributed_backward_flops: Backward FLOPs no op carries.
        uncosted: Operator name (``aten._grouped_mm.default``) -> calls with no cost model.
        compiled: The fused groups and the bytes before and after, for a compiled step or fused
            norms.
    """

    def __init__(
        self,
        document: dict[str, Any],
        packed_count: int = 0,
        packed_bytes: int = 0,
        optimizer_state_bytes: int = 0,
        unattributed_backward_flops: int = 0,
        uncosted: dict[str, int] | None = None,
        compiled: FusedCosts | None = None,
    ) -> None:
        self.document = document
        self.packed_count = packed_count
        self.packed_bytes = packed_bytes
        self.optimizer_state_bytes = optimizer_state_bytes
        self.unattributed_backward_flops = unattributed_backward_flops
        self.uncosted = dict(uncosted or {})
        self.compiled = compiled
        self.routing: dict[str, Any] | None = None
        # The planners ferry.plan and ferry.auto keep for this model (a PlannerCache, made at
        # its first plan): a later budget reuses the simulations earlier ones ran.
        self.planners: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # A copy or a pickle plans afresh: the planners are the simulator's, not copyable.
        state = dict(self.__dict__)
        state["planners"] = None
        return state

    def to_json(self) -> str:
        """The document as text.

        Returns:
            JSON with a two-space indent, keys in the format's order and a final newline. The
            same model and inputs give the same bytes.
        """
        return json.dumps(self.document, indent=2, ensure_ascii=True) + "\n"

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes ``to_json()`` to ``path``.

        Args:
            path: The file to write.
        """
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.write(self.to_json())

    def _tensor_table(self) -> dict[str, dict[str, Any]]:
        return {t["name"]: t for t in self.document["tensors"]}

    def saved_bytes(
        self,
        layer: int | None = None,
        roles: Iterable[str] = ("activation",),
        logical: bool = False,
    ) -> int:
        """Bytes saved for backward by the ops of ``layer``, of tensors of the given roles.

        Args:
            layer: A layer index; None: all ops.
            roles: The roles of the tensors counted.
            logical: False: the storage they hold, the union of the byte ranges saved in each
                storage, so that two views of one storage (the input of the q, k and v
                projections) count once. True: each tensor with its own bytes, once, as
                ``saved_activation_bytes`` does.

        Returns:
            The bytes.
        """
        tensors = self._tensor_table()
        chosen = {}
        for op in self.document["ops"]:
            if layer is not None and op.get("layer", -1) != layer:
                continue
            for name in op["saved"]:
                if tensors[name]["role"] in roles:
                    chosen[name] = tensors[name]
        if logical:
            return sum(t["bytes"] for t in chosen.values())
        return span_bytes(tensors, chosen)

    def flops(self, layer: int | None = None) -> tuple[int, int]:
        """Forward and backward FLOPs of the ops of ``layer``.

        Args:
            layer: A layer index; None: all ops.

        Returns:
            (forward FLOPs, backward FLOPs).
        """
        ops = [op for op in self.document["ops"] if layer is None or op.get("layer", -1) == layer]
        return sum(op["flops"] for op in ops), sum(op["backward_flops"] for op in ops)

    def layers(self) -> list[int]:
        """The layer indices that occur.

        Returns:
            The indices, in increasing order.
        """
        return sorted({op["layer"] for op in self.document["ops"] if "layer" in op})


def traced_model(
    tracer: Tracer,
    name: str,
    loss: torch.Tensor,
    state: dict[str, torch.Tensor],
    optimizer_state: Any,
    compiled: bool = False,
    fused_norms: bool = False,
) -> TracedModel:
    """The ``TracedModel`` of a finished trace: its ops, the tensors they name, the optimizer
    state as static memory, and the loss; with ``compiled``, each group of fusible ops costs
    what its fused kernel moves (Note [Costs of a compiled step] in ``_compiled``), with
    ``fused_norms`` each norm's (Note [Fused norms])."""
    ops = [op for op in tracer.ops if _kept(op)]
    loss_record = tracer.tensors.get(id(loss))
    if loss_record is None or loss_record.producer is None:
        raise ValueError("ferry.trace: the loss was not produced by a traced op")
    if not ops or loss_record not in ops[-1].outputs:
        # Ops ran after the loss (a detach, a cast for logging): a last op hands the loss on.
        last = OpRecord("loss", -1, False, False)
        last.inputs.append(loss_record)
        record = TensorRecord(
            tracer._unique("loss"), None, loss_record.dtype, loss_record.bytes, "activation"
        )
        tracer.order.append(record)
        last.outputs.append(record)
        ops.append(last)
        loss_record = record
    static = []
    param_names = {id(t): n for n, t in state.items()}
    optimizer_bytes = 0
    by_name = sorted(optimizer_state.items(), key=lambda kv: param_names.get(id(kv[0]), ""))
    for p, entries in by_name:
        owner = param_names.get(id(p), "param")
        for key in sorted(entries):
            value = entries[key]
            # Scalars (Adam's step count) live on the host unless the optimizer is capturable.
            if isinstance(value, torch.Tensor) and value.dim() > 0 and byte_count(value) > 0:
                dtype = DTYPES.get(value.dtype, "u8")
                static.append(
                    {
                        "name": tracer._unique(f"optimizer.{owner}.{key}"),
                        "bytes": byte_count(value),
                        "dtype": dtype,
                        "role": "optimizer_state",
                    }
                )
                optimizer_bytes += byte_count(value)
    used = set()
    for op in ops:
        for record in op.inputs + op.outputs + op.saved:
            used.add(id(record))
            if record.view_of is not None:
                used.add(id(record.view_of))
    tensors = []
    for record in tracer.order:
        # What the model holds stays, read or not (it is memory); a constant or an activation
        # only where an op names it.
        held = record.role != "activation" and id(record) not in tracer.constants
        if held or id(record) in used:
            tensors.append(_tensor_json(record))
    tensors.extend(static)
    offsets = tracer.layer_offsets()
    document = {
        "format": FORMAT,
        "name": name,
        "tensors": tensors,
        "ops": [_op_json(op, tracer.rng, offsets) for op in ops],
        "loss": loss_record.name,
    }
    fused = None
    if compiled or fused_norms:
        norm_calls = None if compiled else [op.norm_call for op in ops]
        fusible = [op.fusible for op in ops]
        fused = fuse(document, fusible, _needs_grad(tracer.order), norm_calls)
    packed_bytes = sum(byte_count(p.tensor) for p in tracer.packs)
    return TracedModel(
        document,
        len(tracer.packs),
        packed_bytes,
        optimizer_bytes,
        tracer.unattributed_backward_flops,
        dict(sorted(tracer.uncosted.items())),
        fused,
    )


def _needs_grad(records: list[TensorRecord]) -> set[str]:
    """The tensors that get a gradient: trainable parameters, and activations (or inputs) that
    require grad (the base of a storage first met through a view: where one of its views
    does)."""
    names = set()
    for record in records:
        grad = record.role == "param" or (record.ref is not None and record.ref.requires_grad)
        if grad:
            names.add(record.name)
            if record.view_of is not None and record.view_of.ref is None:
                names.add(record.view_of.name)
    return names


def _kept(op):
    return bool(
        op.outputs
        or op.saved
        or op.rng
        or op.flops
        or op.bytes
        or op.backward_flops
        or op.backward_bytes
    )


def _tensor_json(record):
    out = {"name": record.name, "bytes": record.bytes, "dtype": record.dtype, "role": record.role}
    if record.view_of is not None:
        out["view_of"] = record.view_of.name
        out["view_offset"] = record.view_offset
    return out


def _op_json(op, rng, offsets):
    out = {"name": op.name}
    if op.kind is not None:
        out["kind"] = op.kind
    if op.layer != -1:
        out["layer"] = op.layer + (offsets[op.stack] if op.stack is not None else 0)
    out["flops"] = op.flops
    out["bytes"] = op.bytes
    out["backward_flops"] = op.backward_flops
    out["backward_bytes"] = op.backward_bytes
    out["inputs"] = [r.name for r in op.inputs]
    out["outputs"] = [r.name for r in op.outputs]
    out["saved"] = [r.name for r in op.saved]
    if op.head:
        out["no_offload"] = True
    if op.rng:
        out["draws_rng" if rng == "device" else "draws_cpu_rng"] = True
    if op.gemm is not None and 2 * math.prod(op.gemm.values()) == op.flops:
        out["gemm"] = op.gemm
    if op.group_rows is not None:
        out["group_rows"] = op.group_rows
    return out
