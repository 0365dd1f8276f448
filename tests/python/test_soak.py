"""No state left behind, ever: 1,000 training steps of a small model on the loopback device
under ferry, under trl, with checkpoint and with ferry + checkpoint. After a warm-up, tracked
tensors, live device buffers, ferry's host pool, the live checkpoint states, the Python objects
gc tracks and the process's resident memory stay flat, and no step's autograd graph outlives the
step. A second test plants a leak (each step's loss, and so its graph, kept in a list) and shows
the same checks catch it."""

import contextlib
import gc
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch import nn

import ferry

STEPS = 1000
WARMUP = 200  # allocator arenas, the pool and torch's lazily grown caches settle before this
WIDTH, BATCH = 64, 8
# Resident memory may move by this much between the end of warm-up and the last step. The run
# allocates nothing that should outlive a step; what remains is allocator noise (glibc takes and
# trims whole pages): 0 to 40 KiB over the 800 steps in most runs, but the first run in a process
# also takes about 1 MiB once (lazily grown caches in torch and the allocator), usually near step
# 128 and sometimes after the warm-up. The planted leak below (one loss graph a step, about
# 13 KiB) grows by 10 to 11 MiB over the same steps, more than twice this bound.
RSS_TOLERANCE = 4 << 20
# Python objects gc tracks may differ by this many between the two samples (a few interned or
# cached objects created lazily by torch); a leak of one object a step is 900.
GC_TOLERANCE = 50


class Sentinel:
    """Put in an autograd node's metadata, it lives exactly as long as the node."""


def mark_graph(root):
    """Weak references to a sentinel in every node of root's graph (parameters' AccumulateGrad
    nodes excepted: they live as long as their parameter, by design)."""
    refs, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ != "AccumulateGrad":
            sentinel = Sentinel()
            node.metadata["ferry_soak"] = sentinel
            refs.append(weakref.ref(sentinel))
        stack.extend(next_node for next_node, _ in node.next_functions)
    return refs


def rss():
    """Resident bytes, from /proc/self/statm (Linux, as CI; no dependency beyond torch's)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


class Model(nn.Module):
    """A 2-layer MLP of width 64; each layer optionally checkpointed by ferry."""

    def __init__(self, checkpoint):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.checkpoint = checkpoint

    def forward(self, x):
        for block in self.blocks:
            x = ferry.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return x


CONFIGS = {
    "ferry": dict(offload="ferry"),
    "trl": dict(offload="trl"),
    "checkpoint": dict(checkpoint=True),
    "ferry+checkpoint": dict(offload="ferry", checkpoint=True),
}


def soak(offload=None, checkpoint=False, leak=None):
    """Trains STEPS steps; returns the samples taken at the end of warm-up and at the end."""
    torch.manual_seed(0)
    model = Model(checkpoint)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = None
    if offload is not None:
        # min_bytes=0 and a zero window: every saved activation is offloaded and reloaded.
        ctx = ferry.offload(
            policy=offload, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
        )
        ctx.update_model_params(model)
    states = ferry._C._live_checkpoint_states()
    x = torch.randn(BATCH, WIDTH)
    target = torch.randn(BATCH, WIDTH)
    alive = []  # weak references to graph nodes of past steps still alive
    samples = {}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), target)
        refs = mark_graph(loss.grad_fn)
        loss.backward()
        opt.step()
        if leak is not None:
            leak.append(loss)
        del loss
        # Kept pruned so the bookkeeping itself allocates nothing that lasts.
        alive = [ref for ref in alive + refs if ref() is not None]
        del refs
        # Every step: nothing tracked, no device buffer held, no checkpoint state left.
        assert ferry._C._live_checkpoint_states() == states, f"step {step}"
        if ctx is not None:
            assert ctx.tracked() == 0 and ctx.live_device_buffers() == 0, f"step {step}"
            if offload == "trl":
                assert ctx.live_host_buffers() == 0, f"step {step}: trl holds host copies"
        if step + 1 in (WARMUP, STEPS):
            gc.collect()
            samples[step + 1] = dict(
                rss=rss(),
                gc_objects=len(gc.get_objects()),
                live_nodes=sum(ref() is not None for ref in alive),
                pool=(ctx.live_host_buffers(), ctx.telemetry()["pinned_bytes"])
                if ctx is not None
                else None,
            )
    if ctx is not None:
        assert ctx.telemetry()["offloaded"] > 0
    return samples[WARMUP], samples[STEPS]


def assert_flat(warm, end):
    assert end["live_nodes"] == 0, f"{end['live_nodes']} autograd nodes outlived their step"
    assert end["pool"] == warm["pool"], "the host pool grew after warm-up"
    assert end["gc_objects"] - warm["gc_objects"] <= GC_TOLERANCE, (warm, end)
    assert end["rss"] - warm["rss"] <= RSS_TOLERANCE, (
        f"resident memory grew by {(end['rss'] - warm['rss']) / 1024:.0f} KiB after warm-up"
    )


def soak_in_a_fresh_process(config):
    """Runs soak(config) in a new interpreter and returns its two samples. Resident memory is
    the process's: in a test process that already ran other suites (compiled models, transformers)
    the allocator's arenas move by megabytes for reasons of their own, so the soak gets a process
    of its own."""
    done = subprocess.run(
        [sys.executable, __file__, config], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    samples = json.loads(done.stdout.strip().splitlines()[-1])
    return samples["warm"], samples["end"]


@pytest.mark.parametrize("config", list(CONFIGS))
def test_no_state_left_behind(config):
    warm, end = soak_in_a_fresh_process(config)
    print(f"{config}: warm-up {warm}, end {end}")
    assert_flat(warm, end)


def test_planted_leak_is_caught():
    warm, end = soak_in_a_fresh_process("leak")
    print(f"leak: warm-up {warm}, end {end}")
    # Each kept loss keeps its whole graph: every node of every step is still alive...
    assert end["live_nodes"] == STEPS * (warm["live_nodes"] // WARMUP) > 0
    with pytest.raises(AssertionError):
        assert_flat(warm, end)
    # ...and resident memory grows past the tolerance too, not only the node count.
    assert end["rss"] - warm["rss"] > RSS_TOLERANCE


if __name__ == "__main__":
    # A step of this size is a few microseconds of math: torch's intra-op threads would only
    # spin against each other (and anything else on a 2-core machine), 20x slower.
    torch.set_num_threads(1)
    name = sys.argv[1]
    kwargs = dict(offload="ferry", leak=[]) if name == "leak" else CONFIGS[name]
    first, last = soak(**kwargs)
    print(json.dumps({"warm": first, "end": last}))
