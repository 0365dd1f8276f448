"""What a trace records: every aten op forward runs, every tensor it meets (with storages and
views followed), every tensor autograd saves and which op saved it, and the backward ops of
each op's node (docs/trace.md). ``ferry._trace.trace`` drives it; ``_document`` writes the
document. Free of ``ferry._C``: tracing needs torch only.
"""

from __future__ import annotations

import collections
import logging
import math
import re

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._names import OpNames, is_named, writes

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
    match = _LAYER.search(path)
    return int(match.group(1)) if match else -1


def byte_count(t: torch.Tensor) -> int:
    """The tensor's logical bytes (elements times element size)."""
    return t.numel() * t.element_size()


def _storage_key(t):
    return t.untyped_storage()._cdata


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
        "out_refs",
        "mine",
    )

    def __init__(self, name, layer, head, mine, kind=None):
        self.name = name
        self.kind = kind  # the operator, "aten.mm.default" (docs/model-format.md); None: unknown
        self.layer = layer
        self.head = head
        self.mine = mine  # the trace's pack hook was the innermost when the op ran
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
        self.out_refs = []


# Note [What an op costs]
# An op's forward and backward time come from its FLOPs and its bytes (the roofline,
# docs/model-format.md). The bytes of every op that moves data are counted from its tensors; the
# FLOPs only where a formula says how many: torch's FLOP counter (matmuls, convolutions, the
# GPU attention kernels) and the formulas below, which add what the counter lacks (grouped and
# scaled grouped matmuls, flex attention, the CPU flash kernel) and replace its attention
# counts, which reject grouped-query attention and count a causal kernel as a full one. An op
# whose work is its memory traffic (pointwise math, reductions, copies, indexing, norms,
# softmax, losses) needs no FLOP formula: the bytes bound its time. Any other op that moves
# data, forward or backward, is costed too low, and the trace lists it
# (`TracedModel.uncosted`, the summary of `python -m ferry trace`).


def _arguments(func, args, kwargs):
    """The call's arguments by their names in the operator's schema."""
    bound = {}
    schema = getattr(func, "_schema", None)
    if schema is not None:
        for argument, value in zip(schema.arguments, args):
            bound[argument.name] = value
    bound.update(kwargs)
    return bound


def attention_pairs(sq: int, sk: int, causal: bool, bottom_right: bool = False) -> int:
    """The (query, key) pairs an attention kernel computes for one head.

    Args:
        sq: Query positions.
        sk: Key positions.
        causal: Whether a causal mask lets a kernel skip the pairs above the diagonal.
        bottom_right: The diagonal's alignment: top left (torch's ``is_causal``: query i sees
            keys 0..i) or bottom right (query i sees keys 0..i + sk - sq).

    Returns:
        ``sq * sk`` without a mask, else the unmasked pairs: ``s(s+1)/2`` for ``sq == sk == s``.
    """
    if not causal:
        return sq * sk

    def seen(x):  # keys seen by the queries that see 1, 2, ..., x keys (at most sk each)
        x = max(x, 0)
        return x * (x + 1) // 2 if x <= sk else sk * (sk + 1) // 2 + (x - sk) * sk

    # Query i sees i + 1 + shift keys, clamped to 0..sk.
    shift = sk - sq if bottom_right else 0
    return seen(sq + shift) - seen(shift)


def attention_flops(batch_heads, sq, sk, d, dv, causal, backward=False, bottom_right=False):
    """FLOPs of attention over ``batch_heads`` (batch times query heads) heads.

    Forward: Q K^T and P V, 2 FLOPs a multiply-add, over the pairs the kernel computes
    (``attention_pairs``). Backward (as FlashAttention's): Q K^T again, dP = dO V^T, dV = P^T dO,
    dQ = dS K and dK = dS^T Q.
    """
    pairs = attention_pairs(sq, sk, causal, bottom_right)
    return 2 * batch_heads * pairs * ((3 * d + 2 * dv) if backward else (d + dv))


def _heads_first(query, key, value, causal, backward, bottom_right=False):
    # [..., heads, s, d]: every leading dim is a head of its own (the query's heads, so that
    # grouped-query attention counts every query head against its keys).
    batch_heads = math.prod(query.shape[:-2])
    sq, d = query.shape[-2], query.shape[-1]
    sk, dv = key.shape[-2], value.shape[-1]
    return attention_flops(batch_heads, sq, sk, d, dv, causal, backward, bottom_right)


def _seq_first(query, key, value, causal, backward, bottom_right=False):
    # [b, s, heads, d], the layout of _flash_attention_forward and _efficient_attention_forward.
    if query.dim() != 4:
        return None  # variable-length batches: the lengths are values a fake trace cannot read
    b, sq, h, d = query.shape
    sk, dv = key.shape[1], value.shape[-1]
    return attention_flops(b * h, sq, sk, d, dv, causal, backward, bottom_right)


def _sdpa(backward):
    def count(func, args, kwargs, out):
        a = _arguments(func, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        return _heads_first(q, k, v, bool(a.get("is_causal", False)), backward)

    return count


def _packed(backward):
    # _flash_attention_forward / _backward and _efficient_attention_forward / _backward.
    def count(func, args, kwargs, out):
        a = _arguments(func, args, kwargs)
        for name in ("cum_seq_q", "cum_seq_k", "cu_seqlens_q", "cu_seqlens_k"):
            if a.get(name) is not None:
                return None
        if "custom_mask_type" in a:  # efficient: 0 none, 1 top left, 2 bottom right
            mask = int(a["custom_mask_type"])
            causal, bottom_right = mask != 0, mask == 2
        else:  # flash: a causal mask aligned to the bottom right, as FlashAttention-2 has it
            causal, bottom_right = bool(a.get("is_causal", False)), True
        return _seq_first(a["query"], a["key"], a["value"], causal, backward, bottom_right)

    return count


def _flex(backward):
    # flex_attention(query, key, value, score_mod, block_mask, ...) and its backward
    # (query, key, value, out, logsumexp, grad_out, ...). The block mask's contents are values
    # a fake trace cannot read, so every block counts: the dense count, an upper bound.
    def count(func, args, kwargs, out):
        q, k, v = args[0], args[1], args[2]
        return _heads_first(q, k, v, False, backward)

    return count


def grouped_mm_flops(a_shape, b_shape, out_shape) -> int:
    """FLOPs of ``_grouped_mm(a, b, offs)`` (and of the scaled one): 2 a multiply-add.

    With ``a`` 2-D and ``b`` 3-D (the tokens of every expert, one weight per expert), ``a`` 3-D
    and ``b`` 2-D, or both 3-D (a batch), every output element is a dot product over ``a``'s
    last dim. With both 2-D the groups split the contracted dim (the weights' gradient) and the
    output holds one [m, n] block per group: 2 m k n in all.
    """
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _grouped_mm(func, args, kwargs, out):
    a = _arguments(func, args, kwargs)
    return grouped_mm_flops(a["self"].shape, a["mat2"].shape, out.shape)


def _scaled_mm(func, args, kwargs, out):
    a = _arguments(func, args, kwargs)
    m, k = a["self"].shape
    return 2 * m * k * a["mat2"].shape[1]


# The matmuls whose shape a trace writes, by overload packet name, with the names of their two
# operands in the schema.
_GEMM_OPERANDS = {
    "mm": ("self", "mat2"),
    "addmm": ("mat1", "mat2"),
    "bmm": ("self", "mat2"),
    "baddbmm": ("batch1", "batch2"),
    "_scaled_mm": ("self", "mat2"),
    "_grouped_mm": ("self", "mat2"),
    "_scaled_grouped_mm": ("self", "mat2"),
}


def gemm_shape(func, args, kwargs, out):
    """The forward product of a matmul call as ``{"m", "n", "k", "batch"}`` (2 m n k batch
    FLOPs, the count of the FLOP formulas above), or None for any other operator.

    A grouped matmul is one product over all groups' rows (2-D by 3-D: the tokens of every
    expert), a batch of them (3-D operands), or, with both operands 2-D, one product whose
    contracted dim the groups split (the weights' gradient); group boundaries are not tiles.
    """
    packet = getattr(func, "_overloadpacket", None)
    operands = _GEMM_OPERANDS.get(getattr(packet, "__name__", ""))
    if operands is None or not isinstance(out, torch.Tensor):
        return None
    a = _arguments(func, args, kwargs)
    left, right = a.get(operands[0]), a.get(operands[1])
    if not isinstance(left, torch.Tensor) or not isinstance(right, torch.Tensor):
        return None
    if left.dim() == 2 and right.dim() == 2:
        m, k, n, batch = left.shape[0], left.shape[1], right.shape[1], 1
    else:
        m, n, k = out.shape[-2] if out.dim() >= 2 else 1, out.shape[-1], left.shape[-1]
        batch = math.prod(out.shape[:-2])
    shape = {"m": int(m), "n": int(n), "k": int(k), "batch": int(batch)}
    return shape if all(v > 0 for v in shape.values()) else None


def _flop_table():
    """Operator (packet, or higher-order op) -> function(func, args, kwargs, out) giving the
    call's FLOPs, or None where the call has no count (Note [What an op costs])."""
    # Importing the counter warns that triton is missing (it matters for triton kernels only).
    logger = logging.getLogger("torch.utils.flop_counter")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import flop_counter
    finally:
        logger.setLevel(level)

    table = {}
    for packet, formula in flop_counter.flop_registry.items():

        def call(func, args, kwargs, out, formula=formula):
            return formula(*args, **kwargs, out_val=out)

        table[packet] = call
    aten = torch.ops.aten
    ours = {
        "_scaled_dot_product_flash_attention": _sdpa(False),
        "_scaled_dot_product_flash_attention_backward": _sdpa(True),
        "_scaled_dot_product_flash_attention_for_cpu": _sdpa(False),
        "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa(True),
        "_scaled_dot_product_efficient_attention": _sdpa(False),
        "_scaled_dot_product_efficient_attention_backward": _sdpa(True),
        "_scaled_dot_product_cudnn_attention": _sdpa(False),
        "_scaled_dot_product_cudnn_attention_backward": _sdpa(True),
        "_scaled_dot_product_fused_attention_overrideable": _sdpa(False),
        "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa(True),
        "_flash_attention_forward": _packed(False),
        "_flash_attention_backward": _packed(True),
        "_efficient_attention_forward": _packed(False),
        "_efficient_attention_backward": _packed(True),
        "_grouped_mm": _grouped_mm,
        "_scaled_grouped_mm": _grouped_mm,
    }
    for name, formula in ours.items():
        packet = getattr(aten, name, None)
        if packet is not None:
            table[packet] = formula
    if getattr(aten, "_scaled_mm", None) is not None and aten._scaled_mm not in table:
        table[aten._scaled_mm] = _scaled_mm
    try:
        from torch._higher_order_ops.flex_attention import (
            flex_attention,
            flex_attention_backward,
        )
    except ImportError:
        pass
    else:
        table[flex_attention] = _flex(False)
        table[flex_attention_backward] = _flex(True)
    return table


# Operators whose work is their memory traffic, beside those torch tags pointwise or reduction
# (Note [What an op costs]): copies, layout changes, indexing, factories, softmax, norms,
# dropout and losses.
_BY_BYTES = frozenset(
    """
    _to_copy clone copy copy_ contiguous _unsafe_view cat stack constant_pad_nd
    repeat roll flip tril triu
    embedding embedding_dense_backward index index_put index_put_ index_select index_add
    index_add_ index_copy gather scatter scatter_ scatter_add scatter_add_ masked_fill
    masked_fill_ masked_scatter slice_backward select_backward index_select_backward
    as_strided_scatter slice_scatter select_scatter diagonal_backward
    floor_divide floor_divide_ remainder fmod
    cumsum cumprod sort topk histc bincount argmax argmin argsort nonzero unique
    zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full new_empty
    new_empty_strided empty empty_like empty_strided scalar_tensor arange linspace fill fill_
    zero_ lift_fresh_copy
    _softmax _softmax_backward_data _safe_softmax _log_softmax _log_softmax_backward_data
    native_layer_norm native_layer_norm_backward _fused_rms_norm _fused_rms_norm_backward
    native_group_norm native_group_norm_backward native_batch_norm native_batch_norm_backward
    _native_batch_norm_legit _native_batch_norm_legit_functional
    native_dropout native_dropout_backward bernoulli bernoulli_ rand rand_like randn randn_like
    randint uniform_ normal_
    nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward
    """.split()
)


def moves_data(func, args, kwargs, out) -> bool:
    """Whether the call reads or writes tensor data: not a view, an alias or a metadata query."""
    if getattr(func, "is_view", False):
        return False
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if not outs:
        return writes(func)
    ins = {
        _storage_key(t)
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.numel() > 0
    }
    return writes(func) or any(_storage_key(o) not in ins for o in outs if o.numel() > 0)


def costed_by_bytes(func) -> bool:
    """Whether the operator's time is its memory traffic (Note [What an op costs])."""
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
        return True
    packet = getattr(func, "_overloadpacket", None)
    return packet is not None and packet.__name__ in _BY_BYTES


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
        self.flop_table = _flop_table()
        self.unattributed_backward_flops = 0
        self.uncosted = collections.Counter()  # operator -> calls with no cost model
        self.values = None  # the values known beside the fake tensors (``_values.Values``)

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
        key = _storage_key(t)
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
        op = OpRecord(name, layer_of(path), self.heads > 0, mine, kind)
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
            known_storage = _storage_key(t) in self.storages
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
        is_view = getattr(func, "is_view", False) or fresh == 0 and not writes(func)
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
