"""ferry.checkpoint's interface as torch.utils.checkpoint's in torch 2.11: the use_reentrant
default and warning, the reentrant variant, checkpoint_sequential, no_grad, the global early
stop switch, context_fn (selective checkpointing) and keywords that never reach the function."""

import contextlib
import logging
import warnings

import pytest
import torch
import torch.utils.checkpoint as tc
from torch import nn

import ferry
from models import MLP, Block, assert_same_grads, loss_of, twin


def run_twice(make_model, make_input, ref_forward, forward, steps=2):
    """Trains twin copies; each step's loss and every gradient bitwise equal."""
    ref, model, ref_x, x = twin(make_model, make_input)
    for _ in range(steps):
        for m, v in ((ref, ref_x), (model, x)):
            m.zero_grad(set_to_none=True)
            v.grad = None
        want = loss_of(ref_forward(ref, ref_x))
        want.backward()
        got = loss_of(forward(model, x))
        got.backward()
        assert torch.equal(want, got)
        assert_same_grads(ref, model, [ref_x], [x])


def test_missing_use_reentrant_warns_and_is_reentrant_as_in_torch():
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.warns(UserWarning, match="ferry.checkpoint: the use_reentrant parameter"):
        y = ferry.checkpoint(torch.sin, x)
    assert type(y.grad_fn).__name__ == "_ReentrantBackward"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ferry.checkpoint(torch.sin, x, use_reentrant=False)


@pytest.mark.parametrize(
    "make_model,make_input",
    [(MLP, lambda: torch.randn(8, 32)), (Block, lambda: torch.randn(2, 16, 32))],
    ids=["mlp", "block"],
)
def test_reentrant_equals_torch_reentrant(make_model, make_input):
    run_twice(
        make_model,
        make_input,
        lambda m, v: tc.checkpoint(m, v, use_reentrant=True),
        lambda m, v: ferry.checkpoint(m, v, use_reentrant=True),
    )


def test_reentrant_replays_dropout_and_autocast():
    def region(v, w):
        return torch.dropout(v @ w, 0.5, True).relu() @ w

    def loss(ckpt):
        torch.manual_seed(3)
        x = torch.randn(8, 16, requires_grad=True)
        w = torch.randn(16, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ckpt(region, x, w, use_reentrant=True)
        loss_of(out.float()).backward()
        return out.detach(), x.grad, w.grad

    for a, b in zip(loss(tc.checkpoint), loss(ferry.checkpoint)):
        assert torch.equal(a, b)


def test_reentrant_refuses_what_torch_refuses():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="unexpected keyword arguments: scale"):
        ferry.checkpoint(lambda v, scale: v * scale, x, scale=2.0, use_reentrant=True)
    with pytest.raises(ValueError, match="`context_fn`, `debug` or `offload`"):
        ferry.checkpoint(torch.sin, x, use_reentrant=True, debug=True)
    y = ferry.checkpoint(torch.sin, x, use_reentrant=True).sum()
    with pytest.raises(RuntimeError, match="use_reentrant=True is incompatible with .grad()"):
        torch.autograd.grad(y, x)
    with pytest.warns(UserWarning, match="none of the inputs has requires_grad=True"):
        ferry.checkpoint(torch.sin, torch.randn(4), use_reentrant=True)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("segments", [1, 2, 3])
def test_checkpoint_sequential_equals_torch(use_reentrant, segments):
    def make():
        return nn.Sequential(
            nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 16)
        )

    run_twice(
        make,
        lambda: torch.randn(4, 16),
        lambda m, v: tc.checkpoint_sequential(m, segments, v, use_reentrant=use_reentrant),
        lambda m, v: ferry.checkpoint_sequential(m, segments, v, use_reentrant=use_reentrant),
    )


def test_checkpoint_sequential_refuses_unknown_keywords_and_bad_segments():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="unexpected keyword arguments: debug"):
        ferry.checkpoint_sequential(seq, 1, x, use_reentrant=False, debug=True)
    with pytest.raises(ValueError, match="segments must be between 1 and"):
        ferry.checkpoint_sequential(seq, 3, x, use_reentrant=False)
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed"):
        ferry.checkpoint_sequential(seq, 1, x)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_under_no_grad_the_function_just_runs(use_reentrant):
    calls = []

    def fn(v):
        calls.append(torch.is_grad_enabled())
        return v.exp() * 2

    x = torch.randn(5, requires_grad=True)
    with torch.no_grad():
        y = ferry.checkpoint(fn, x, use_reentrant=use_reentrant)
    assert calls == [False]
    assert y.grad_fn is None
    assert torch.equal(y, x.detach().exp() * 2)


def test_global_early_stop_switch_is_honoured():
    # With early stop the replay ends at the last saved tensor: what follows never reruns.
    def count_runs(**ctx):
        runs = []

        def fn(v):
            h = v.sin()
            h = h * h  # saves h
            runs.append("tail")
            return h + 1  # saves nothing after the last saved tensor

        x = torch.randn(6, requires_grad=True)
        with tc.set_checkpoint_early_stop(ctx["global_early_stop"]):
            y = ferry.checkpoint(fn, x, use_reentrant=False, early_stop=ctx["early_stop"]).sum()
        y.backward()
        return len(runs)

    assert count_runs(global_early_stop=True, early_stop=True) == 1
    assert count_runs(global_early_stop=False, early_stop=True) == 2
    assert count_runs(global_early_stop=True, early_stop=False) == 1


def test_torch_keywords_never_reach_the_function():
    seen = {}

    def fn(v, **kwargs):
        seen.update(kwargs)
        return v.sin()

    x = torch.randn(3, requires_grad=True)
    ferry.checkpoint(
        fn,
        x,
        use_reentrant=False,
        determinism_check="none",
        debug=False,
        context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext()),
        preserve_rng_state=False,
        early_stop=True,
        scale=1,
    ).sum().backward()
    assert seen == {"scale": 1}


def _selective_policy(ctx, op, *args, **kwargs):
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return tc.CheckpointPolicy.MUST_SAVE
    return tc.CheckpointPolicy.PREFER_RECOMPUTE


def test_selective_checkpoint_context_equals_torch():
    def context():
        return tc.create_selective_checkpoint_contexts(_selective_policy)

    run_twice(
        MLP,
        lambda: torch.randn(8, 32),
        lambda m, v: tc.checkpoint(m, v, use_reentrant=False, context_fn=context),
        lambda m, v: ferry.checkpoint(m, v, use_reentrant=False, context_fn=context),
    )


class _CountAddmm(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten.addmm calls that really run (a Linear's forward with bias)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.addmm.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _addmms_in_backward(context_fn):
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    # No early stop: the whole region reruns, the last Linear included.
    out = ferry.checkpoint(model, x, use_reentrant=False, context_fn=context_fn, early_stop=False)
    with _CountAddmm() as counter:
        loss_of(out).backward()
    return counter.count


def test_selective_checkpoint_saves_matmuls_instead_of_recomputing_them():
    def selective():
        return tc.create_selective_checkpoint_contexts(_selective_policy)

    assert _addmms_in_backward(ferry._checkpoint._no_context) == 3  # the replay reruns them
    assert _addmms_in_backward(selective) == 0  # saved in forward, handed back in the replay


def test_cuda_first_initialized_inside_the_region_is_refused(monkeypatch):
    # Simulated on CPU: CUDA reads as initialized only once the region's forward ran.
    state = {"initialized": False}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["initialized"])

    def fn(v):
        state["initialized"] = True
        return v.sin()

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="CUDA state was initialized in the forward pass"):
        ferry.checkpoint(fn, x, use_reentrant=False)
    state["initialized"] = False
    ferry.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False).sum().backward()
    ferry.checkpoint(fn, x, use_reentrant=False).sum().backward()  # initialized before: fine


def test_leaf_inputs_reach_the_replay_as_the_same_objects_as_in_torch():
    w = torch.randn(4, requires_grad=True)
    x = torch.randn(4)
    h = w * 2  # not a leaf: the replay gets another object over the same storage

    def run(checkpoint):
        seen = []

        def fn(a, b, c):
            seen.append((a, b, c))
            return (a * b * c).sin().sum()

        checkpoint(fn, w, x, h, use_reentrant=False).backward(retain_graph=True)
        assert len(seen) == 2  # forward, then the replay
        return seen[1]

    ours = run(ferry.checkpoint)
    theirs = run(tc.checkpoint)
    assert ours[0] is w and ours[1] is x
    assert theirs[0] is w and theirs[1] is x
    assert ours[2] is not h and ours[2].data_ptr() == h.data_ptr()


def _differs_in_replay():
    calls = []

    def fn(v):
        calls.append(True)
        h = v if len(calls) == 1 else v.double()  # the replay saves a float64 tensor
        return h.sin().float()

    return fn


def _debug_failure(checkpoint, match="different metadata", **kwargs):
    x = torch.randn(8, requires_grad=True)
    y = checkpoint(_differs_in_replay(), x, use_reentrant=False, **kwargs).sum()
    with pytest.raises(RuntimeError, match=match) as error:
        y.backward()
    return str(error.value)


def test_debug_lists_the_operations_of_the_forward_and_of_the_recomputation(monkeypatch):
    # torch's debug mode lists both sides' operations; so does ferry's.
    # torch's debug mode logs each op with arguments pytest's log capture cannot format: it
    # stays with torch's own handler here.
    monkeypatch.setattr(logging.getLogger("LoggingTensor"), "propagate", False)
    _debug_failure(
        tc.checkpoint, match="Operations executed during the original forward", debug=True
    )
    message = _debug_failure(ferry.checkpoint, debug=True)
    assert message.startswith("ferry.checkpoint: Recomputed values")
    forward = message.split("Operations executed during the original forward:")[1]
    forward, recompute = forward.split("Operations executed during recomputation:")
    assert "aten.sin.default" in forward and "aten._to_copy.default" not in forward
    assert "aten._to_copy.default" in recompute  # early stop: sin's save ends the replay
    assert "test_checkpoint_api.py" in recompute  # the user's line that ran the op
    # Without debug, no listing; torch's global switch turns it on.
    assert "Operations executed" not in _debug_failure(ferry.checkpoint)
    with tc.set_checkpoint_debug_enabled(True):
        assert "Operations executed" in _debug_failure(ferry.checkpoint)
    with tc.set_checkpoint_debug_enabled(False):
        assert "Operations executed" not in _debug_failure(ferry.checkpoint, debug=True)


def test_debug_mode_trains_like_torch(monkeypatch):
    monkeypatch.setattr(logging.getLogger("LoggingTensor"), "propagate", False)
    run_twice(
        MLP,
        lambda: torch.randn(8, 32),
        lambda m, v: tc.checkpoint(m, v, use_reentrant=False, debug=True),
        lambda m, v: ferry.checkpoint(m, v, use_reentrant=False, debug=True),
    )
