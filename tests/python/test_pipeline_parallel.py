"""Pipeline parallelism (torch.distributed.pipelining over gloo on CPU, 2 processes): a plain MLP
stack and a tiny Hugging Face Llama split into stages by layers train under ScheduleGPipe,
Schedule1F1B and ScheduleInterleaved1F1B (two stages a rank) with 4 micro-batches, each stage's
layers under ferry's offload, ferry's checkpoint, both, and torch's checkpoint inside ferry's
offload. Each rank's losses and gradients are bitwise those of the same pipeline without ferry,
and each offloaded tensor came back exactly once, prefetched for the backward of its own
micro-batch (Note [Nodes and backward passes] in real/src/session.cpp). Planted faults: the
prefetch of later micro-batches' tensors, and a dropped wait for a reload."""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import pipeline_ranks  # noqa: E402
from gloo_ranks import ranks_fixture, run_rank  # noqa: E402
from pipeline_ranks import MODES, SCHEDULES  # noqa: E402

WORLD = 2
MODELS = ("mlp", "llama")
OFFLOADED = [m for m in MODES if "offload" in m]
#: Seeds of the asynchronous loopback device tried with the reload wait dropped.
FAULT_SEEDS = range(1, 11)


def _options():
    """The sessions' options: every saved tensor offloaded and waited for at once (no window),
    and a prefetch budget of three tensors (the least in flight, Note [Tensors in flight]), so
    that a backward prefetching another micro-batch's tensors brings its own on demand."""
    return dict(loopback=True, min_bytes=0, window_bytes=0, prefetch_bytes=1)


def _same(want, got):
    (want_losses, want_grads, _), (got_losses, got_grads, _) = want, got
    return all(torch.equal(a, b) for a, b in zip(want_losses, got_losses)) and all(
        torch.equal(a, b) for wg, gg in zip(want_grads, got_grads) for a, b in zip(wg, gg)
    )


def _run(rank, store_path, out_dir):
    sys.path.insert(0, HERE)
    import torch.distributed as dist

    # The harness of the test process: loopback sessions on the asynchronous device, seeded as
    # FERRY_LOOPBACK says (tests/python/conftest.py).
    import conftest  # noqa: F401
    import ferry
    import ferry.testing

    def body():
        results = {}
        for model in MODELS:
            for schedule in SCHEDULES:
                want = pipeline_ranks.train(model, schedule, "plain", None)
                results[model, schedule, "plain"] = {"state": want[2]}
                for mode in MODES[1:]:
                    got = pipeline_ranks.train(
                        model, schedule, mode, lambda: ferry.offload(**_options())
                    )
                    results[model, schedule, mode] = {"bitwise": _same(want, got), "state": got[2]}
        # Planted: each backward prefetches the tensors of every forward its session holds,
        # latest first. The gradients stay torch's; the traffic does not.
        for schedule in ("gpipe", "1f1b"):
            want = pipeline_ranks.train("mlp", schedule, "plain", None)
            got = pipeline_ranks.train(
                "mlp",
                schedule,
                "offload",
                lambda: ferry.testing.planted_offload(
                    faults=("prefetch_later_forwards",), **_options()
                ),
            )
            results["planted", schedule, "prefetch_later_forwards"] = {
                "bitwise": _same(want, got),
                "state": got[2],
            }
        # Planted: compute does not wait for a reload. Seeds are tried until one rank's gradients
        # differ (the ranks agree on stopping).
        want = pipeline_ranks.train("mlp", "1f1b", "plain", None)
        caught = None
        for seed in FAULT_SEEDS:
            got = pipeline_ranks.train(
                "mlp",
                "1f1b",
                "offload",
                lambda seed=seed: ferry.testing.planted_offload(
                    faults=("skip_reload_wait",),
                    **_options(),
                    loopback_streams="async",
                    loopback_seed=seed,
                ),
            )
            differs = torch.tensor([0 if _same(want, got) else 1])
            dist.all_reduce(differs, op=dist.ReduceOp.MAX)
            if differs.item():
                caught = seed
                break
        results["planted", "1f1b", "skip_reload_wait"] = {"caught_at_seed": caught}
        return results

    run_rank(rank, WORLD, store_path, out_dir, body)


ranks = ranks_fixture(_run, WORLD, "pipeline_parallel")


def _came_back_once(state):
    """Every offloaded tensor came back exactly once, prefetched for its own backward (or still
    on the device), and the session holds nothing."""
    return (
        state["offloaded"] > 0
        and state["prefetched"] + state["stash_hits"] == state["offloaded"]
        and state["on_demand"] == 0
        and state["tracked"] == 0
        and state["live_device_buffers"] == 0
    )


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("mode", MODES[1:])
def test_pipeline_training_is_unchanged(ranks, model, schedule, mode):
    for rank, results in enumerate(ranks):
        got = results[model, schedule, mode]
        assert got["bitwise"], (rank, got)
        assert got["state"]["checkpoint_states"] == 0, (rank, got)
        sessions = got["state"]["sessions"]
        assert len(sessions) == ("offload" in mode) * SCHEDULES[schedule][1], (rank, got)
        for state in sessions:
            assert state["races"] == 0, (rank, got)
            assert _came_back_once(state), (rank, got)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_prefetching_later_micro_batches_is_caught(ranks, schedule):
    """With the planted fault, the backward of micro-batch k prefetches the tensors of the later
    micro-batches first (the stage's newest forward): the gradients stay torch's, but the first
    stage brings its own tensors back on demand and reloads some twice."""
    first = ranks[0]["planted", schedule, "prefetch_later_forwards"]
    assert first["bitwise"], first
    (state,) = first["state"]["sessions"]
    assert not _came_back_once(state), first
    assert state["on_demand"] > 0, first


def test_a_dropped_reload_wait_is_caught(ranks):
    for results in ranks:
        assert results["planted", "1f1b", "skip_reload_wait"]["caught_at_seed"] is not None


def _stage_and_batches():
    """One stage of an MLP stack (the first two layers) and three micro-batches."""
    whole = pipeline_ranks.MLPStack(2)
    stage = pipeline_ranks.MLPStage(whole, 0, 2, True, False, lambda f, v: f(v))
    gen = torch.Generator().manual_seed(3)
    shape = (2, pipeline_ranks.SEQ, pipeline_ranks.WIDTH)
    return stage, [torch.randn(shape, generator=gen) for _ in range(3)]


#: A first stage's order of forwards (F) and backwards (B) of micro-batches 0 to 2 under GPipe
#: and 1F1B, with two stages.
ORDERS = {
    "gpipe": ["F0", "F1", "F2", "B0", "B1", "B2"],
    "1f1b": ["F0", "F1", "B0", "F2", "B1", "B2"],
}


def _in_order(stage, micro, ctx, order):
    """Runs `order` on `stage`, each forward inside `ctx`; returns the gradients after each
    backward."""
    outs, grads = {}, []
    for step in order:
        k = int(step[1])
        if step[0] == "F":
            with ctx:
                outs[k] = stage(micro[k])
        else:
            outs.pop(k).square().mean().backward()
            grads.append([p.grad.clone() for p in stage.parameters()])
    return grads


@pytest.mark.parametrize("order", list(ORDERS))
def test_a_session_holds_several_micro_batches_in_one_process(order):
    """A first stage's order under GPipe and 1F1B, in one process: ferry's policy gives torch's
    gradients, each offloaded tensor back once, prefetched for its own backward."""
    import contextlib

    import ferry

    stage, micro = _stage_and_batches()
    want = _in_order(stage, micro, contextlib.nullcontext(), ORDERS[order])
    stage.zero_grad(set_to_none=True)
    ctx = ferry.offload(**_options())
    got = _in_order(stage, micro, ctx, ORDERS[order])
    for w, g in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(w, g))
    state = dict(
        ctx.telemetry(), tracked=ctx.tracked(), live_device_buffers=ctx.live_device_buffers()
    )
    assert _came_back_once(state), {k: state[k] for k in ("offloaded", "prefetched", "on_demand")}


@pytest.mark.parametrize("order", list(ORDERS))
def test_trl_refuses_a_backward_after_a_later_forward_naming_the_fix(order):
    """Under policy="trl" (the reference's scheduling as TRL ships it) each entry forgets what
    earlier forwards saved, so the first micro-batch's backward fails: the error says why and
    names policy="ferry"."""
    import ferry

    stage, micro = _stage_and_batches()
    ctx = ferry.offload(policy="trl", loopback=True, min_bytes=0)
    with pytest.raises(
        ValueError,
        match=r"untracked tensor with id [0-9]+: the offload context was entered again before "
        r"the backward .* needs policy=\"ferry\"",
    ):
        _in_order(stage, micro, ctx, ORDERS[order])


def test_trl_seed_holds_gpipe_forwards_and_refuses_1f1b_as_its_reference():
    """policy="trl-seed" (the reference's first release) keeps its tracker across entries:
    GPipe's order gives torch's gradients; in 1F1B's a forward after a backward finds the
    later micro-batch's tensors tracked and raises the reference's error."""
    import contextlib

    import ferry

    stage, micro = _stage_and_batches()
    want = _in_order(stage, micro, contextlib.nullcontext(), ORDERS["gpipe"])
    stage.zero_grad(set_to_none=True)
    ctx = ferry.offload(policy="trl-seed", loopback=True, min_bytes=0)
    got = _in_order(stage, micro, ctx, ORDERS["gpipe"])
    for w, g in zip(want, got):
        assert all(torch.equal(a, b) for a, b in zip(w, g))
    ctx = ferry.offload(policy="trl-seed", loopback=True, min_bytes=0)
    with pytest.raises(ValueError, match="Backward pass should have cleared tracker"):
        _in_order(stage, micro, ctx, ORDERS["1f1b"])
