"""What an op costs: the FLOP formulas of the ops whose work is arithmetic, the rule that says
which ops' work is their memory traffic, and the matmul shapes a document writes (docs/trace.md,
Costs). ``_record`` asks it for every op it records. Free of ``ferry._C``: it needs torch only.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.utils._pytree import tree_flatten

from .._names import FUSED_ATTENTION, writes


def storage_key(t):
    """The identity of the tensor's storage (tensors that share it share the key)."""
    return t.untyped_storage()._cdata


# Note [What an op costs]
# An op's forward and backward time come from its FLOPs and its bytes (the roofline,
# docs/model-format.md). The bytes of every op that moves data are counted from its tensors; the
# FLOPs only where a formula says how many: torch's FLOP counter (matmuls, convolutions, the
# GPU attention kernels) and the formulas below, which add what the counter lacks (grouped and
# scaled grouped matmuls, triangular solves, FFTs, flex attention, the CPU flash kernel) and replace
# its attention counts, which reject grouped-query attention and count a causal kernel as a full
# one. An op whose work is its memory traffic (pointwise math, reductions, copies, indexing,
# norms, softmax, losses) needs no FLOP formula: the bytes bound its time. Which op is which
# is read from the op itself: torch's `pointwise` and `reduction` tags, and the operators
# `_BY_BYTES_GROUPS` lists by what they are (among them the gradients of ops tagged `pointwise`
# that torch leaves untagged); never from a model's or a module's name. Any other op that moves
# data, forward or backward, is costed too low, and the trace lists it (`TracedModel.uncosted`,
# the summary of `python -m ferry trace`).


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


def solve_triangular_flops(n: int, out_numel: int) -> int:
    """FLOPs of solving triangular systems of order ``n`` for an output of ``out_numel``
    elements (every right-hand side of every batch): ``n**2`` a right-hand side.

    Forward or back substitution of one right-hand side takes n(n-1)/2 multiply-adds and n
    divisions, n² FLOPs (Golub and Van Loan, Matrix Computations, 4th ed., §3.1.2: "n² flops");
    an output of ``out_numel`` elements holds ``out_numel / n`` right-hand sides.
    """
    return n * out_numel


def _solve_triangular(func, args, kwargs, out):
    # linalg_solve_triangular(self=A [..., n, n], B, upper, left, unitriangular), X of B's shape.
    a = _arguments(func, args, kwargs)
    return solve_triangular_flops(a["self"].shape[-1], _first(out).numel())


def _triangular_solve(func, args, kwargs, out):
    # triangular_solve(self=B [..., n, k], A [..., n, n], ...) -> (X, a copy of A).
    a = _arguments(func, args, kwargs)
    return solve_triangular_flops(a["A"].shape[-1], _first(out).numel())


def fft_flops(n: int, transforms: int, real: bool) -> int:
    """FLOPs of ``transforms`` discrete Fourier transforms of ``n`` points each (over every
    transformed dim together): 5 n log2 n for a complex transform, half of it for a real one
    (to or from a one-sided spectrum), the counts FFTW's benchmarks credit a transform with
    (fftw.org/speed/method.html, after Cooley-Tukey's radix-2 count)."""
    if n <= 1:
        return 0
    flops = 5 * n * math.log2(n) * transforms
    return int(round(flops / 2 if real else flops))


def _fft(kind):
    # _fft_c2c(self, dim, normalization, forward), _fft_r2c(self, dim, normalization, onesided),
    # _fft_c2r(self, dim, normalization, last_dim_size): the signal is the complex or real
    # side's dims (the output's for c2r), every other element a transform of its own.
    def count(func, args, kwargs, out):
        a = _arguments(func, args, kwargs)
        signal = _first(out) if kind == "c2r" else a["self"]
        dims = [d % signal.dim() for d in a["dim"]]
        n = math.prod(signal.shape[d] for d in dims)
        transforms = signal.numel() // n if n else 0
        return fft_flops(n, transforms, real=kind != "c2c")

    return count


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


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


def flop_table():
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
        **{name: _sdpa(False) for name in FUSED_ATTENTION},
        **{f"{name}_backward": _sdpa(True) for name in FUSED_ATTENTION},
        "_flash_attention_forward": _packed(False),
        "_flash_attention_backward": _packed(True),
        "_efficient_attention_forward": _packed(False),
        "_efficient_attention_backward": _packed(True),
        "_grouped_mm": _grouped_mm,
        "_scaled_grouped_mm": _grouped_mm,
        "linalg_solve_triangular": _solve_triangular,
        "triangular_solve": _triangular_solve,
        "_fft_c2c": _fft("c2c"),
        "_fft_r2c": _fft("r2c"),
        "_fft_c2r": _fft("c2r"),
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


# The operators whose work is their memory traffic that torch's tags leave out (Note [What an op
# costs]): the one list of operators by name on the Python side, as sim's OpFamily table
# (op_family.cpp) is on the C++ side. Keys are aten operator names, any overload; a new
# operator is one name in its group.
_BY_BYTES_GROUPS = {
    # Copies, concatenation, padding and layout changes (`im2col`, `col2im` and
    # `unfold_backward`: windows unfolded and summed back).
    "copies": """
        _to_copy clone copy copy_ contiguous _unsafe_view cat stack constant_pad_nd
        repeat roll flip tril triu im2col col2im unfold_backward
    """,
    # Reads and writes at indices, and their gradients.
    "indexing": """
        embedding embedding_dense_backward index index_put index_put_ index_select index_add
        index_add_ index_copy gather scatter scatter_ scatter_add scatter_add_ scatter_reduce
        scatter_reduce_ index_reduce masked_fill masked_fill_ masked_scatter slice_backward
        select_backward index_select_backward as_strided_scatter slice_scatter select_scatter
        diagonal_backward
    """,
    # Integer division, scans, sorts and selections, counts, the unique elements
    # (`torch.unique` records `_unique2`, `unique_dim` or `unique_consecutive`).
    "scans and sorts": """
        floor_divide floor_divide_ remainder fmod
        cumsum cumprod sort topk histc bincount argmax argmin argsort nonzero
        _unique2 unique_dim unique_consecutive unique_dim_consecutive _is_all_true _is_any_true
    """,
    # Factories: a tensor filled with a value or a range.
    "factories": """
        zeros zeros_like ones ones_like full full_like new_zeros new_ones new_full new_empty
        new_empty_strided empty empty_like empty_strided scalar_tensor arange linspace eye fill
        fill_ zero_ lift_fresh_copy
    """,
    # Softmax and the norms (weight norm's too), with their gradients.
    "softmax and norms": """
        _softmax _softmax_backward_data _safe_softmax _log_softmax _log_softmax_backward_data
        native_layer_norm native_layer_norm_backward _fused_rms_norm _fused_rms_norm_backward
        native_group_norm native_group_norm_backward native_batch_norm native_batch_norm_backward
        _native_batch_norm_legit _native_batch_norm_legit_functional
        _weight_norm_interface _weight_norm_interface_backward
    """,
    # Dropout and random draws.
    "random": """
        native_dropout native_dropout_backward bernoulli bernoulli_ rand rand_like randn
        randn_like randint uniform_ normal_ exponential_ geometric_ cauchy_ log_normal_ random_
    """,
    "losses": """
        nll_loss_forward nll_loss_backward nll_loss2d_forward nll_loss2d_backward
    """,
    # Elementwise ops torch leaves untagged (`polar`: abs·cos(angle) + i·abs·sin(angle);
    # `complex`: real + i·imag; `glu`: one half times the sigmoid of the other; the activations
    # hardswish, leaky ReLU, RReLU, PReLU, log-sigmoid) and their gradients.
    "untagged elementwise": """
        polar complex log_sigmoid_forward log_sigmoid_backward glu glu_backward hardswish
        hardswish_ hardswish_backward leaky_relu leaky_relu_ leaky_relu_backward rrelu_with_noise
        rrelu_with_noise_backward _prelu_kernel _prelu_kernel_backward
    """,
    # The gradients of ops torch tags pointwise that it leaves untagged itself: element i of the
    # input's gradient is a function of element i of the output's gradient and of the inputs.
    # (The others, `gelu_backward`, `silu_backward`, `sigmoid_backward`, ..., carry the tag.)
    "gradients of pointwise ops": """
        elu_backward hardsigmoid_backward hardtanh_backward mish_backward softplus_backward
        softshrink_backward hardshrink_backward
    """,
    # Interpolation: each output element a weighted sum of the 2 to 64 input elements around it.
    "interpolation": """
        upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d
        _upsample_nearest_exact2d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
        upsample_bicubic2d upsample_trilinear3d _upsample_bilinear2d_aa _upsample_bicubic2d_aa
        upsample_nearest1d_backward upsample_nearest2d_backward upsample_nearest3d_backward
        _upsample_nearest_exact1d_backward _upsample_nearest_exact2d_backward
        _upsample_nearest_exact3d_backward upsample_linear1d_backward upsample_bilinear2d_backward
        upsample_bicubic2d_backward upsample_trilinear3d_backward _upsample_bilinear2d_aa_backward
        _upsample_bicubic2d_aa_backward
    """,
    # Pooling: a max or a mean over each window, a few comparisons or adds an element read.
    "pooling": """
        max_pool2d_with_indices max_pool2d_with_indices_backward max_pool3d_with_indices
        max_pool3d_with_indices_backward avg_pool2d avg_pool2d_backward avg_pool3d
        avg_pool3d_backward _adaptive_avg_pool2d _adaptive_avg_pool2d_backward
        _adaptive_avg_pool3d _adaptive_avg_pool3d_backward adaptive_max_pool2d
        adaptive_max_pool2d_backward adaptive_max_pool3d adaptive_max_pool3d_backward
    """,
}
_BY_BYTES = frozenset(name for group in _BY_BYTES_GROUPS.values() for name in group.split())


def moves_data(func, args, kwargs, out) -> bool:
    """Whether the call reads or writes tensor data: not a view, an alias, a metadata query or
    an in-place change of a tensor's sizes and strides (torch's `inplace_view` tag:
    `as_strided_`, `unsqueeze_`, ...)."""
    if getattr(func, "is_view", False):
        return False
    if torch.Tag.inplace_view in getattr(func, "tags", ()):
        return False
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    if not outs:
        return writes(func)
    ins = {
        storage_key(t)
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.numel() > 0
    }
    return writes(func) or any(storage_key(o) not in ins for o in outs if o.numel() > 0)


def costed_by_bytes(func) -> bool:
    """Whether the operator's time is its memory traffic (Note [What an op costs])."""
    tags = getattr(func, "tags", ())
    if torch.Tag.pointwise in tags or torch.Tag.reduction in tags:
        return True
    packet = getattr(func, "_overloadpacket", None)
    return packet is not None and packet.__name__ in _BY_BYTES
