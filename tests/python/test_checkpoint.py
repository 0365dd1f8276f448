"""ferry.checkpoint: gradients bitwise equal to plain autograd and to
torch.utils.checkpoint(use_reentrant=False); nesting, early stop, random state, errors."""

import contextlib
import functools
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as tc

import ferry
from models import MLP, Block, assert_same_grads, loss_of, twin


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def grads(*tensors):
    return [t.grad for t in tensors]


def assert_all_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x is not None and y is not None, i
        assert torch.equal(x, y), f"gradient {i} differs"


def test_single_region_mlp():
    ref, model, ref_x, x = twin(MLP, lambda: torch.randn(8, 32))
    loss_of(ref(ref_x)).backward()
    loss_of(ferry.checkpoint(model, x, use_reentrant=False)).backward()
    assert_same_grads(ref, model, [ref_x], [x])


def test_transformer_block():
    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    loss_of(ref(ref_x)).backward()
    loss_of(ferry.checkpoint(model, x, use_reentrant=False)).backward()
    assert_same_grads(ref, model, [ref_x], [x])


def inner(h, w):
    return torch.sin(h) * (h @ w)


def make_outer(ckpt, early_stop):
    def outer(x, w):
        h = torch.tanh(x @ w)
        return (ckpt(inner, h, w, early_stop) + h).relu() @ w

    return outer


def ferry_ckpt(fn, *args):
    *args, early_stop = args
    return ferry.checkpoint(fn, *args, early_stop=early_stop, use_reentrant=False)


def torch_ckpt(fn, *args):
    *args, _ = args
    return tc.checkpoint(fn, *args, use_reentrant=False)


def plain(fn, *args):
    *args, _ = args
    return fn(*args)


def nested_run(ckpt, early_stop):
    torch.manual_seed(1)
    x0, w0 = torch.randn(6, 8), torch.randn(8, 8) * 0.5
    x, w = leaves(x0, w0)
    out = ckpt(make_outer(ckpt, early_stop), x, w, early_stop)
    loss_of(out).backward()
    return out.detach(), grads(x, w)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint(early_stop):
    want_out, want_grads = nested_run(plain, early_stop)
    out, got = nested_run(ferry_ckpt, early_stop)
    assert torch.equal(out, want_out)
    assert_all_equal(got, want_grads)


@pytest.mark.parametrize("early_stop", [True, False])
def test_nested_checkpoint_matches_torch(early_stop):
    # torch.utils.checkpoint imports torch._dynamo, which needs sympy (not a dependency of
    # ferry): without it this comparison is reported as skipped, with this reason.
    pytest.importorskip("sympy", reason="torch.utils.checkpoint needs sympy (torch._dynamo)")
    want_out, want_grads = nested_run(torch_ckpt, early_stop)
    out, got = nested_run(ferry_ckpt, early_stop)
    assert torch.equal(out, want_out)
    assert_all_equal(got, want_grads)


@pytest.mark.parametrize("early_stop", [True, False])
def test_early_stop_ends_the_replay(early_stop):
    reached_end = []

    def fn(x):
        y = x.sin().exp() * x
        reached_end.append(True)
        return y

    x = torch.randn(16, requires_grad=True)
    ferry.checkpoint(fn, x, early_stop=early_stop, use_reentrant=False).sum().backward()
    # forward, plus the replay only when it ran to the end
    assert len(reached_end) == (1 if early_stop else 2)
    xr = x.detach().clone().requires_grad_()
    (xr.sin().exp() * xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)


def dropout_fn(x, w):
    h = F.dropout(x @ w, p=0.5, training=True)
    return torch.tanh(h) * F.dropout(h, p=0.25, training=True)


def dropout_grads(**options):
    """Gradients of dropout_fn checkpointed with `options`, and of a plain run from the same
    random state; the state moves on between the checkpointed forward and its backward."""
    torch.manual_seed(2)
    x0, w0 = torch.randn(8, 16), torch.randn(16, 16)
    x_ref, w_ref = leaves(x0, w0)
    torch.manual_seed(123)
    loss_of(dropout_fn(x_ref, w_ref)).backward()
    x, w = leaves(x0, w0)
    torch.manual_seed(123)
    loss = loss_of(ferry.checkpoint(dropout_fn, x, w, **options, use_reentrant=False))
    torch.rand(100)
    loss.backward()
    return grads(x, w), grads(x_ref, w_ref)


@pytest.mark.parametrize("early_stop", [True, False])
def test_dropout_replays_same_mask(early_stop):
    got, want = dropout_grads(early_stop=early_stop)
    assert_all_equal(got, want)


def test_dropout_without_preserved_rng_differs():
    got, want = dropout_grads(preserve_rng_state=False)
    assert not torch.equal(got[1], want[1])


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_checkpoint_inside_offload(policy):
    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    mlp_ref = MLP()
    mlp = MLP()
    mlp.load_state_dict(mlp_ref.state_dict())

    loss_of(mlp_ref(ref(ref_x))).backward()

    ctx = ferry.offload(policy=policy, loopback=True, min_bytes=0)
    ctx.update_model_params(model)
    ctx.update_model_params(mlp)
    for _ in range(2):
        for m in (model, mlp):
            m.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            h = ferry.checkpoint(model, x, use_reentrant=False)
            loss = loss_of(mlp(h))
        loss.backward()
        assert ctx.tracked() == 0
        assert ctx.live_device_buffers() == 0
    assert_same_grads(ref, model, [ref_x], [x])
    assert_same_grads(mlp_ref, mlp)
    assert ctx.telemetry()["offloaded"] > 0


def test_checkpoint_kwargs_and_non_tensor_args():
    def fn(x, scale, *, w, bias=None):
        return (x @ w).sin() * scale + bias

    torch.manual_seed(4)
    x0, w0, b0 = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
    x_ref, w_ref, b_ref = leaves(x0, w0, b0)
    fn(x_ref, 0.5, w=w_ref, bias=b_ref).sum().backward()
    x, w, b = leaves(x0, w0, b0)
    ferry.checkpoint(fn, x, 0.5, w=w, bias=b, use_reentrant=False).sum().backward()
    assert_all_equal(grads(x, w, b), grads(x_ref, w_ref, b_ref))


def test_checkpoint_tuple_output_and_retain_graph():
    def fn(x):
        a = x.sin()
        return a * x, a.exp()

    x0 = torch.randn(16)
    (x_ref,) = leaves(x0)
    a, b = fn(x_ref)
    (a.sum() + b.sum()).backward(retain_graph=True)
    (a.sum() + b.sum()).backward()
    (x,) = leaves(x0)
    a, b = ferry.checkpoint(fn, x, use_reentrant=False)
    loss = a.sum() + b.sum()
    loss.backward(retain_graph=True)
    loss.backward()  # a second graph task recomputes again
    assert torch.equal(x.grad, x_ref.grad)


def test_bad_determinism_check_option():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="determinism_check"):
        ferry.checkpoint(torch.sin, x, determinism_check="strict", use_reentrant=False)


@pytest.mark.parametrize("early_stop", [True, False])
def test_replay_saving_fewer_tensors_is_an_error(early_stop):
    calls = []

    def fn(x):
        calls.append(True)
        y = x.sin()
        if len(calls) == 1:  # only the original forward
            y = y.exp()
        return y * 2.0

    x = torch.randn(8, requires_grad=True)
    y = ferry.checkpoint(fn, x, early_stop=early_stop, use_reentrant=False).sum()
    with pytest.raises(RuntimeError, match="different number of tensors"):
        y.backward()


def test_replay_saving_other_dtype_is_an_error():
    calls = []

    def fn(x):
        calls.append(True)
        h = x if len(calls) == 1 else x.double()
        return h.sin().float()

    x = torch.randn(8, requires_grad=True)
    y = ferry.checkpoint(fn, x, use_reentrant=False).sum()
    with pytest.raises(RuntimeError, match="different metadata") as error:
        y.backward()
    # Named as torch names them, under ferry's name.
    message = str(error.value)
    assert "ferry.checkpoint: Recomputed values" in message
    assert "saved metadata: {shape: [8], dtype: float32, device: cpu}" in message
    assert "recomputed metadata: {shape: [8], dtype: float64, device: cpu}" in message


def test_replay_saving_another_shape_is_an_error_as_in_torch():
    # The same bytes, dtype and device: only the shape tells the saved tensors apart.
    def make(calls):
        def fn(x):
            calls.append(True)
            h = x if len(calls) == 1 else x.view(2, 4)
            return h.sin().sum()

        return fn

    for checkpoint, error in (
        (tc.checkpoint, "different metadata"),
        (ferry.checkpoint, "ferry.checkpoint: Recomputed values"),
    ):
        x = torch.randn(8, requires_grad=True)
        y = checkpoint(make([]), x, use_reentrant=False)
        with pytest.raises(RuntimeError, match=error) as caught:
            y.backward()
    message = str(caught.value)
    assert "saved metadata: {shape: [8], dtype: float32, device: cpu}" in message
    assert "recomputed metadata: {shape: [2, 4], dtype: float32, device: cpu}" in message


def test_replay_error_propagates():
    calls = []

    def fn(x):
        calls.append(True)
        if len(calls) > 1:
            raise KeyError("replay failed")
        return x.sin().exp()

    x = torch.randn(8, requires_grad=True)
    y = ferry.checkpoint(fn, x, use_reentrant=False).sum()
    with pytest.raises(KeyError, match="replay failed"):
        y.backward()


def test_stop_exception_is_exposed():
    assert issubclass(ferry._C._StopRecomputation, Exception)


class Fn:
    def __init__(self, f):
        self.f = f

    def __call__(self, *args):
        return self.f(*args)


def replay_freed(nested, backward):
    import weakref

    # The lambdas run before `del inner` below (ruff's F821 sees only the del).
    inner = Fn(lambda h: h.sin() * h)
    if nested:
        outer = Fn(lambda x: ferry.checkpoint(inner, x.exp(), use_reentrant=False).cos() * 2.0)  # noqa: F821
    else:
        outer = Fn(lambda x: inner(x.exp()).cos() * 2.0)  # noqa: F821
    x = torch.randn(8, requires_grad=True)
    y = ferry.checkpoint(outer, x, use_reentrant=False).sum()
    if backward:
        y.backward()
    del y
    refs = [weakref.ref(inner), weakref.ref(outer)]
    del inner, outer
    return all(r() is None for r in refs)


@pytest.mark.parametrize("nested", [False, True])
def test_replay_freed_after_backward(nested):
    assert replay_freed(nested, backward=True)


def test_replay_freed_without_backward():
    assert replay_freed(nested=False, backward=False)


def test_nested_replay_freed_without_backward():
    import gc

    freed = replay_freed(nested=True, backward=False)
    gc.collect()
    assert freed


# Jagged nested tensors ------------------------------------------------------------------------
# torch.nested's jagged layout: one size is a nested int (j1) tied to the offsets tensor. The
# oracle is torch.utils.checkpoint on the same function, outside any ferry region.


def jagged_input(kind):
    """(a jagged nested tensor of two rows of 8 features, the leaf whose gradient is compared)."""
    torch.manual_seed(1)
    parts = [torch.randn(3, 8), torch.randn(5, 8)]
    if kind == "nested_tensor":
        x = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
        return x, x
    values = torch.cat(parts).requires_grad_()
    return torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 3, 8])), values


class JaggedBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(torch.tanh(self.lin(x)) * x.sin())


def dense(t):
    return t.values() if t.is_nested else t


def jagged_run(checkpoint, kind, region=None):
    """The output's values and every gradient, the function's calls counted."""
    block = JaggedBlock()
    x, leaf = jagged_input(kind)
    calls = []

    def fn(v):
        calls.append(True)
        return block(v)

    with region if region is not None else contextlib.nullcontext():
        y = checkpoint(fn, x)
    dense(y).square().sum().backward()
    grads = [p.grad for p in block.parameters()] + [dense(leaf.grad)]
    return [dense(y).detach()] + grads, len(calls)


def jagged_region(where):
    return ferry.offload(loopback=True, min_bytes=0) if where == "offload" else None


@pytest.mark.parametrize("where", ["outside", "offload"])
@pytest.mark.parametrize("kind", ["nested_tensor", "from_jagged"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_jagged_nested_tensors_equal_torch(use_reentrant, kind, where):
    want, want_calls = jagged_run(
        functools.partial(tc.checkpoint, use_reentrant=use_reentrant), kind
    )
    region = jagged_region(where)
    got, calls = jagged_run(
        functools.partial(ferry.checkpoint, use_reentrant=use_reentrant), kind, region
    )
    assert_all_equal(want, got)
    assert calls == want_calls == 2  # run in forward, recomputed in backward
    if region is not None:
        assert region.tracked() == 0


@pytest.mark.parametrize("where", ["outside", "offload"])
def test_nested_checkpoints_of_jagged_tensors_equal_torch(where):
    def run(checkpoint, region=None):
        block = JaggedBlock()
        x, leaf = jagged_input("nested_tensor")

        def outer(v):
            h = torch.tanh(block.lin(v))
            return checkpoint(block, h).cos() * h

        with region if region is not None else contextlib.nullcontext():
            y = checkpoint(outer, x)
        dense(y).square().sum().backward()
        return [dense(y).detach()] + [p.grad for p in block.parameters()] + [dense(leaf.grad)]

    want = run(functools.partial(tc.checkpoint, use_reentrant=False))
    got = run(functools.partial(ferry.checkpoint, use_reentrant=False), jagged_region(where))
    assert_all_equal(want, got)


def jagged_over_new_offsets(lin):
    """Builds its jagged tensor over offsets computed inside: the recomputation's nested int is
    another than the forward's."""

    def fn(values, lengths):
        offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        return torch.tanh(lin(torch.nested.nested_tensor_from_jagged(values, offsets)))

    return fn


@pytest.mark.parametrize(
    "use_reentrant, error",
    [(False, "different metadata"), (True, "Mismatch in shape")],
)
def test_a_recomputation_over_other_offsets_fails_as_in_torch(use_reentrant, error):
    lin = torch.nn.Linear(8, 8)
    for checkpoint in (tc.checkpoint, ferry.checkpoint):
        values, lengths = torch.randn(8, 8, requires_grad=True), torch.tensor([3, 5])
        y = checkpoint(jagged_over_new_offsets(lin), values, lengths, use_reentrant=use_reentrant)
        with pytest.raises(RuntimeError, match=error) as caught:
            y.values().sum().backward()
    if not use_reentrant:
        # The nested ints named as torch names them: jN, the recomputation's a later one.
        message = str(caught.value)
        assert "ferry.checkpoint: Recomputed values" in message
        saved = re.search(r"saved metadata: \{shape: \[2, j(\d+), 8\], dtype: float32", message)
        again = re.search(r"recomputed metadata: \{shape: \[2, j(\d+), 8\], dtype", message)
        assert saved and again and int(again[1]) > int(saved[1]), message


def test_without_the_determinism_check_other_offsets_fail_in_backward_as_in_torch():
    # Nothing compares the shapes: the backward mixes the two nested ints, which torch refuses.
    lin = torch.nn.Linear(8, 8)
    for checkpoint in (tc.checkpoint, ferry.checkpoint):
        values, lengths = torch.randn(8, 8, requires_grad=True), torch.tensor([3, 5])
        y = checkpoint(
            jagged_over_new_offsets(lin),
            values,
            lengths,
            use_reentrant=False,
            determinism_check="none",
        )
        with pytest.raises(RuntimeError, match="cannot call binary pointwise function"):
            y.values().sum().backward()


def jagged_attention(x):
    """Self-attention over a jagged batch: on the CPU, torch computes it over a strided nested
    tensor, which has no sizes to read."""
    q = x.unflatten(-1, (2, 4)).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q)
    return out.transpose(1, 2).flatten(-2)


def test_jagged_attention_fails_and_passes_as_in_torch():
    def run(checkpoint, **options):
        x, leaf = jagged_input("nested_tensor")
        y = checkpoint(jagged_attention, x, use_reentrant=False, **options)
        y.values().square().sum().backward()
        return [y.values().detach(), leaf.grad.values()]

    # The determinism check reads the shape of every saved tensor, in forward.
    for checkpoint in (tc.checkpoint, ferry.checkpoint):
        with pytest.raises(RuntimeError, match="NestedTensorImpl doesn't support sizes"):
            run(checkpoint)
    want = run(tc.checkpoint, determinism_check="none")
    assert_all_equal(want, run(ferry.checkpoint, determinism_check="none"))


def jagged_policy(choice):
    """A selective checkpoint policy: `choice` for the linear layer's and tanh's outputs."""

    def policy(ctx, op, *args, **kwargs):
        if op in (
            torch.ops.aten.tanh.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.mm.default,
        ):
            return choice
        return tc.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


@pytest.mark.parametrize(
    "where, choice",
    [
        ("outside", tc.CheckpointPolicy.MUST_SAVE),
        ("offload", tc.CheckpointPolicy.MUST_SAVE),
        ("offload", tc.CheckpointPolicy.MUST_CPU_OFFLOAD),
    ],
)
def test_selective_checkpoint_of_jagged_tensors_equals_torch(where, choice):
    def context():
        return tc.create_selective_checkpoint_contexts(jagged_policy(choice))

    want, _ = jagged_run(
        functools.partial(tc.checkpoint, use_reentrant=False, context_fn=context), "nested_tensor"
    )
    region = jagged_region(where)
    got, _ = jagged_run(
        functools.partial(ferry.checkpoint, use_reentrant=False, context_fn=context),
        "nested_tensor",
        region,
    )
    assert_all_equal(want, got)
    if choice == tc.CheckpointPolicy.MUST_CPU_OFFLOAD:
        # torch 2.11 recomputes these ops; ferry hands their jagged outputs to the session,
        # which keeps them as they are (it copies dense storages only).
        assert region.telemetry()["kept_as_is"] > 0
