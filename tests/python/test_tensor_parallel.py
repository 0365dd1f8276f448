"""Tensor parallelism (torch's parallelize_module, ColwiseParallel and RowwiseParallel over gloo
on CPU, 2 processes) under ferry's offload, checkpoint and both: each rank's losses and
gradients are bitwise those of the same run without ferry, and what ferry's offload copies out
is the DTensors' local shards, not kept whole (Note [Wrapper subclasses] in
real/python/src/ferry_ext.cpp)."""

import os
import sys

import pytest
import torch

from gloo_ranks import ranks_fixture, run_rank, same_steps

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2
POLICIES = ["ferry", "trl"]
#: Offload under each policy, ferry's checkpoint, and both.
MODES = ["offload-ferry", "offload-trl", "checkpoint", "offload+checkpoint"]
STEPS = 2


class MLP(torch.nn.Module):
    """Two linears; run through `checkpoint` when it is set."""

    checkpoint = None

    def __init__(self, d=16, hidden=64):
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def body(self, x):
        return self.down(torch.relu(self.up(x)))

    def forward(self, x):
        return self.body(x) if self.checkpoint is None else self.checkpoint(self.body, x)


def _plain_parts(t):
    """The plain tensors a tensor's data lives in: a traceable wrapper subclass's (DTensor's,
    AsyncCollectiveTensor's) inner tensors, unwrapped in turn."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [part for name in names for part in _plain_parts(getattr(t, name))]


def _saved_shards(model, x):
    """The bytes of the distinct storages of the activations autograd saves in one forward,
    each DTensor by its local shard: what an offloader may copy out, by plain torch's own
    hooks."""
    params = {q.untyped_storage().data_ptr() for p in model.parameters() for q in _plain_parts(p)}
    storages = {}

    def pack(t):
        for part in _plain_parts(t):
            storage = part.untyped_storage()
            if storage.data_ptr() not in params:
                storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).square().mean()
    return sum(storages.values())


def _run(rank, store_path, out_dir):
    sys.path.insert(0, HERE)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    # The harness of the test process: loopback sessions on the asynchronous device, seeded as
    # FERRY_LOOPBACK says (tests/python/conftest.py).
    import conftest  # noqa: F401
    import ferry

    def body():
        mesh = init_device_mesh("cpu", (WORLD,))

        def build():
            torch.manual_seed(0)
            # The hidden activation stays a DTensor (sharded on its last dimension) between the
            # two linears, so that it is what autograd saves.
            plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
            return parallelize_module(MLP(), mesh, plan)

        def train(ctx, checkpoint=False):
            model = build()
            if checkpoint:
                model.checkpoint = lambda f, v: ferry.checkpoint(f, v, use_reentrant=False)
            gen = torch.Generator().manual_seed(100)  # the same batch on both ranks (TP)
            out = []
            for _ in range(STEPS):
                model.zero_grad(set_to_none=True)
                x = torch.randn(4, 8, 16, generator=gen)
                if ctx is None:
                    loss = model(x).square().mean()
                else:
                    with ctx:
                        loss = model(x).square().mean()
                loss.backward()
                grads = [p.grad.to_local().clone() for p in model.parameters()]
                out.append((loss.detach(), grads))
            return out

        want = train(None)
        shards = _saved_shards(build(), torch.randn(4, 8, 16))
        results = {"shard_bytes": shards}
        for mode in MODES:
            ctx = None
            if "offload" in mode:
                policy = "trl" if "trl" in mode else "ferry"
                ctx = ferry.offload(policy=policy, loopback=True, min_bytes=0, window_bytes=0)
            got = train(ctx, checkpoint="checkpoint" in mode)
            results[mode] = {"bitwise": same_steps(want, got)}
            if ctx is not None:
                telemetry = ctx.telemetry()
                results[mode] |= {
                    "kept_as_is": telemetry["kept_as_is"],
                    "bytes_d2h": telemetry["bytes_d2h"],
                    "tracked": ctx.tracked(),
                }
        return results

    run_rank(rank, WORLD, store_path, out_dir, body)


ranks = ranks_fixture(_run, WORLD, "tensor_parallel")


@pytest.mark.parametrize("mode", MODES)
def test_tensor_parallel_training_is_unchanged(ranks, mode):
    for rank, results in enumerate(ranks):
        assert results[mode]["bitwise"], (rank, results)
        assert results[mode].get("tracked", 0) == 0, (rank, results)


@pytest.mark.parametrize("policy", POLICIES)
def test_what_is_offloaded_is_the_dtensors_local_shards(ranks, policy):
    for rank, results in enumerate(ranks):
        got = results["offload-" + policy]
        # Nothing kept whole; every saved activation copied out in each step, each DTensor as
        # its local shard (the counters are the session's, over its steps).
        assert got["kept_as_is"] == 0, (rank, results)
        assert got["bytes_d2h"] == STEPS * results["shard_bytes"] > 0, (rank, results)
