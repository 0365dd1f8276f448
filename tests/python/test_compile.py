"""torch.compile'd modules and compiled autograd under ferry regions give the gradients of the
same compiled run without ferry. The compiled forward saves its tensors through the ambient
hooks at run time; compiled autograd cannot trace ferry's unpack hook and runs that part of
backward eagerly (a graph break), which changes no value."""

import copy

import pytest
import torch
from torch._dynamo import compiled_autograd

import ferry
from models import MLP, assert_same_grads, loss_of


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def twins():
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    x = torch.randn(8, 32, requires_grad=True)
    return ref, model, x, x.detach().clone().requires_grad_()


def offload_ctx(policy):
    return ferry.offload(
        policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
    )


@pytest.mark.parametrize("mode", ["ferry", "trl", "checkpoint"])
def test_compiled_module(mode):
    ref, model, ref_x, x = twins()
    compiled_ref = torch.compile(ref, backend="aot_eager")
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        for m, v in ((ref, ref_x), (model, x)):
            m.zero_grad(set_to_none=True)
            v.grad = None
        loss_of(compiled_ref(ref_x)).backward()
        if mode == "checkpoint":
            loss_of(ferry.checkpoint(compiled, x, use_reentrant=False)).backward()
        else:
            ctx = offload_ctx(mode)
            with ctx:
                loss = loss_of(compiled(x))
            assert ctx.telemetry()["offloaded"] > 0
            loss.backward()
            assert ctx.tracked() == 0
        assert_same_grads(ref, model, [ref_x], [x])


@pytest.mark.parametrize("mode", ["ferry", "trl", "checkpoint"])
def test_compiled_autograd(mode):
    ref, model, ref_x, x = twins()
    loss_of(ref(ref_x)).backward()
    if mode == "checkpoint":
        loss = loss_of(ferry.checkpoint(model, x, use_reentrant=False))
    else:
        ctx = offload_ctx(mode)
        with ctx:
            loss = loss_of(model(x))
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
    assert_same_grads(ref, model, [ref_x], [x])
