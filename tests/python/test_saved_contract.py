"""The saved-tensor contract (Note [Saved-tensor contract] in real/src/saved_tensors.hpp): what
autograd gets back through ferry is what it would get without ferry, or torch's own error. The
oracle is plain PyTorch: the same code without ferry (torch.utils.checkpoint for
ferry.checkpoint)."""

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import ferry
from contract_programs import Program, first_failure, run, same_outcome, without_node

MODIFIED = "modified by an inplace operation"

# Enough random programs to find each defect the contract closes again when its fix is taken
# out (docs/real-backend.md, "The saved-tensor contract", gives the case that first finds each).
PROPERTY_CASES = 2000


def _error(fn):
    """The message of the RuntimeError `fn` raises."""
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


def _mutated_after_save(region):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with region:
        h = x @ w
        y = h.sin()
        with torch.no_grad():
            h.mul_(2)
        loss = y.sum()
    loss.backward()


@pytest.mark.parametrize("policy", ["ferry", "trl"])
@pytest.mark.parametrize("window_bytes", [None, 0])
def test_a_saved_tensor_changed_in_place_raises_torchs_error(policy, window_bytes):
    import contextlib

    plain = _error(lambda: _mutated_after_save(contextlib.nullcontext()))
    options = {} if window_bytes is None else {"window_bytes": window_bytes}
    ours = _error(
        lambda: _mutated_after_save(ferry.offload(loopback=True, policy=policy, **options))
    )
    assert MODIFIED in plain
    assert ours == plain


def test_a_tensor_already_on_the_host_is_checked_too():
    # window_bytes=0 and a later save: h's copy is on the host before h changes.
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    ctx = ferry.offload(loopback=True, window_bytes=0, min_bytes=0)
    with ctx:
        h = x @ w
        y = h.sin()
        z = (x * 3).cos()  # a later save: h's original has left the window
        with torch.no_grad():
            h.mul_(2)
        loss = y.sum() + z.sum()
    assert ctx.telemetry()["offloaded"] >= 2
    assert MODIFIED in _error(loss.backward)


def test_a_kept_tensor_is_checked_too():
    # Under min_bytes everything stays on the device, through ferry's hooks all the same.
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with ferry.offload(loopback=True, min_bytes=1 << 30):
        y = (x @ w).sin()
        with torch.no_grad():
            w.add_(1)
        loss = y.sum()
    message = _error(loss.backward)
    assert "[torch.FloatTensor [8, 8]] is at version 1; expected version 0" in message


def test_an_optimizer_step_between_forward_and_backward_raises():
    import contextlib
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)

    def step(model, ctx):
        for p in model.parameters():
            p.grad = torch.ones_like(p)  # for the optimizer to apply
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with ctx(model):
            loss = model(x).square().sum()
        opt.step()  # in-place on the parameters the forward saved
        loss.backward()

    plain = _error(lambda: step(copy.deepcopy(model), lambda m: contextlib.nullcontext()))
    ours = _error(
        lambda: step(
            copy.deepcopy(model),
            lambda m: ferry.offload_model(m, loopback=True, warn_if_no_head=False),
        )
    )
    assert MODIFIED in plain
    # torch names the node of a view of a parameter changed in place as it finds it at unpack
    # (AsStridedBackward0, regenerated), ferry as it was at pack (TBackward0).
    assert without_node(ours) == without_node(plain)


def _dedup_program(region):
    x = torch.randn(64, 64, requires_grad=True, generator=torch.Generator().manual_seed(1))
    with region:
        h = x * 2
        unused = h.sin()  # saves h at version 0, never backpropagated
        h.add_(1)
        loss = h.cos().exp().sum()  # saves h again, at version 1
    loss.backward()
    del unused
    return x.grad


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_storages_changed_between_two_saves_are_not_deduplicated(policy):
    import contextlib

    plain = _dedup_program(contextlib.nullcontext())
    ctx = ferry.offload(loopback=True, window_bytes=0, policy=policy)
    ours = _dedup_program(ctx)
    assert torch.equal(ours, plain)
    assert ctx.telemetry()["deduplicated"] == 0


def test_one_storage_at_one_version_is_still_deduplicated():
    x = torch.randn(64, 64, requires_grad=True)
    ctx = ferry.offload(loopback=True)
    with ctx:
        h = x * 2
        loss = (h.sin() + h.cos() + h.t().sin()).sum()  # h and its view, saved three times
    loss.backward()
    assert ctx.telemetry()["deduplicated"] >= 2


def _conj_cases():
    yield "conj_product", lambda x: (x.conj() * x.conj()).real.sum()
    yield "neg_imag", lambda x: (lambda n: (n * n.sin()).sum())(x.conj().imag)
    yield "conj_matmul", lambda x: (x.conj().view(1, 3) @ x.view(3, 1)).real.sum()


@pytest.mark.parametrize("case", [c for c, _ in _conj_cases()])
@pytest.mark.parametrize("where", ["offload", "offload_window0", "checkpoint"])
def test_conjugate_and_negative_bits_of_saved_views_come_back(case, where):
    fn = dict(_conj_cases())[case]
    x = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    fn(x).backward()
    plain = x.grad.clone()
    x.grad = None
    if where == "checkpoint":
        ferry.checkpoint(fn, x, use_reentrant=False).backward()
    else:
        options = {"window_bytes": 0} if where == "offload_window0" else {}
        with ferry.offload(loopback=True, min_bytes=0, **options):
            loss = fn(x)
        loss.backward()
    assert torch.equal(x.grad, plain)


def _checkpointed(checkpoint):
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 2
    y = checkpoint(lambda t: lin(t).sin(), h, use_reentrant=False)
    with torch.no_grad():
        h.mul_(3)
    y.sum().backward()


def test_checkpoint_inputs_changed_before_the_recompute_raise_torchs_error():
    theirs = _error(lambda: _checkpointed(torch_checkpoint.checkpoint))
    ours = _error(lambda: _checkpointed(ferry.checkpoint))
    assert MODIFIED in theirs
    assert ours == theirs


def test_checkpoint_inputs_offloaded_by_a_region_are_checked_too():
    x = torch.randn(4, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 8)
    with ferry.offload(loopback=True, min_bytes=0):
        h = x * 2
        y = ferry.checkpoint(lambda t: lin(t).sin(), h, use_reentrant=False)
    with torch.no_grad():
        h.mul_(3)
    assert MODIFIED in _error(lambda: y.sum().backward())


def _two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    a = torch.randn(4, 8)
    return TwoTensor(a, a.clone()).requires_grad_()


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_wrapper_subclasses_are_offloaded_through_their_inner_tensors(policy):
    """A traceable wrapper subclass (TwoTensor: two inner tensors) has no storage of its own:
    its inner tensors are offloaded, and unpacking rebuilds it (Note [Wrapper subclasses] in
    real/python/src/ferry_ext.cpp)."""
    x = _two_tensor()
    (x.sin() * x.cos()).sum().backward()
    plain = x.grad
    x.grad = None
    ctx = ferry.offload(loopback=True, min_bytes=0, policy=policy)
    with ctx:
        loss = (x.sin() * x.cos()).sum()
    loss.backward()
    assert torch.equal(x.grad.a, plain.a) and torch.equal(x.grad.b, plain.b)
    telemetry = ctx.telemetry()
    assert telemetry["kept_as_is"] == 0
    assert telemetry["offloaded"] > 0 and telemetry["bytes_d2h"] > 0


def test_a_wrapper_subclass_in_a_no_offload_region_is_kept_and_counted():
    x = _two_tensor()
    (x.sin() * x.cos()).sum().backward()
    plain = x.grad
    x.grad = None
    ctx = ferry.offload(loopback=True, min_bytes=0)
    with ctx, ferry.no_offload():
        loss = (x.sin() * x.cos()).sum()
    loss.backward()
    assert torch.equal(x.grad.a, plain.a) and torch.equal(x.grad.b, plain.b)
    assert ctx.telemetry()["bytes_d2h"] == 0


def test_a_dtensor_is_offloaded_as_its_local_tensor(tmp_path):
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        mesh = DeviceMesh("cpu", [0])
        x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)]).requires_grad_()
        (x.sin() * x).sum().backward()
        plain = x.grad.full_tensor()
        x.grad = None
        ctx = ferry.offload(loopback=True, min_bytes=0)
        with ctx:
            loss = (x.sin() * x).sum()
        loss.backward()
        assert torch.equal(x.grad.full_tensor(), plain)
        telemetry = ctx.telemetry()
        # Its saved tensors' local tensors copied out (8 x 8 floats each), none kept whole.
        assert telemetry["kept_as_is"] == 0
        assert telemetry["bytes_d2h"] > 0 and telemetry["bytes_d2h"] % (8 * 8 * 4) == 0
    finally:
        dist.destroy_process_group()


def test_the_property_finds_nothing_in_random_programs():
    failure = first_failure(range(PROPERTY_CASES))
    if failure is not None:
        program, plain, ours = failure
        pytest.fail(
            f"ferry differs from plain torch on\n{program}\nplain: {plain[:2]} "
            f"{plain[2] if plain[0] == 'error' else ''}\nferry: {ours[:2]} "
            f"{ours[2] if ours[0] == 'error' else ''}"
        )


@pytest.mark.parametrize("fault", ["dedup_across_versions", "skip_version_check", "drop_view_bits"])
def test_the_property_catches_each_planted_breach(fault, monkeypatch):
    # The synchronous device: a copy made at the pack holds the version packed. On the
    # asynchronous one a copy may run after a later in-place change, so a stale copy that a
    # planted dedup_across_versions hands out can hold the new bytes and look right.
    monkeypatch.setenv("FERRY_LOOPBACK", "sync")
    failure = first_failure(range(PROPERTY_CASES), faults=(fault,))
    assert failure is not None, f"{PROPERTY_CASES} random programs missed {fault}"


def test_the_property_compares_something():
    """Not a property that cannot fail: the programs raise torch's error in some cases and
    train in others, and a wrong gradient is told apart from a right one."""
    outcomes = [run(Program(seed), with_ferry=False)[0] for seed in range(60)]
    assert outcomes.count("error") > 0 and outcomes.count("grads") > 0
    a = ("grads", [torch.ones(2)])
    assert not same_outcome(a, ("grads", [torch.ones(2) * 2]))
    assert not same_outcome(("error", "RuntimeError", "x"), a)
