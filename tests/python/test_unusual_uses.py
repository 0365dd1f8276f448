"""Unusual but legal uses of the real backend, each against plain PyTorch (equal gradients, or
torch's own error), and what is left behind after any error: no tracked tensor, no device
buffer, no checkpoint state, no open region, once the failed step's objects are gone.

On the CPU loopback device (asynchronous, conftest.py), where a missing wait shows as a wrong
gradient.
"""

import copy
import functools
import gc
import json

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.utils.checkpoint as tc

import ferry
from ferry import PlanError
from models import TinyLM, loss_of


def leftovers(ctx):
    """(tracked tensors, device buffers held, checkpoint states alive) after a collection."""
    gc.collect()
    return ctx.tracked(), ctx.live_device_buffers(), ferry._C._live_checkpoint_states()


def assert_nothing_left(ctx, states_before=0):
    tracked, buffers, states = leftovers(ctx)
    assert (tracked, buffers, states - states_before) == (0, 0, 0)


# A plan whose first block is a checkpoint region, as ferry.plan gives it ----------------------


@functools.cache
def _traced():
    torch.manual_seed(0)
    model, x = TinyLM(d=64), torch.randn(8, 16, 64)
    traced = ferry.trace(model, x, loss_fn=loss_of, target="host")
    return model, x, traced


def block_plan(inputs="keep"):
    """The model, its input, and ferry.plan's plan with blocks.0 made one recomputed region."""
    model, x, traced = _traced()
    plan = copy.deepcopy(dict(ferry.plan(traced, budget="1TiB")["plan"]))
    block = [i for i, op in enumerate(traced.document["ops"]) if op.get("layer") == 0]
    plan["regions"] = [{"first_op": block[0], "end_op": block[-1] + 1, "inputs": inputs}]
    for i in block:
        plan["ops"][i]["saved"] = "recompute"
    return copy.deepcopy(model), x, plan


@pytest.mark.parametrize("inputs", ["keep", "offload"])
def test_a_plan_forward_dropped_without_backward_leaves_nothing(inputs):
    model, x, plan = block_plan(inputs)
    ctx = ferry.offload(plan=plan, model=model, loopback=True)
    before = ferry._C._live_checkpoint_states()
    with ctx:
        loss_of(model(x))
    assert_nothing_left(ctx, before)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda ops: ops.pop(), None),
        (lambda ops: [ops.pop() for _ in range(3)], "which saves tensors for backward"),
        (lambda ops: ops.append({"name": "extra/op#0", "saved": "keep"}), "forward ended before"),
    ],
    ids=["last-op-dropped", "three-ops-dropped", "op-appended"],
)
def test_a_plan_that_ends_early_or_late_leaves_nothing(edit, message):
    model, x, plan = block_plan()
    edit(plan["ops"])
    ctx = ferry.offload(plan=plan, model=model, loopback=True)
    before = ferry._C._live_checkpoint_states()
    if message is None:
        with ctx:
            loss_of(model(x))
    else:
        with pytest.raises(PlanError, match=message):
            with ctx:
                loss_of(model(x))
    assert_nothing_left(ctx, before)


@pytest.mark.parametrize(
    "axis, missing",
    [
        ("cp", "torch's context_parallel .* CUDA's flash, efficient and cuDNN kernels only"),
        ("ep", "torch has no expert-parallel API"),
    ],
)
def test_a_plan_made_for_a_context_or_expert_parallel_cut_is_refused(axis, missing):
    # Under context or expert parallelism a plan's ops are one GPU's cut of the model, whose
    # exchanges a real rank does not run (tensor parallelism's: test_tensor_parallel_plan.py).
    model, _, plan = block_plan()
    plan["parallelism"] = {"fsdp": 4, axis: 2}
    with pytest.raises(
        PlanError,
        match=rf"parallelism\.{axis}: the plan was made for one GPU's cut of the model under "
        rf"--{axis} 2: .*{missing}.* Make the plan without --{axis}",
    ):
        ferry.offload(plan=plan, model=model, loopback=True)


def test_a_plan_made_under_tensor_parallelism_alone_records_it():
    # ferry plan --tp 2 without --fsdp: the plan file says {"tp": 2}, which the plan reader
    # keeps and ferry.offload's axis check lets through (a real rank applies it to its cut).
    plan = ferry.plan("tiny-llama", budget="1GiB", tp=2)["plan"]
    assert plan["parallelism"] == {"tp": 2}
    loaded = ferry._plan.load_plan(json.loads(json.dumps(plan)))
    assert loaded["parallelism"] == {"tp": 2}
    # Without tensor parallelism the plan records no parallelism: one GPU.
    assert "parallelism" not in ferry.plan("tiny-llama", budget="1GiB")["plan"]


def test_a_plan_with_the_paged_stash_is_refused_by_a_real_run():
    # The paged stash is the simulator's: its plans are for static-capacity expert buffers.
    model, _, plan = block_plan()
    plan["paged_stash"] = True
    with pytest.raises(PlanError, match=r"paged_stash: the paged stash .* is the simulator's"):
        ferry.offload(plan=plan, model=model, loopback=True)


# Forward-mode AD through a checkpoint --------------------------------------------------------


def _jvp_through(checkpoint, region):
    lin = torch.nn.Linear(8, 8)
    x, tangent = torch.randn(4, 8), torch.randn(4, 8)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        with region:
            checkpoint(lambda a: torch.tanh(lin(a)).sin(), dual, use_reentrant=False)


@pytest.mark.parametrize("in_region", [False, True], ids=["alone", "in-offload"])
def test_forward_ad_through_a_checkpoint_raises_what_torch_raises(in_region):
    ctx = ferry.offload(loopback=True, min_bytes=0)
    with pytest.raises(NotImplementedError):
        _jvp_through(tc.checkpoint, ferry.no_offload())  # torch's own error, for the record
    before = ferry._C._live_checkpoint_states()
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        _jvp_through(ferry.checkpoint, ctx if in_region else ferry.no_offload())
    assert_nothing_left(ctx, before)


# ferry.checkpoint inside torch.compile ---------------------------------------------------------


@pytest.mark.parametrize("in_region", [False, True], ids=["alone", "in-offload"])
def test_a_checkpoint_inside_torch_compile_trains_as_torch_does(in_region):
    torch.manual_seed(0)
    ln, lin1, lin2 = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    params = [*ln.parameters(), *lin1.parameters(), *lin2.parameters()]

    def block(x):
        return x + lin2(torch.nn.functional.gelu(lin1(ln(x))))

    x = torch.randn(4, 6, 16)

    def grads(checkpoint, region):
        torch._dynamo.reset()
        for p in params:
            p.grad = None

        @torch.compile(backend="aot_eager")
        def step(x):
            return checkpoint(block, x, use_reentrant=False)

        with region:
            y = step(x)
        y.square().sum().backward()
        return [p.grad.clone() for p in params]

    want = grads(tc.checkpoint, ferry.no_offload())
    ctx = ferry.offload(loopback=True, min_bytes=0) if in_region else ferry.no_offload()
    got = grads(ferry.checkpoint, ctx)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


# Jagged nested tensors ----------------------------------------------------------------------


def test_jagged_nested_tensors_are_kept_and_train_as_plain():
    lin = torch.nn.Linear(8, 8)

    def grad(ctx):
        lin.weight.grad = None
        torch.manual_seed(1)
        parts = [torch.randn(3, 8), torch.randn(5, 8)]
        nested = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=True)
        with ctx:
            y = torch.tanh(lin(nested))
        y.values().square().sum().backward()
        return lin.weight.grad.clone()

    want = grad(ferry.no_offload())
    ctx = ferry.offload(loopback=True, min_bytes=0)
    assert torch.equal(want, grad(ctx))
    assert ctx.telemetry()["kept_as_is"] > 0
    assert_nothing_left(ctx)


# x.data = other between forward and backward -------------------------------------------------


@pytest.mark.parametrize("min_bytes", [0, 1 << 20], ids=["offloaded", "kept"])
def test_a_data_swap_after_the_save_is_not_seen(min_bytes):
    """The decision (docs/real-backend.md, the saved-tensor contract): backward gets the storage a
    tensor had when it was saved; plain torch, which holds an input's object, reads the new
    data."""
    w = torch.randn(64, 64, requires_grad=True)

    def grad(ctx, swap):
        w.grad = None
        torch.manual_seed(1)
        x, other = torch.randn(8, 64), torch.randn(8, 64)
        with ctx:
            y = torch.tanh(x @ w)
        if swap:
            x.data = other
        y.sum().backward()
        return w.grad.clone()

    unswapped = grad(ferry.no_offload(), swap=False)
    plain = grad(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), swap=True)
    assert not torch.equal(unswapped, plain)  # plain torch does see the swap
    ctx = ferry.offload(loopback=True, min_bytes=min_bytes)
    assert torch.equal(grad(ctx, swap=True), unswapped)
    assert (ctx.telemetry()["bytes_d2h"] > 0) == (min_bytes == 0)


# The same region entered twice ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_an_offload_region_entered_again_nests_as_torch_hooks_do(policy):
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    x = torch.randn(8, 64)
    params = [*lin1.parameters(), *lin2.parameters()]

    def grads(ctx):
        for p in params:
            p.grad = None
        with ctx:
            h = torch.relu(lin1(x))
            with ctx:
                h = torch.relu(lin2(h))
            y = h.square().sum()
        y.backward()
        return [p.grad.clone() for p in params]

    # torch's own hooks object nests: entered twice, left twice.
    want = grads(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    ctx = ferry.offload(loopback=True, min_bytes=0, policy=policy)
    for _ in range(2):  # two steps: the step begins and ends once each
        got = grads(ctx)
        for a, b in zip(want, got):
            assert torch.equal(a, b)
    assert ctx.telemetry()["bytes_d2h"] > 0
    assert_nothing_left(ctx)


# Nothing is left after an error --------------------------------------------------------------


class Boom(Exception):
    """An error the user's code raises."""


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        raise Boom("in backward")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32))


def raise_in_forward(ctx):
    m, x = _model(), torch.randn(4, 32)
    with ctx:
        h = m(x)
        raise Boom(f"in forward after {h.shape}")


def raise_in_checkpointed_forward(ctx):
    m, x = _model(), torch.randn(4, 32, requires_grad=True)

    def fn(a):
        m(a)
        raise Boom("in a checkpoint's forward")

    with ctx:
        ferry.checkpoint(fn, x, use_reentrant=False)


def raise_in_recompute(ctx):
    m, x = _model(), torch.randn(4, 32, requires_grad=True)
    calls = [0]

    def fn(a):
        calls[0] += 1
        if calls[0] > 1:
            raise Boom("in the recomputation")
        return m(a)

    with ctx:
        y = ferry.checkpoint(fn, x, use_reentrant=False).sum()
    y.backward()


def raise_in_backward(ctx):
    m, x = _model(), torch.randn(4, 32, requires_grad=True)
    with ctx:
        y = _RaisingBackward.apply(ferry.checkpoint(m, x, use_reentrant=False)).tanh().sum()
    y.backward()


def recompute_saves_other_tensors(ctx):
    m, x = _model(), torch.randn(4, 32, requires_grad=True)
    calls = [0]

    def fn(a):
        calls[0] += 1
        return m(a) if calls[0] == 1 else a.sin()

    with ctx:
        y = ferry.checkpoint(fn, x, use_reentrant=False).sum()
    y.backward()  # RuntimeError: the recomputation saved other tensors


def changed_in_place_before_backward(ctx):
    m, x = _model(), torch.randn(4, 32, requires_grad=True)
    with ctx:
        h = torch.tanh(x * 3)
        y = ferry.checkpoint(m, h, use_reentrant=False).sigmoid().sum()
    with torch.no_grad():
        h.add_(1)
    y.backward()  # RuntimeError: a saved tensor was modified by an inplace operation


# The plan scenarios run a region of their own, listed here for the sweep to check as well.
_PLANNED = []


def plan_error_mid_forward(ctx):
    model, x, plan = block_plan()
    del plan["ops"][-3:]
    with ferry.offload(plan=plan, model=model, loopback=True) as planned:
        _PLANNED.append(planned)
        loss_of(model(x))


def plan_error_in_a_region(ctx):
    model, x, plan = block_plan("offload")
    region = plan["regions"][0]
    for i in range(region["first_op"], region["end_op"]):
        plan["ops"][i]["name"] = f"blocks.0.qkv/not_an_op#{i}"
    with ferry.offload(plan=plan, model=model, loopback=True) as planned:
        _PLANNED.append(planned)
        loss_of(model(x))


RAISING = {
    "forward": (raise_in_forward, Boom),
    "checkpoint-forward": (raise_in_checkpointed_forward, Boom),
    "recompute": (raise_in_recompute, Boom),
    "backward": (raise_in_backward, Boom),
    "determinism-check": (recompute_saves_other_tensors, RuntimeError),
    "version-check": (changed_in_place_before_backward, RuntimeError),
    "plan-mid-forward": (plan_error_mid_forward, PlanError),
    "plan-region": (plan_error_in_a_region, PlanError),
    "forward-ad": (
        lambda ctx: _jvp_through(ferry.checkpoint, ctx),
        NotImplementedError,
    ),
}


@pytest.mark.parametrize("policy", ["ferry", "trl"])
@pytest.mark.parametrize("where", sorted(RAISING))
def test_nothing_is_left_after_an_error(where, policy):
    run, error = RAISING[where]
    ctx = ferry.offload(loopback=True, min_bytes=0, policy=policy)
    _PLANNED.clear()
    before = ferry._C._live_checkpoint_states()
    with pytest.raises(error):
        run(ctx)
    if policy == "trl":
        # The reference offloader's tracker keeps what it never unpacked until its context
        # is entered again (docs/real-backend.md, "Differences that remain"): so does trl.
        with ctx:
            pass
    assert_nothing_left(ctx, before)
    for planned in _PLANNED:
        assert_nothing_left(planned, before)
    _PLANNED.clear()
    # The session still trains after the error, with nothing left behind it either.
    m, x = _model(), torch.randn(4, 32, requires_grad=True)
    with ctx:
        y = ferry.checkpoint(m, x, use_reentrant=False).sum()
    y.backward()
    del y
    assert_nothing_left(ctx, before)
