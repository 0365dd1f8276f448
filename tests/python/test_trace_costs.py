"""Every op a trace lists is costed (docs/trace.md, Costs; Note [What an op costs] in
`ferry/_trace/_costs.py`): the FLOPs of grouped and scaled matmuls and of every attention
kernel equal an analytic count, causal attention counts the pairs a causal kernel computes, and
the trace names any op that moves data with no cost model."""

import pytest
import torch
from torch import nn

from ferry._trace import _costs, _record, trace
from models import tiny_bert
from traced_families import FAMILIES, trace_family

transformers = pytest.importorskip("transformers")


def causal_pairs(s):
    return s * (s + 1) // 2


# Attention pairs and formulas.


def brute_pairs(sq, sk, causal, bottom_right):
    shift = sk - sq if bottom_right else 0
    if not causal:
        return sq * sk
    return sum(min(max(i + 1 + shift, 0), sk) for i in range(sq))


@pytest.mark.parametrize("bottom_right", [False, True])
def test_causal_pairs_are_the_unmasked_ones(bottom_right):
    for sq in range(1, 12):
        for sk in range(1, 12):
            for causal in (False, True):
                assert _costs.attention_pairs(sq, sk, causal, bottom_right) == brute_pairs(
                    sq, sk, causal, bottom_right
                ), (sq, sk, causal)
    assert _costs.attention_pairs(8192, 8192, True) == 8192 * 8193 // 2


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="meta")


def count(op, *args, **kwargs):
    """The trace's FLOPs of one call of `op` (its formula, called as the trace calls it)."""
    formula = _costs.flop_table()[getattr(op, "_overloadpacket", op)]
    return formula(op, args, kwargs, None)


B, HQ, HKV, S, D = 2, 8, 2, 128, 32
FULL = 2 * B * HQ * S * S * 2 * D
CAUSAL = 2 * B * HQ * causal_pairs(S) * 2 * D


def heads_first():
    return meta(B, HQ, S, D), meta(B, HKV, S, D), meta(B, HKV, S, D)


def seq_first():
    return meta(B, S, HQ, D), meta(B, S, HKV, D), meta(B, S, HKV, D)


aten = torch.ops.aten


@pytest.mark.parametrize(
    "op",
    [
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
    ],
)
def test_sdpa_flash_kernels_count_every_query_head_and_the_causal_half(op):
    q, k, v = heads_first()
    assert count(op, q, k, v, 0.0, False) == FULL
    assert count(op, q, k, v, 0.0, True) == CAUSAL
    assert count(op, q, k, v, is_causal=True) == CAUSAL


def test_sdpa_efficient_and_cudnn_kernels_forward_and_backward():
    q, k, v = heads_first()
    assert count(aten._scaled_dot_product_efficient_attention.default, q, k, v, None, True) == FULL
    assert (
        count(aten._scaled_dot_product_efficient_attention.default, q, k, v, None, True, 0.0, True)
        == CAUSAL
    )
    assert (
        count(aten._scaled_dot_product_cudnn_attention.default, q, k, v, None, True, 0.0, True)
        == CAUSAL
    )
    g, o, lse = meta(B, HQ, S, D), meta(B, HQ, S, D), meta(B, HQ, S, dtype=torch.float32)
    seed = meta(2, dtype=torch.int64)
    backward = 2 * B * HQ * causal_pairs(S) * 5 * D
    efficient = aten._scaled_dot_product_efficient_attention_backward.default
    assert count(efficient, g, q, k, v, None, o, lse, seed, seed, 0.0, [True] * 4, True) == (
        backward
    )
    cudnn = aten._scaled_dot_product_cudnn_attention_backward.default
    assert count(cudnn, g, q, k, v, o, lse, seed, seed, None, None, None, S, S, 0.0, True) == (
        backward
    )
    flash = aten._scaled_dot_product_flash_attention_backward.default
    assert count(flash, g, q, k, v, o, lse, None, None, S, S, 0.0, False, seed, seed) == (
        2 * B * HQ * S * S * 5 * D
    )


def test_packed_attention_kernels_read_the_sequence_first_layout():
    q, k, v = seq_first()
    flash = aten._flash_attention_forward.default
    assert count(flash, q, k, v, None, None, S, S, 0.0, True, False) == CAUSAL
    assert count(flash, q, k, v, None, None, S, S, 0.0, False, False) == FULL
    efficient = aten._efficient_attention_forward.default
    assert count(efficient, q, k, v, None, None, None, S, S, 0.0, 1) == CAUSAL
    assert count(efficient, q, k, v, None, None, None, S, S, 0.0, 0) == FULL
    # Variable-length batches: the lengths are values, so there is no count.
    cu = meta(B + 1, dtype=torch.int32)
    assert count(flash, q[0], k[0], v[0], cu, cu, S, S, 0.0, True, False) is None


def test_flex_attention_counts_every_block():
    from torch._higher_order_ops.flex_attention import flex_attention, flex_attention_backward

    q, k, v = heads_first()
    assert count(flex_attention, q, k, v, None, None, 1.0, {}) == FULL
    o, lse, g = meta(B, HQ, S, D), meta(B, HQ, S, dtype=torch.float32), meta(B, HQ, S, D)
    assert count(flex_attention_backward, q, k, v, o, lse, g, None, None, None, None, 1.0, {}) == (
        2 * B * HQ * S * S * 5 * D
    )


@pytest.mark.parametrize(
    "a, b, out, flops",
    [
        ((96, 64), (4, 64, 32), (96, 32), 2 * 96 * 64 * 32),  # tokens x experts' weights
        ((4, 96, 64), (64, 32), (96, 32 * 4), 2 * 96 * 64 * 32 * 4),  # 3-D x 2-D
        ((4, 16, 64), (4, 64, 32), (4, 16, 32), 2 * 4 * 16 * 64 * 32),  # batched
        ((64, 96), (96, 32), (4, 64, 32), 2 * 64 * 96 * 32),  # the weights' gradient
    ],
)
def test_grouped_mm_counts_each_row_once(a, b, out, flops):
    assert _costs.grouped_mm_flops(a, b, out) == flops
    offs = meta(4, dtype=torch.int32)
    op = aten._grouped_mm.default
    formula = _costs.flop_table()[op._overloadpacket]
    assert formula(op, (meta(*a), meta(*b), offs), {}, meta(*out)) == flops
    scaled = aten._scaled_grouped_mm.default
    formula = _costs.flop_table()[scaled._overloadpacket]
    args = (meta(*a), meta(*b), meta(1, dtype=torch.float32), meta(1, dtype=torch.float32))
    assert formula(scaled, args, {"offs": offs}, meta(*out)) == flops
    # The shape the trace writes is the same product (docs/model-format.md, "gemm").
    shape = _costs.gemm_shape(op, (meta(*a), meta(*b), offs), {}, meta(*out))
    assert 2 * shape["m"] * shape["n"] * shape["k"] * shape["batch"] == flops


def test_matmuls_get_their_shape_and_other_ops_none():
    mm = aten.mm.default
    assert _costs.gemm_shape(mm, (meta(96, 64), meta(64, 32)), {}, meta(96, 32)) == {
        "m": 96,
        "n": 32,
        "k": 64,
        "batch": 1,
    }
    addmm = aten.addmm.default
    args = (meta(32), meta(96, 64), meta(64, 32))
    assert _costs.gemm_shape(addmm, args, {}, meta(96, 32))["k"] == 64
    bmm = aten.bmm.default
    shape = _costs.gemm_shape(bmm, (meta(6, 16, 8), meta(6, 8, 4)), {}, meta(6, 16, 4))
    assert shape == {"m": 16, "n": 4, "k": 8, "batch": 6}
    add = aten.add.Tensor
    assert _costs.gemm_shape(add, (meta(4), meta(4)), {}, meta(4)) is None


# Traced models against analytic counts.


def _decoder_counts(fields, batch, seq, mlp_flops_per_token):
    """Forward and backward FLOPs of a Llama-like decoder (q, k, v, o projections, causal SDPA
    over every query head, an MLP of `mlp_flops_per_token`, an untied head): every matmul's
    backward is two of its size, attention's backward 5 matmuls against the forward's 2."""
    h, a, kv = fields["hidden_size"], fields["num_attention_heads"], fields["num_key_value_heads"]
    d = fields.get("head_dim", h // a)
    t = batch * seq
    projections = 2 * t * h * (2 * a * d + 2 * kv * d)
    pairs = causal_pairs(seq)
    attention = 2 * batch * a * pairs * 2 * d
    attention_backward = 2 * batch * a * pairs * 5 * d
    head = 2 * t * h * fields["vocab_size"]
    layers = fields["num_hidden_layers"]
    forward = layers * (projections + attention + mlp_flops_per_token * t) + head
    backward = (
        layers * (2 * projections + attention_backward + 2 * mlp_flops_per_token * t) + 2 * head
    )
    return forward, backward


def _moe_mlp(fields, inner_key):
    # The router (h -> experts), then every token through top-k experts' gate/up (h -> 2f) and
    # down (f -> h) projections.
    h, k = fields["hidden_size"], fields["num_experts_per_tok"]
    experts = fields.get("num_local_experts", fields.get("num_experts"))
    f = fields[inner_key]
    return 2 * h * experts + k * (2 * h * 2 * f + 2 * f * h)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "family, inner_key",
    [("mixtral", "intermediate_size"), ("qwen3_moe", "moe_intermediate_size")],
)
def test_moe_experts_flops_equal_the_analytic_count(family, inner_key, dtype):
    # bf16, the dtype the experts' grouped matmul runs in on a GPU, and float32, which the
    # trace runs on bf16 stand-ins (Note [Grouped matmuls in any dtype]).
    batch, seq = 2, 64
    traced = trace_family(family, batch, seq, dtype)
    fields = FAMILIES[family][1]
    forward, backward = _decoder_counts(fields, batch, seq, _moe_mlp(fields, inner_key))
    got_forward, got_backward = traced.flops()
    assert got_forward == pytest.approx(forward, rel=0.01)
    assert got_backward == pytest.approx(backward, rel=0.01)
    kinds = {op.get("kind") for op in traced.document["ops"]}
    assert "aten._grouped_mm.default" in kinds
    assert traced.uncosted == {}


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_dense_decoder_flops_count_causal_attention_at_half(family):
    batch, seq = 2, 64
    traced = trace_family(family, batch, seq)
    fields = FAMILIES[family][1]
    h, f = fields["hidden_size"], fields["intermediate_size"]
    forward, backward = _decoder_counts(fields, batch, seq, 3 * 2 * h * f)
    assert traced.flops() == (forward, backward)
    # Every matmul carries its shape, and the shape is the product its FLOPs count.
    matmuls = [op for op in traced.document["ops"] if op.get("kind") == "aten.mm.default"]
    assert matmuls and all("gemm" in op for op in matmuls)
    for op in traced.document["ops"]:
        if "gemm" in op:
            g = op["gemm"]
            assert 2 * g["m"] * g["n"] * g["k"] * g["batch"] == op["flops"], op["name"]


E4M3 = torch.float8_e4m3fn


def _fp8(x):
    scale = 448.0 / x.abs().max().float().clamp(min=1e-12)
    return (x.float() * scale).to(E4M3), scale.reciprocal()


class _Fp8Linear(torch.autograd.Function):
    """A float8 linear layer as float8 training recipes write it: inputs, weight and gradient
    cast to e4m3 with a per-tensor scale (the amax), the three matmuls in `torch._scaled_mm`."""

    @staticmethod
    def forward(ctx, x, weight):
        xq, xs = _fp8(x)
        wq, ws = _fp8(weight)
        ctx.save_for_backward(xq, xs, wq, ws)
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        xq, xs, wq, ws = ctx.saved_tensors
        gq, gs = _fp8(grad)
        grad_x = torch._scaled_mm(
            gq, wq.t().contiguous().t(), scale_a=gs, scale_b=ws, out_dtype=torch.bfloat16
        )
        grad_w = torch._scaled_mm(
            gq.t().contiguous(),
            xq.t().contiguous().t(),
            scale_a=gs,
            scale_b=xs,
            out_dtype=torch.bfloat16,
        )
        return grad_x, grad_w


class Fp8Linear(nn.Module):
    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in, dtype=torch.bfloat16))

    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight)


def test_scaled_mm_flops_equal_the_analytic_count():
    tokens, h, f = 32, 64, 256
    model = nn.Sequential(Fp8Linear(h, f), nn.ReLU(), Fp8Linear(f, h))
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    traced = trace(model, x, loss_fn=lambda y: y.float().square().mean())
    matmuls = 2 * tokens * h * f * 2
    assert traced.flops() == (matmuls, 2 * matmuls)
    kinds = [op.get("kind") for op in traced.document["ops"]]
    assert kinds.count("aten._scaled_mm.default") == 2
    assert traced.uncosted == {}


# Nothing uncosted, and what is uncosted is named.


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_no_family_has_an_op_without_a_cost_model(family):
    assert trace_family(family).uncosted == {}


def test_bert_and_gpt2_with_sdpa_have_no_op_without_a_cost_model():
    ids = torch.zeros((2, 32), dtype=torch.long)
    bert = tiny_bert().train()
    assert trace(bert, ids, labels=ids).uncosted == {}
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64)
    ).train()
    assert trace(gpt2, ids, labels=ids).uncosted == {}


class _Solve(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(16) + 0.1)

    def forward(self, x):
        return torch.linalg.solve(self.weight, x)


def test_an_op_with_no_cost_model_is_named():
    traced = trace(_Solve(), torch.randn(16, 4), loss_fn=lambda y: y.sum())
    # The solve forward, the solve with the LU factors in backward: math with no formula.
    assert traced.uncosted == {
        "aten._linalg_solve_ex.default": 1,
        "aten.linalg_lu_solve.default": 1,
    }


class _Triangular(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(n) + 0.1)

    def forward(self, x):
        return torch.linalg.solve_triangular(self.weight, x, upper=False)


@pytest.mark.parametrize("n, k", [(16, 4), (8, 24)])
def test_a_triangular_solve_costs_n_squared_flops_a_right_hand_side(n, k):
    # Forward: n² FLOPs for each of the k right-hand sides. Backward: the solve against Aᵀ for
    # the right-hand sides' gradient (n²k), then the weight's gradient -tril(dB Xᵀ), an n×k by
    # k×n product (2n²k).
    traced = trace(_Triangular(n), torch.randn(n, k), loss_fn=lambda y: y.sum())
    assert traced.uncosted == {}
    assert traced.flops() == (n * n * k, n * n * k + 2 * n * k * n)
    (solve,) = [op for op in traced.document["ops"] if "solve" in op["kind"]]
    assert solve["kind"] == "aten.linalg_solve_triangular.default"
    assert solve["flops"] == n * n * k


def test_batched_and_right_sided_triangular_solves_count_every_system():
    a, b = meta(3, 16, 16, dtype=torch.float32), meta(3, 16, 5, dtype=torch.float32)
    op = aten.linalg_solve_triangular.default
    formula = _costs.flop_table()[op._overloadpacket]
    assert formula(op, (a, b), {"upper": True}, meta(3, 16, 5)) == 3 * 16 * 16 * 5
    # X A = B: B [3, 5, 16], five right-hand sides a system as well.
    assert formula(op, (a, meta(3, 5, 16)), {"upper": True, "left": False}, meta(3, 5, 16)) == (
        3 * 16 * 16 * 5
    )
    legacy = aten.triangular_solve.default
    formula = _costs.flop_table()[legacy._overloadpacket]
    assert formula(legacy, (b, a), {}, (meta(3, 16, 5), meta(3, 16, 16))) == 3 * 16 * 16 * 5


class _Fourier(nn.Module):
    """FNet's token mixing: the real part of a 2-D FFT over the sequence and hidden dims."""

    def __init__(self, h):
        super().__init__()
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        return torch.fft.fftn(self.proj(x), dim=(-2, -1)).real


def test_an_fft_costs_five_n_log_n_flops_a_transform():
    batch, s, h = 2, 16, 32
    traced = trace(_Fourier(h), torch.randn(batch, s, h), loss_fn=lambda y: y.sum())
    assert traced.uncosted == {}
    (fft,) = [op for op in traced.document["ops"] if op["kind"].startswith("aten._fft")]
    n = s * h
    # The real input goes through one complex transform (torch's fftn of a real tensor casts
    # it), 5 n log2 n for each of the batch's transforms; its gradient another.
    assert fft["kind"] == "aten._fft_c2c.default"
    assert fft["flops"] == 5 * n * 9 * batch  # log2(16 * 32) = 9
    assert fft["backward_flops"] == fft["flops"]
    real = aten._fft_r2c.default
    formula = _costs.flop_table()[real._overloadpacket]
    x = meta(batch, s, h, dtype=torch.float32)
    assert formula(real, (x, [1, 2], 0, True), {}, None) == 5 * n * 9 * batch // 2
    inverse = aten._fft_c2r.default
    formula = _costs.flop_table()[inverse._overloadpacket]
    out = meta(batch, s, h, dtype=torch.float32)
    assert formula(inverse, (meta(batch, s, h // 2 + 1), [1, 2], 0, h), {}, out) == (
        5 * n * 9 * batch // 2
    )
    assert _costs.fft_flops(1, 8, real=False) == 0


class _InPlaceView(nn.Module):
    def __init__(self, in_place):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.in_place = in_place

    def forward(self, x):
        y = self.proj(x)
        # unsqueeze_ changes y's sizes and strides, unsqueeze makes a view: no element moves.
        return y.unsqueeze_(0) if self.in_place else y.unsqueeze(0)


def test_an_in_place_view_moves_no_data():
    x = torch.randn(4, 8)
    in_place = trace(_InPlaceView(True), x, loss_fn=lambda y: y.sum())
    view = trace(_InPlaceView(False), x, loss_fn=lambda y: y.sum())
    assert in_place.uncosted == {} and view.uncosted == {}

    def total(traced):
        ops = traced.document["ops"]
        return sum(op["bytes"] for op in ops), sum(op["backward_bytes"] for op in ops)

    assert total(in_place) == total(view)
    assert all(
        op["bytes"] == 0
        for op in in_place.document["ops"]
        if op["kind"] == "aten.unsqueeze_.default"
    )


class _Untagged(nn.Module):
    """Elementwise ops torch does not tag pointwise: `polar`, and the gradients of `softplus`,
    `elu` and `hardtanh`."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 16))

    def forward(self, x):
        z = torch.view_as_real(torch.polar(self.weight, x)).sum(-1)
        w = self.weight
        return z * nn.functional.softplus(w) + nn.functional.elu(w) + nn.functional.hardtanh(w)


def test_untagged_elementwise_ops_and_pointwise_gradients_are_costed_by_their_bytes():
    traced = trace(_Untagged(), torch.randn(8, 16), loss_fn=lambda y: y.sum())
    assert traced.uncosted == {}
    for op in traced.document["ops"]:
        assert op["flops"] == 0 and op.get("backward_flops", 0) == 0, op["name"]
    # Their bytes stand for their time, forward and backward.
    by_kind = {op["kind"]: op for op in traced.document["ops"]}
    for name in ("polar", "softplus", "elu", "hardtanh"):
        op = by_kind[f"aten.{name}.default"]
        assert op["bytes"] > 0 and op["backward_bytes"] > 0, name


def _aten_names():
    return {
        s.name.split("::")[1]
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("aten::")
    }


def test_the_table_lists_the_untagged_gradients_of_pointwise_ops():
    # The gradient of an elementwise op is elementwise too; torch tags some (`gelu_backward`) and
    # not others. Every untagged `<op>_backward` of an aten op tagged pointwise is in the table.
    def tagged(packet, tag):
        return any(tag in getattr(packet, o).tags for o in packet.overloads())

    gradients = set()
    for name in _aten_names():
        forward = getattr(aten, name.removesuffix("_backward"), None)
        if not name.endswith("_backward") or not isinstance(forward, torch._ops.OpOverloadPacket):
            continue
        backward = getattr(aten, name)
        if tagged(forward, torch.Tag.pointwise) and not (
            tagged(backward, torch.Tag.pointwise) or tagged(backward, torch.Tag.reduction)
        ):
            gradients.add(name)
    assert {"softplus_backward", "elu_backward", "hardtanh_backward", "mish_backward"} <= gradients
    assert gradients <= _costs._BY_BYTES
    # glu halves a dim and convolution is no elementwise op: they are not in that group.
    group = set(_costs._BY_BYTES_GROUPS["gradients of pointwise ops"].split())
    assert group == gradients
    assert not {"glu_backward", "convolution_backward"} & group


def test_the_table_names_aten_operators_only():
    assert _costs._BY_BYTES <= _aten_names()


def test_without_the_new_rules_those_ops_are_named(monkeypatch):
    gradients = {"softplus_backward", "elu_backward", "hardtanh_backward"}
    monkeypatch.setattr(_costs, "_BY_BYTES", _costs._BY_BYTES - {"polar"} - gradients)
    traced = trace(_Untagged(), torch.randn(8, 16), loss_fn=lambda y: y.sum())
    assert set(traced.uncosted) == {
        "aten.polar.default",
        "aten.softplus_backward.default",
        "aten.elu_backward.default",
        "aten.hardtanh_backward.default",
    }
    monkeypatch.undo()
    table = _costs.flop_table()
    del table[aten.linalg_solve_triangular]
    monkeypatch.setattr(_record, "flop_table", lambda: table)
    traced = trace(_Triangular(8), torch.randn(8, 2), loss_fn=lambda y: y.sum())
    assert traced.uncosted == {"aten.linalg_solve_triangular.default": 2}


def test_the_trace_command_lists_uncosted_ops(tmp_path, capsys, monkeypatch):
    import json

    from ferry._cli.trace import main

    config = tmp_path / "config.json"
    model_type, fields, _ = FAMILIES["llama"]
    config.write_text(json.dumps({"model_type": model_type, **fields}))
    out = str(tmp_path / "x.json")
    assert main([str(config), "--seq", "16", "--out", out]) == 0
    assert "no cost model" not in capsys.readouterr().err
    # Without the rule that a copy's cost is its bytes, `_to_copy` has no cost model.
    monkeypatch.setattr(_costs, "_BY_BYTES", _costs._BY_BYTES - {"_to_copy"})
    assert main([str(config), "--seq", "16", "--out", out]) == 0
    err = capsys.readouterr().err
    assert "no cost model, so counted as free of FLOPs: aten._to_copy.default (" in err
