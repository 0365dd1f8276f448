"""Regions (``ferry.offload``, ``ferry.no_offload``) are an entry on ferry's region stack and a
pair of hooks on torch's stack of saved-tensor hooks; both stay the same in every order of
entering and leaving: left out of order, a region raises "regions must nest" and is gone from
both all the same, so nothing packs into it afterwards (a selective checkpoint that offloads
outside any region is refused, as documented). Entered while torch's
``allow_mutation_on_saved_tensors`` is on, a region leaves its saved tensors to that mode, and
the gradients are those of plain torch, bit for bit."""

import functools
import itertools
import threading

import pytest
import torch
import torch.utils.checkpoint as tc

import ferry
from models import MLP, TinyLM, loss_of

P = tc.CheckpointPolicy
OFFLOAD_ADDMM = functools.partial(
    tc.create_selective_checkpoint_contexts,
    lambda ctx, op, *args, **kwargs: (
        P.MUST_CPU_OFFLOAD if op is torch.ops.aten.addmm.default else P.PREFER_RECOMPUTE
    ),
)


def torch_hooks():
    """torch's stack of saved-tensor hooks on this thread, innermost last (read by popping it
    and pushing it back)."""
    autograd = torch._C._autograd
    stack = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        autograd._pop_saved_tensors_default_hooks()
        stack.append(top)
    for hooks in reversed(stack):
        autograd._push_saved_tensors_default_hooks(*hooks)
    return stack[::-1]


def make(kind):
    if kind == "offload":
        return ferry.offload(loopback=True, min_bytes=0, window_bytes=0)
    return ferry.no_offload()


def expected_enclosing(open_regions):
    """What ``_enclosing_session`` says inside ``open_regions`` (innermost last)."""
    if not open_regions:
        return None
    inner = open_regions[-1]
    return inner._session if isinstance(inner, ferry.offload) else "no_offload"


def assert_enclosing(open_regions):
    got, want = ferry._C._enclosing_session(), expected_enclosing(open_regions)
    if isinstance(want, str) or want is None:
        assert got == want
    else:
        assert got is want, "packing goes to another region's session"


def assert_no_region_left():
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert ferry._C._enclosing_session() is None
    # Outside any region an output chosen for offload has no session: refused, as documented
    # (docs/real.md, "Selective checkpointing with offload"), never offloaded into a stale one.
    x = torch.randn(4, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="ferry.checkpoint: .*MUST_CPU_OFFLOAD.*aten.addmm"):
        ferry.checkpoint(MLP(), x, use_reentrant=False, context_fn=OFFLOAD_ADDMM)


ORDERS = [
    (kinds, exits)
    for n in (2, 3)
    for kinds in itertools.product(("offload", "no_offload"), repeat=n)
    for exits in itertools.permutations(range(n))
]


@pytest.mark.parametrize(
    "kinds,exits", ORDERS, ids=[f"{'-'.join(k)}:exit{''.join(map(str, e))}" for k, e in ORDERS]
)
def test_regions_left_in_any_order_leave_both_stacks_as_the_open_ones_say(kinds, exits):
    regions = [make(kind) for kind in kinds]
    for region in regions:
        region.__enter__()
    assert len(torch_hooks()) == len(regions)
    still_open = list(regions)
    for i in exits:
        region = regions[i]
        innermost = still_open[-1] is region
        still_open.remove(region)
        if innermost:
            region.__exit__(None, None, None)
        else:
            with pytest.raises(RuntimeError, match="ferry: regions must nest"):
                region.__exit__(None, None, None)
        assert len(torch_hooks()) == len(still_open)
        assert_enclosing(still_open)
        if still_open:
            # A tensor saved now goes to the innermost region still open.
            x = torch.randn(64, 64, requires_grad=True)
            loss = (x * 2).sin().sum()
            loss.backward()
            assert torch.equal(x.grad, 2 * (x * 2).cos())
    assert_no_region_left()


def test_the_out_of_order_exit_of_the_issue_leaves_no_session_behind():
    a, b = ferry.offload(loopback=True), ferry.no_offload()
    a.__enter__()
    b.__enter__()
    with pytest.raises(RuntimeError, match="regions must nest"):
        a.__exit__(None, None, None)
    b.__exit__(None, None, None)
    assert_no_region_left()


def test_a_region_left_twice_raises_and_leaves_the_others_alone():
    outer, inner = ferry.no_offload(), make("offload")
    with outer:
        inner.__enter__()
        inner.__exit__(None, None, None)
        with pytest.raises(RuntimeError, match="regions must nest: .*not open on this thread"):
            inner.__exit__(None, None, None)
        assert len(torch_hooks()) == 1
        assert_enclosing([outer])
    assert_no_region_left()


def test_a_region_never_entered_cannot_be_left():
    region = make("offload")
    with pytest.raises(RuntimeError, match="regions must nest: .*not open on this thread"):
        region.__exit__(None, None, None)
    assert_no_region_left()


def test_a_region_is_left_on_the_thread_that_entered_it():
    region = make("offload")
    region.__enter__()
    errors = []

    def leave():
        try:
            region.__exit__(None, None, None)
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=leave)
    t.start()
    t.join()
    assert len(errors) == 1 and "not open on this thread" in errors[0]
    assert_enclosing([region])
    region.__exit__(None, None, None)
    assert_no_region_left()


def test_an_open_region_entered_again_nests_in_itself():
    ctx = make("offload")
    with ctx:
        with ctx:
            assert len(torch_hooks()) == 2
            assert_enclosing([ctx, ctx])
        assert len(torch_hooks()) == 1
        assert_enclosing([ctx])
    keep = ferry.no_offload()
    with keep:
        with keep:
            assert len(torch_hooks()) == 2
        assert len(torch_hooks()) == 1
    assert_no_region_left()


def test_a_region_whose_hooks_cannot_be_pushed_is_not_entered():
    ctx = make("offload")
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks here"):
        with pytest.raises(RuntimeError, match="no hooks here"):
            ctx.__enter__()
    assert_no_region_left()
    with ctx:  # and it can be entered afterwards
        assert_enclosing([ctx])
    assert_no_region_left()


def test_torch_hooks_opened_inside_a_region_survive_it_being_left_first():
    ctx = make("offload")
    mine = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    ctx.__enter__()
    mine.__enter__()
    with pytest.raises(RuntimeError, match="regions must nest"):
        ctx.__exit__(None, None, None)
    hooks = torch_hooks()
    assert len(hooks) == 1 and hooks[0][0] is mine.pack_hook
    assert ferry._C._enclosing_session() is None
    mine.__exit__(None, None, None)
    assert_no_region_left()


def test_a_failed_forward_under_a_plan_leaves_no_region(monkeypatch):
    """``offload(plan=...)``: its plan's enter failing leaves neither stack changed."""
    from ferry import _plan

    calls = []

    class Failing(_plan.PlanRun):
        def __init__(self, plan, ctx, model):
            pass

        def enter(self):
            calls.append("enter")
            raise RuntimeError("plan refused")

        def active(self):
            return False

    monkeypatch.setattr(_plan, "PlanRun", Failing)
    monkeypatch.setattr(_plan, "load_plan", lambda plan: plan)
    monkeypatch.setattr(_plan, "offload_options", lambda plan: {"policy": "ferry"})
    ctx = ferry.offload(plan={}, loopback=True)
    with pytest.raises(RuntimeError, match="plan refused"):
        with ctx:
            pass
    assert calls == ["enter"]
    assert_no_region_left()


# --- allow_mutation_on_saved_tensors ----------------------------------------------------------


def mutated_after_save(region):
    """The issue's program: a saved tensor mutated in place before backward, all under
    allow_mutation_on_saved_tensors; returns the gradients."""
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        with region() if region is not None else torch.enable_grad():
            h = x @ w
            y = h.sin()  # saves h
            with torch.no_grad():
                h.mul_(2)
            z = h.cos()  # saves h again, at its new version
            loss = y.sum() + z.sum()
        loss.backward()
    return x.grad, w.grad


REGIONS = {
    "ferry": lambda: ferry.offload(loopback=True, min_bytes=0),
    "ferry-window0": lambda: ferry.offload(loopback=True, min_bytes=0, window_bytes=0),
    "trl": lambda: ferry.offload(policy="trl", loopback=True, min_bytes=0),
    "trl-window0": lambda: ferry.offload(
        policy="trl", loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
    ),
    "no_offload": ferry.no_offload,
}


@pytest.mark.parametrize("name", list(REGIONS))
def test_allow_mutation_on_saved_tensors_gives_plain_gradients(name):
    want = mutated_after_save(None)
    got = mutated_after_save(REGIONS[name])
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_allow_mutation_on_saved_tensors_with_no_offload_inside_offload():
    def nested():
        outer = ferry.offload(loopback=True, min_bytes=0, window_bytes=0)
        inner = ferry.no_offload()

        class Both:
            def __enter__(self):
                outer.__enter__()
                inner.__enter__()

            def __exit__(self, *exc):
                inner.__exit__(*exc)
                outer.__exit__(*exc)

        return Both()

    for a, b in zip(mutated_after_save(None), mutated_after_save(nested)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_allow_mutation_on_saved_tensors_with_offload_model_and_a_step_before_backward(policy):
    """offload_model's region and its head's, and an optimizer step between the forward and
    the backward (parameters mutated after being saved), as plain torch allows in that mode."""

    def run(use_ferry):
        torch.manual_seed(0)
        model = TinyLM()
        x = torch.randn(2, 16, 32)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ctx = (
            ferry.offload_model(
                model,
                policy=policy,
                loopback=True,
                min_bytes=0,
                window_bytes=0,
                max_fwd_stash_size=1,
            )
            if use_ferry
            else None
        )
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            for _ in range(2):
                opt.zero_grad()
                with ctx if ctx is not None else torch.enable_grad():
                    out = model(x)
                    loss = loss_of(out) + out.sin().sum()
                    with torch.no_grad():
                        out.mul_(3)  # saved by sin (and by the head's own backward: no)
                first = loss_of(model(x))  # a second forward, outside the region
                opt.step()
                (loss + first).backward()
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
