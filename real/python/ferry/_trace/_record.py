"""What a trace records: every aten op forward runs, every tensor it meets (with storages and
views followed), every tensor autograd saves and which op saved it, and the backward ops of
each op's node (docs/trace.md). ``ferry._trace.trace`` drives it; ``_document`` writes the
document. Free of ``ferry._C``: tracing needs torch only.
"""

from __future__ import annotations

import collections
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._names import OpNames, is_named, writes
from ._costs import costed_by_bytes, flop_table, gemm_shape, moves_data, storage_key

FORMAT = "ferry.model/1"

# The format's dtypes. Any other dtype is written as u8 of the same byte count (bool masks, int32
# indices, float64): the bytes are what the simulator allocates and copies.
DTYPES = {
    torch.float32: "f32",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.uint8: "u8",
    torch.int64: "i64",
}
_ELEMENT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "u8": 1, "i64": 8}

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_of(path: str) -> int:
    """The layer index of a module path.

    Args:
        path: A module path such as ``"model.layers.3.mlp"``.

    Returns:
        Its first integer component (-1 if none).
    """
    stack = layer_stack_of(path)
    return -1 if stack is None else stack[1]


def layer_stack_of(path: str) -> tuple[str, int] | None:
    """The stack of layers a module path is in, and its index there.

    Args:
        path: A module path such as ``"model.encoder.block.3.layer.0"``.

    Returns:
        The path up to its first integer component and that integer
        (``("model.encoder.block.", 3)``); None if it has none.
    """
    match = _LAYER.search(path)
    return (path[: match.start(1)], int(match.group(1))) if match else None


# Note [Layers of several stacks]
# A layer is an element of a stack of repeated blocks: the first integer of a module path
# indexes it. A model may run several stacks: an encoder-decoder its encoder's blocks, then its
# decoder's; a vision-language model its vision tower's, then its language model's. Their
# indices restart at 0, but their layers are different modules, saving different tensors, so
# each stack's layers are numbered after those of the stacks that ran before it (in the order
# of their first ops): a T5 of 6 + 6 blocks has layers 0..5 (encoder) and 6..11 (decoder). A
# model of one stack keeps its indices.


def byte_count(t: torch.Tensor) -> int:
    """The tensor's logical bytes (elements times element size)."""
    return t.numel() * t.element_size()


# Note [Strided views]
# The format models a view as a contiguous byte range of its base. Q, K and V split out of a
# fused projection are strided: each row of the base holds a piece of every one of them. At
# their storage offsets (0, h, 2h elements) they would be three ranges that nearly coincide,
# and a count of the storage they hold would find one third of it. So a view whose rows are
# narrower than its base's (its innermost contiguous dims span fewer elements than the next
# stride, the row) stands for the slice of the base at the fraction its first column is of the
# row: Q the first third, K the second, V the last, as the generator lays them out.


def _view_offset(t, offset, base_bytes):
    # The dims by stride; the innermost ones that are contiguous with each other make a row.
    dims = sorted((st, n) for st, n in zip(t.stride(), t.shape) if n > 1 and st > 0)
    if not dims or dims[0][0] != 1:
        return offset
    width = 1
    for stride, size in dims:
        if stride != width:
            break
        width *= size
    else:
        return offset  # contiguous
    row = stride
    column = t.storage_offset() % row
    return column * base_bytes // row // t.element_size() * t.element_size()


class TensorRecord:
    """One tensor of the document: a Python tensor object the trace met."""

    __slots__ = ("name", "ref", "dtype", "bytes", "role", "view_of", "view_offset", "producer")

    def __init__(self, name, ref, dtype, nbytes, role, view_of=None, view_offset=0):
        self.name = name
        self.ref = ref  # keeps the object alive, so that ids and storages stay unique
        self.dtype = dtype
        self.bytes = nbytes
        self.role = role
        self.view_of = view_of  # the base TensorRecord, or None
        self.view_offset = view_offset
        self.producer = None  # index of the op that produced it (activations)


class OpRecord:
    __slots__ = (
        "name",
        "kind",
        "layer",
        "head",
        "inputs",
        "outputs",
        "saved",
        "flops",
        "bytes",
        "backward_flops",
        "backward_bytes",
        "gemm",
        "group_rows",
        "rng",
        "fusible",
        "norm_call",
        "out_refs",
        "mine",
        "stack",
    )

    def __init__(self, name, layer, head, mine, kind=None):
        self.name = name
        self.kind = kind  # the operator, "aten.mm.default" (docs/model-format.md); None: unknown
        self.layer = layer
        self.head = head
        self.mine = mine  # the trace's pack hook was the innermost when the op ran
        self.stack = None  # the stack of layers ``layer`` indexes (Note [Layers of several stacks])
        self.inputs = []
        self.outputs = []
        self.saved = []
        self.flops = 0
        self.bytes = 0
        self.backward_flops = 0
        self.backward_bytes = 0
        self.gemm = None  # {"m", "n", "k", "batch"} of a matmul (docs/model-format.md)
        self.group_rows = None  # a grouped matmul's rows per expert, where routing gave them
        self.rng = False
        # An op torch.compile fuses with its neighbours rather than a library kernel (Note
        # [Costs of a compiled step] in ``_compiled``).
        self.fusible = False
        # The call of a normalization module the op ran in (``Tracer.norm_calls``), else None.
        self.norm_call = None
        self.out_refs = []


def operator_name(func) -> str:
    """The operator as ``namespace.name.overload`` (``aten.mm.default``), or
    ``higher_order.<name>`` for a higher-order operator (flex attention)."""
    if isinstance(func, torch._ops.OpOverload):
        return str(func)
    return f"higher_order.{func.name()}"


# The CPU kernels a trace runs where a device runs another with the same saved tensors and
# count (docs/trace.md, Limits): with target="device" the document names the device's.
_DEVICE_KERNELS = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (
        "aten._scaled_dot_product_flash_attention.default"
    ),
}


class TraceRecorder(TorchDispatchMode):
    """Hands every aten op, with its arguments and result, to the tracer."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values = self.tracer.values
        if values is None:
            out = func(*args, **kwargs)
        else:
            where = self.tracer.modules[-1] if self.tracer.modules else ""
            out = values.run(func, args, kwargs, where)
        self.tracer.on_op(func, args, kwargs, out)
        return out


# Note [Views are produced where their storage is written]
# In the format the op that produces a tensor writes it. A view op (view, transpose, split,
# expand) writes nothing: its output aliases a storage an earlier op wrote. So a view is listed
# among the outputs of the op that wrote its storage, which the format allows ("a view is
# produced by the op that produces its base or by a later one"), and the view op only reads.
# Listed as the view op's output, the view would be written again while an offloader may be
# copying the storage, a race the simulator's hazard checker rightly reports.


class _Packed:
    """What the pack hook returns: the tensor and the op that was last to run when it was
    packed (the fallback owner)."""

    __slots__ = ("tensor", "index", "after_op")

    def __init__(self, tensor, index, after_op):
        self.tensor = tensor
        self.index = index
        self.after_op = after_op


# Note [Which op saved a tensor]
# The pack hook runs inside the autograd kernel of an op: before the op is dispatched for the
# inputs it saves and after for its outputs, so the order of hooks and dispatches alone cannot
# tell whether a tensor packed between two ops is the output the first saves or the input the
# second saves. The graph can: every packed tensor is held by one node, and reading a node's
# `_saved_*` attributes calls the unpack hook with what the pack hook returned. So each op's
# node (its outputs' grad_fn) is asked for its saved tensors once it is complete, and what it
# unpacks is that op's. Nodes of ops run under another pack hook (a checkpointed region) are
# never asked: their unpack would recompute. A pack no node claims (a custom Function's saved
# tensors, whose node sits on a tensor an earlier op produced) goes to the op that ran last
# before it, which then reads the tensor.


class Tracer:
    def __init__(self, rng):
        self.rng = rng  # "device" or "cpu": which generator random ops draw from
        self.tensors = {}  # id(tensor) -> TensorRecord
        self.order = []  # TensorRecord in declaration order
        self.storages = {}  # storage key -> the base TensorRecord of that storage
        self.names = set()
        self.ops = []
        self.op_names = OpNames()
        self.modules = []  # stack of module paths
        # Note [Layers of several stacks]: stack -> its largest index, in the order of the
        # stacks' first ops.
        self.layer_stacks = {}
        # Beside each module on that stack: a number for this call where the module is a
        # normalization (Note [Fused norms] in ``_compiled``), else None.
        self.norm_calls = []
        self.norm_call_count = 0
        self.heads = 0  # depth inside the output head
        self.phase = "forward"
        self.packs = []
        self.claimed = {}  # pack index -> op index
        self.claiming = None
        self.nodes = {}  # id(node) -> op index
        self.node_refs = []
        self.pending = 0  # the first op whose node is not yet asked
        self.later = []  # ops asked once without a node, asked again at the end of forward
        self.constants = set()  # ids of the _Tensors first met as arguments of an op
        self.flop_table = flop_table()
        self.unattributed_backward_flops = 0
        self.uncosted = collections.Counter()  # operator -> calls with no cost model
        self.values = None  # the values known beside the fake tensors (``_values.Values``)

    def layer_offsets(self) -> dict[str, int]:
        """Each stack's first layer number: the layers of the stacks that ran before it
        (Note [Layers of several stacks])."""
        offsets = {}
        offset = 0
        for stack, most in self.layer_stacks.items():
            offsets[stack] = offset
            offset += most + 1
        return offsets

    # Tensors ---------------------------------------------------------------------------

    def _unique(self, name):
        candidate, k = name, 1
        while candidate in self.names:
            candidate = f"{name}#{k}"
            k += 1
        self.names.add(candidate)
        return candidate

    def declare(self, t, name, role):
        """Declares a tensor the model holds before forward (input, param, buffer)."""
        if id(t) in self.tensors:
            return self.tensors[id(t)]
        return self._register(t, name, role)

    def _register(self, t, name, role):
        dtype = DTYPES.get(t.dtype, "u8")
        esz = _ELEMENT_BYTES[dtype]
        nbytes = byte_count(t)
        if nbytes == 0:
            return None
        key = storage_key(t)
        storage_bytes = t.untyped_storage().nbytes()
        offset = t.storage_offset() * t.element_size()
        base = self.storages.get(key)
        if base is None and (offset != 0 or nbytes != storage_bytes):
            base_dtype = dtype if storage_bytes % esz == 0 else "u8"
            base = TensorRecord(
                self._unique(name + ".storage"), None, base_dtype, storage_bytes, role
            )
            self.order.append(base)
            self.storages[key] = base
        if base is not None and base.role == "input":
            # The simulator binds inputs by their own storage: a view of an input (labels
            # reshaped) is written as an input of its own, of the same bytes.
            record = TensorRecord(self._unique(name), t, dtype, nbytes, "input")
        elif base is None:
            record = TensorRecord(self._unique(name), t, dtype, nbytes, role)
            self.storages[key] = record
        else:
            # A view: the byte range of its base it stands for (Note [Strided views]),
            # clipped to the base (an expanded view covers fewer bytes than its elements).
            offset = _view_offset(t, offset, base.bytes)
            offset = min(offset, base.bytes - esz) if base.bytes >= esz else 0
            size = min(nbytes, base.bytes - offset) // esz * esz
            if size == 0:
                dtype, size = "u8", min(nbytes, base.bytes - offset)
            record = TensorRecord(self._unique(name), t, dtype, size, base.role, base, offset)
        self.tensors[id(t)] = record
        self.order.append(record)
        return record

    def _lookup_input(self, t):
        record = self.tensors.get(id(t))
        if record is None:
            # A tensor the model holds outside its parameters and buffers (a constant), or a
            # view of an activation made where the trace does not see (then it is produced with
            # its base).
            record = self._register(t, "constant", "buffer")
            if record is not None:
                self.constants.add(id(record))
            if record is not None and record.role == "activation":
                base = record.view_of
                if base is not None and base.producer is not None:
                    record.producer = base.producer
                    self.ops[base.producer].outputs.append(record)
        return record

    # Ops ---------------------------------------------------------------------------------

    def on_op(self, func, args, kwargs, out):
        if self.phase == "backward":
            self._on_backward_op(func, args, kwargs, out)
            return
        if self.phase != "forward":
            return
        flat_out = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not is_named(func, flat_out):
            # A query (prim.device, sym sizes): no op. It may run inside another op's autograd
            # kernel, before that op's node exists, so it must not ask for nodes either.
            return
        if not getattr(func, "is_view", False):
            # A view op may run inside another op's autograd kernel too: an op writing in place
            # to a view has autograd replay the view (DeepSeek-V3's attention fills two slices
            # of a new tensor) while it holds the view's lock, which asking the view for its
            # node would take again. A view saves nothing; its node is asked at the next op.
            self._ask_nodes(complete=False)
        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        path = self.modules[-1] if self.modules else ""
        base_name, name = self.op_names.next(path, func)
        self.op_names.count(base_name)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        mine = top is not None and getattr(top[0], "__self__", None) is self
        kind = operator_name(func)
        if self.rng == "device":
            kind = _DEVICE_KERNELS.get(kind, kind)
        stack = layer_stack_of(path)
        op = OpRecord(name, -1 if stack is None else stack[1], self.heads > 0, mine, kind)
        if stack is not None:
            op.stack = stack[0]
            self.layer_stacks[stack[0]] = max(self.layer_stacks.get(stack[0], -1), stack[1])
        op.norm_call = self.norm_calls[-1] if self.norm_calls else None
        seen = set()
        traffic = 0
        for t in flat_in:
            if id(t) in seen:
                continue
            seen.add(id(t))
            record = self._lookup_input(t)
            if record is not None:
                op.inputs.append(record)
            traffic += byte_count(t)
        fresh = 0
        for k, t in enumerate(flat_out):
            if id(t) in self.tensors:  # an in-place op returns its input
                continue
            suffix = ".out" if len(flat_out) == 1 else f".out{k}"
            known_storage = storage_key(t) in self.storages
            record = self._register(t, name + suffix, "activation")
            if record is None:
                continue
            if not known_storage:
                fresh += byte_count(t)
            if record.role == "activation":
                base = record.view_of
                if base is not None and base.producer is None:
                    base.producer = len(self.ops)  # the storage this op allocated
                    op.outputs.append(base)
                if base is not None and base.producer != len(self.ops):
                    # A view of a storage an earlier op wrote (Note [Views are produced where
                    # their storage is written]).
                    record.producer = base.producer
                    self.ops[base.producer].outputs.append(record)
                else:
                    record.producer = len(self.ops)
                    op.outputs.append(record)
        op.out_refs = flat_out
        # A view, an in-place change of sizes and strides, or an op that returns what it got.
        is_view = (
            getattr(func, "is_view", False)
            or torch.Tag.inplace_view in getattr(func, "tags", ())
            or (fresh == 0 and not writes(func))
        )
        op.bytes = 0 if is_view else traffic + fresh
        op.flops = self._flops(func, args, kwargs, out) or 0
        op.gemm = gemm_shape(func, args, kwargs, out) if op.flops else None
        if self.values is not None:
            op.group_rows = self.values.group_rows(func, args, kwargs)
        op.rng = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        # No FLOP formula, and its work is its memory traffic (pointwise, a reduction, a copy) or
        # it moves nothing (a view): not a library kernel, and not one without a cost model.
        op.fusible = not op.flops and (
            costed_by_bytes(func) or not moves_data(func, args, kwargs, out)
        )
        self.ops.append(op)

    def _flops(self, func, args, kwargs, out):
        """The call's FLOPs; None, and the operator listed as uncosted, where it moves data and
        has neither a FLOP formula nor a cost in bytes alone (Note [What an op costs])."""
        formula = self.flop_table.get(getattr(func, "_overloadpacket", func))
        flops = formula(func, args, kwargs, out) if formula is not None else None
        if flops is None and not costed_by_bytes(func) and moves_data(func, args, kwargs, out):
            self.uncosted[operator_name(func)] += 1
        return None if flops is None else int(flops)

    def _ask_nodes(self, complete):
        """Maps the nodes of the ops run so far to them and claims what those nodes saved
        (Note [Which op saved a tensor]). An op whose outputs have no node yet is asked again
        at the end of forward (``complete``): a custom Function sets its node on return."""
        if complete:
            indices, self.later = self.later, []
        else:
            indices = range(self.pending, len(self.ops))
            self.pending = len(self.ops)
        for index in indices:
            op = self.ops[index]
            node = None
            for t in op.out_refs:
                fn = t.grad_fn
                if fn is not None and id(fn) not in self.nodes:
                    node = fn
                    break
            if node is None:
                if not complete:
                    self.later.append(index)
                continue
            self.nodes[id(node)] = index
            self.node_refs.append(node)
            if op.mine:
                self._claim(node, index)

    def _claim(self, node, index):
        self.claiming = index
        try:
            names = [a for a in dir(node) if a.startswith("_saved_")]
            if hasattr(node, "saved_tensors"):
                names.append("saved_tensors")
            for attr in names:
                try:
                    getattr(node, attr)
                except RuntimeError:
                    pass
        finally:
            self.claiming = None

    def pack(self, t):
        packed = _Packed(t, len(self.packs), len(self.ops) - 1)
        self.packs.append(packed)
        return packed

    def unpack(self, packed):
        if self.claiming is not None and packed.index not in self.claimed:
            self.claimed[packed.index] = self.claiming
        return packed.tensor

    def end_forward(self):
        self._ask_nodes(complete=False)
        self._ask_nodes(complete=True)
        for packed in self.packs:
            if byte_count(packed.tensor) == 0:
                continue
            index = self.claimed.get(packed.index, max(packed.after_op, 0))
            op = self.ops[index]
            record = self._lookup_input(packed.tensor)
            if record is None or record in op.saved:
                continue
            if record not in op.inputs and record not in op.outputs:
                op.inputs.append(record)
            op.saved.append(record)

    def _on_backward_op(self, func, args, kwargs, out):
        node = torch._C._current_autograd_node()
        index = self.nodes.get(id(node)) if node is not None else None
        count = self._flops(func, args, kwargs, out) or 0
        if index is None:
            self.unattributed_backward_flops += count
            return
        op = self.ops[index]
        op.backward_flops += count
        if not moves_data(func, args, kwargs, out):
            # A view, an alias or a metadata query (`prim.device`, asked of the tensors of
            # backward many times over): no kernel reads or writes data.
            return
        seen = set()
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                op.backward_bytes += byte_count(t)
