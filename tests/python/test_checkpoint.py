"""ferry.checkpoint: gradients bitwise equal to plain autograd and to
torch.utils.checkpoint(use_reentrant=False); nesting, early stop, random state, errors."""

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
