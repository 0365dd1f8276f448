"""Selective checkpointing with a third choice per op: offload. With torch's
create_selective_checkpoint_contexts, an op whose policy is CheckpointPolicy.MUST_CPU_OFFLOAD
(or PREFER_CPU_OFFLOAD) has its output saved through ferry's offload session: copied to the
host in forward, reloaded when backward recomputes the region, never recomputed. Gradients are
bitwise those of torch's own checkpoint (which recomputes such ops in eager mode) and of plain
training; the ops run, offloaded and recomputed are counted."""

import functools
import threading

import pytest
import torch
import torch.utils.checkpoint as tc
from torch.utils._python_dispatch import TorchDispatchMode

import ferry
from models import MLP, Block, assert_same_grads, loss_of, twin

P = tc.CheckpointPolicy
HAVE_CUDA = torch.cuda.is_available()


def policy_of(choices):
    """A policy function: `choices` maps aten ops to a policy, everything else recomputes."""

    def policy(ctx, op, *args, **kwargs):
        return choices.get(op, P.PREFER_RECOMPUTE)

    return functools.partial(tc.create_selective_checkpoint_contexts, policy)


ADDMM = torch.ops.aten.addmm.default
GELU = torch.ops.aten.gelu.default
RELU = torch.ops.aten.relu.default


class Count(TorchDispatchMode):
    """Counts the runs of each aten op."""

    def __init__(self):
        super().__init__()
        self.runs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs[func] = self.runs.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def session(policy="ferry", **options):
    # A zero window and a one-tensor stash: every offloaded output leaves the device in forward
    # and comes back from its host copy.
    return ferry.offload(
        policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1, **options
    )


@pytest.mark.parametrize("policy", ["ferry", "trl"])
@pytest.mark.parametrize("make", [MLP, Block], ids=["mlp", "block"])
@pytest.mark.parametrize("must", [True, False], ids=["must", "prefer"])
def test_gradients_equal_torch_checkpoint_and_plain(policy, make, must):
    offload = P.MUST_CPU_OFFLOAD if must else P.PREFER_CPU_OFFLOAD
    context = policy_of({ADDMM: offload, GELU: P.MUST_SAVE})
    shape = (8, 32) if make is MLP else (2, 16, 32)
    plain, model, plain_x, x = twin(make, lambda: torch.randn(*shape))
    theirs, _, their_x, _ = twin(make, lambda: torch.randn(*shape))
    ctx = session(policy)
    for _ in range(2):
        for m, v in ((plain, plain_x), (theirs, their_x), (model, x)):
            m.zero_grad(set_to_none=True)
            v.grad = None
        want = loss_of(plain(plain_x))
        want.backward()
        torch_loss = loss_of(
            tc.checkpoint(theirs, their_x, use_reentrant=False, context_fn=context)
        )
        torch_loss.backward()
        # trl never hears of a release (as the reference): an output past the early stop,
        # never taken back, would stay tracked until the session is entered again.
        got = loss_of(
            ferry.checkpoint(
                model,
                x,
                use_reentrant=False,
                context_fn=context,
                offload=ctx,
                early_stop=policy == "ferry",
            )
        )
        got.backward()
        assert torch.equal(want, got) and torch.equal(torch_loss, got)
        assert_same_grads(plain, model, [plain_x], [x])
        assert_same_grads(theirs, model, [their_x], [x])
        assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    t = ctx.telemetry()
    assert t["offloaded"] > 0 and t["bytes_h2d"] > 0  # really back from the host copies


def run_counted(context, ctx=None, early_stop=False):
    """One MLP step under ferry.checkpoint; the op runs of forward and of backward."""
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    forward, backward = Count(), Count()
    with forward:
        # No early stop: the whole region reruns in backward, the last Linear included.
        out = ferry.checkpoint(
            model, x, use_reentrant=False, context_fn=context, offload=ctx, early_stop=early_stop
        )
    loss = loss_of(out)
    with backward:
        loss.backward()
    return forward.runs, backward.runs


def test_each_op_is_offloaded_saved_or_recomputed_as_chosen():
    ctx = session()
    # Plain checkpoint: the replay reruns the three Linears and both activations.
    _, bwd = run_counted(policy_of({}), ctx)
    assert (bwd.get(ADDMM), bwd.get(GELU), bwd.get(RELU)) == (3, 1, 1)
    assert ctx.telemetry()["offloaded"] == 0
    # Offload the Linears, save the GELU, recompute the ReLU.
    fwd, bwd = run_counted(policy_of({ADDMM: P.MUST_CPU_OFFLOAD, GELU: P.MUST_SAVE}), ctx)
    assert (fwd.get(ADDMM), fwd.get(GELU), fwd.get(RELU)) == (3, 1, 1)
    assert (bwd.get(ADDMM, 0), bwd.get(GELU, 0), bwd.get(RELU)) == (0, 0, 1)
    t = ctx.telemetry()
    assert t["offloaded"] == 3 and t["packed"] == 3  # the three Linears' outputs, nothing else
    assert t["bytes_d2h"] == 4 * 8 * (64 + 64 + 32)
    # The last one's original is still in the forward window (no later offload retired it):
    # handed back as it is; the two others come back from their host copies.
    assert t["stash_hits"] == 1 and t["bytes_h2d"] == 4 * 8 * (64 + 64)
    # The recomputation still holds each reloaded output when it lets it go: freed with
    # record_stream on the compute stream, the core's escaped-reference path.
    assert t["record_stream_fallbacks"] == 2
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_with_early_stop_the_offloaded_outputs_past_the_stop_are_freed_with_the_graph():
    ctx = session()
    states = ferry._C._live_checkpoint_states()
    _, bwd = run_counted(policy_of({ADDMM: P.MUST_CPU_OFFLOAD}), ctx, early_stop=True)
    assert bwd.get(ADDMM, 0) == 0
    # The replay stops before the last Linear: its offloaded output was never taken back, and
    # went with the graph.
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    assert ferry._C._live_checkpoint_states() == states


def test_the_enclosing_offload_region_is_the_session():
    ctx = session()
    ref, model, ref_x, x = twin(MLP, lambda: torch.randn(8, 32))
    ctx.update_model_params(model)
    context = policy_of({ADDMM: P.MUST_CPU_OFFLOAD})
    loss_of(ref(torch.tanh(ref_x * 2))).backward()
    with ctx:
        h = torch.tanh(x * 2)  # saved by the offload region itself
        out = ferry.checkpoint(model, h, use_reentrant=False, context_fn=context)
    loss_of(out).backward()
    assert_same_grads(ref, model, [ref_x], [x])
    t = ctx.telemetry()
    # tanh's output (saved by tanh, and as the region's input: one storage) and the three
    # Linears' outputs.
    assert t["offloaded"] == 4 and t["packed"] == 5 and t["deduplicated"] == 1
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0


def test_inside_no_offload_the_outputs_are_saved_and_without_a_session_it_is_refused():
    context = policy_of({ADDMM: P.MUST_CPU_OFFLOAD})
    ctx = session()
    model = MLP()
    x = torch.randn(8, 32, requires_grad=True)
    with ctx, ferry.no_offload():
        out = ferry.checkpoint(model, x, use_reentrant=False, context_fn=context, early_stop=False)
    with Count() as backward:
        loss_of(out).backward()
    assert backward.runs.get(ADDMM, 0) == 0  # saved, not recomputed
    assert ctx.telemetry()["packed"] == 0
    with pytest.raises(RuntimeError, match="ferry.checkpoint: .*MUST_CPU_OFFLOAD.*aten.addmm"):
        ferry.checkpoint(model, x, use_reentrant=False, context_fn=context)
    with pytest.raises(TypeError, match="ferry.checkpoint: offload should be a ferry.offload"):
        ferry.checkpoint(model, x, use_reentrant=False, context_fn=context, offload=object())


def test_a_mutated_offloaded_output_is_refused_as_torch_refuses_a_saved_one():
    def fn(v, w):
        h = v @ w
        out = h.exp()  # saves its result, not h
        h.mul_(2)  # the cached output changes after it was saved
        return out

    def run(checkpoint, choice, allow=False):
        v = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        context = functools.partial(
            tc.create_selective_checkpoint_contexts,
            lambda ctx, op, *a, **k: (
                choice if op is torch.ops.aten.mm.default else P.PREFER_RECOMPUTE
            ),
            allow_cache_entry_mutation=allow,
        )
        extra = {"offload": session()} if checkpoint is ferry.checkpoint else {}
        checkpoint(fn, v, w, use_reentrant=False, context_fn=context, **extra).sum().backward()
        return v.grad, w.grad

    with pytest.raises(RuntimeError, match="has been mutated"):
        run(tc.checkpoint, P.MUST_SAVE)
    with pytest.raises(RuntimeError, match="ferry.checkpoint: .*has been mutated"):
        run(ferry.checkpoint, P.MUST_CPU_OFFLOAD)
    run(tc.checkpoint, P.MUST_SAVE, allow=True)  # allowed: no check
    run(ferry.checkpoint, P.MUST_CPU_OFFLOAD, allow=True)


def test_a_second_backward_is_refused_as_torch_refuses_it():
    context = policy_of({ADDMM: P.MUST_CPU_OFFLOAD})
    for checkpoint, extra in ((tc.checkpoint, {}), (ferry.checkpoint, {"offload": session()})):
        x = torch.randn(8, 32, requires_grad=True)
        # No early stop: every cached output is taken back by the first backward.
        loss = loss_of(
            checkpoint(MLP(), x, use_reentrant=False, context_fn=context, early_stop=False, **extra)
        )
        if checkpoint is tc.checkpoint:
            # torch recomputes MUST_CPU_OFFLOAD in eager mode: nothing cached, twice is fine.
            loss.backward(retain_graph=True)
            loss.backward()
            continue
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="ferry.checkpoint: Trying to backward an extra"):
            loss.backward()


def test_forward_without_backward_leaves_nothing():
    ctx = session()
    states = ferry._C._live_checkpoint_states()
    x = torch.randn(8, 32, requires_grad=True)
    out = ferry.checkpoint(
        MLP(),
        x,
        use_reentrant=False,
        context_fn=policy_of({ADDMM: P.MUST_CPU_OFFLOAD}),
        offload=ctx,
    )
    assert ctx.tracked() == 3
    assert ferry._C._live_checkpoint_states() == states + 1
    del out
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    assert ferry._C._live_checkpoint_states() == states


def test_backward_on_another_thread():
    ref, model, ref_x, x = twin(Block, lambda: torch.randn(2, 16, 32))
    ctx = session()
    context = policy_of({ADDMM: P.MUST_CPU_OFFLOAD, torch.ops.aten.bmm.default: P.MUST_SAVE})
    loss_of(ref(ref_x)).backward()
    loss = loss_of(ferry.checkpoint(model, x, use_reentrant=False, context_fn=context, offload=ctx))
    errors = []

    def run():
        try:
            loss.backward()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    assert_same_grads(ref, model, [ref_x], [x])
    assert ctx.telemetry()["offloaded"] > 0 and ctx.tracked() == 0


@pytest.mark.gpu
def test_cuda_selective_offload_overlaps_compute():
    """On CUDA the offloaded outputs are copied on ferry's own streams: gradients as with
    torch's checkpoint, and the step takes clearly less than its compute plus its copies done
    one after the other (CUDA events)."""
    torch.manual_seed(0)
    d = 2048
    layers = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(8)]
    ).cuda()
    x = torch.randn(4096, d, device="cuda", requires_grad=True)
    context = policy_of({torch.ops.aten.addmm.default: P.MUST_CPU_OFFLOAD})
    ctx = ferry.offload(min_bytes=0, window_bytes=64 << 20, prefetch_bytes=64 << 20)

    def run(checkpoint, **extra):
        x.grad = None
        layers.zero_grad(set_to_none=True)
        h = x
        for layer in layers:
            h = checkpoint(layer, h, use_reentrant=False, context_fn=context, **extra)
        loss_of(h).backward()

    run(tc.checkpoint)
    want = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    run(ferry.checkpoint, offload=ctx)
    got = [x.grad] + [p.grad for p in layers.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(want, got))

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = float("inf")
        for _ in range(3):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end))
        return best

    saved = policy_of({torch.ops.aten.addmm.default: P.MUST_SAVE})

    def compute_only():  # the same ops run, the outputs kept on the device instead
        h = x
        for layer in layers:
            h = ferry.checkpoint(layer, h, use_reentrant=False, context_fn=saved)
        loss_of(h).backward()

    compute_ms = timed(compute_only)
    before = ctx.telemetry()
    offload_ms = timed(lambda: run(ferry.checkpoint, offload=ctx))
    after = ctx.telemetry()
    moved = (after["bytes_d2h"] - before["bytes_d2h"]) // 4
    assert moved > 0 and after["bytes_h2d"] > before["bytes_h2d"]
    torch.cuda.synchronize()
    assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0
    dev = torch.empty(moved, dtype=torch.uint8, device="cuda")
    host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)

    def copies():
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)

    copy_ms = timed(copies)
    hidden = compute_ms + copy_ms - offload_ms
    print(
        f"selective offload: compute {compute_ms:.2f} ms, copies {copy_ms:.2f} ms, "
        f"step {offload_ms:.2f} ms, hidden {hidden:.2f} ms"
    )
    assert hidden > 0.25 * min(compute_ms, copy_ms), (compute_ms, copy_ms, offload_ms)
