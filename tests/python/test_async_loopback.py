"""The asynchronous loopback device (Note [The asynchronous loopback device]) through the Python
hooks: each planted ordering fault gives wrong gradients for one of at most ten seeds, while
the same steps without it give plain PyTorch's for each seed; the typed loopback options, and
the harness's reading of FERRY_LOOPBACK into them, are checked."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

import ferry
from conftest import loopback_options
from ferry.testing import planted_offload


def mlp(width=256):
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)
    )


def steps(policy, faults, frozen_first_step, **streams):
    """Two steps of two branches under one session; with `frozen_first_step` the first step asks
    for the trained branch's gradients only, so the frozen branch's tensors are prefetched and
    never unpacked, and their pinned buffers go back to the pool while the reloads may still
    read them. `streams` are the loopback stream options. Returns each step's gradients, torch's
    and ferry's."""
    torch.manual_seed(0)
    # The frozen branch's tensors have sizes of their own: the pool's buffers of those sizes
    # are the ones its prefetched reloads read.
    trained, frozen = mlp(), mlp(320)
    x = torch.randn(64, 64)

    def loss():
        # The frozen branch first: backward reloads its tensors last, after every reload that
        # compute waits for.
        frozen_loss = frozen(x).pow(2).mean()
        return trained(x).pow(2).mean() + frozen_loss

    def grads(step, fn):
        params = list(trained.parameters())
        if not (frozen_first_step and step == 0):
            params += list(frozen.parameters())
        return torch.autograd.grad(fn(), params)

    want = [grads(step, loss) for step in range(2)]
    options = dict(
        policy=policy,
        loopback=True,
        min_bytes=0,
        window_bytes=1,
        prefetch_bytes=(1 << 20) if frozen_first_step else 1,
        max_fwd_stash_size=1,
        **streams,
    )
    ctx = planted_offload(faults=faults, **options) if faults else ferry.offload(**options)
    ctx.update_model_params(trained)
    ctx.update_model_params(frozen)

    def under_ferry():
        with ctx:
            return loss()

    got = [grads(step, under_ferry) for step in range(2)]
    return want, got


def right(want, got):
    return all(torch.equal(a, b) for w, g in zip(want, got) for a, b in zip(w, g))


CASES = [
    ("ferry", "skip_reload_wait", False),
    ("trl", "skip_reload_wait", False),
    ("ferry", "skip_offload_wait", False),
    ("trl", "skip_offload_wait", False),
    ("ferry", "skip_forward_guard", False),
    ("trl", "skip_forward_guard", False),
    ("ferry", "reuse_pinned_early", True),
]


@pytest.mark.parametrize(
    "policy,fault,frozen_first_step", CASES, ids=[f"{p}-{f}" for p, f, _ in CASES]
)
def test_a_planted_ordering_fault_gives_wrong_gradients(policy, fault, frozen_first_step):
    for seed in range(1, 11):
        # Delays of up to 20 ms: longer than a loaded machine stalls a worker thread, so that
        # whether a race shows does not depend on the machine's load; and a frozen-branch run's
        # delays dwarf the host's work between its steps, which the unread reloads must outlast.
        streams = dict(loopback_streams="async", loopback_seed=seed, loopback_max_delay_us=20000)
        assert right(*steps(policy, (), frozen_first_step, **streams)), f"seed {seed} without it"
        if not right(*steps(policy, (fault,), frozen_first_step, **streams)):
            return
    pytest.fail(f"{fault} under {policy} gave right gradients with ten seeds")


def test_the_synchronous_device_cannot_see_them():
    """Why the asynchronous device exists: synchronously, a dropped wait still reads right."""
    faults = ("skip_reload_wait", "skip_forward_guard")
    assert right(*steps("ferry", faults, False, loopback_streams="sync"))


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(loopback_streams="asnyc"), 'loopback_streams must be "sync" or "async"'),
        (dict(loopback_streams="async", loopback_seed=-1), "loopback_seed must not be negative"),
        (dict(loopback_streams="async", loopback_max_delay_us=2_000_000), "0 to 1000000"),
        (dict(loopback_streams="sync", loopback_seed=1), 'go with loopback_streams="async"'),
        (dict(loopback_max_delay_us=10), 'go with loopback_streams="async"'),
    ],
)
def test_a_bad_loopback_option_is_a_clear_error(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ferry.offload(loopback=True, **options)


def test_loopback_options_need_a_loopback_session():
    with pytest.raises(ValueError, match=re.escape("go with loopback=True")):
        ferry.offload(loopback_streams="async")


def test_the_package_reads_no_ferry_loopback():
    """Outside this harness FERRY_LOOPBACK means nothing: a text that is no mode is not read."""
    code = "import ferry; ferry.offload(loopback=True)._session.races()"
    env = dict(os.environ, FERRY_LOOPBACK="asnyc")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_the_harness_reads_ferry_loopback_into_typed_options():
    assert loopback_options("sync") == {"loopback_streams": "sync"}
    assert loopback_options("async") == {"loopback_streams": "async"}
    assert loopback_options("async:7:250") == {
        "loopback_streams": "async",
        "loopback_seed": 7,
        "loopback_max_delay_us": 250,
    }
    for text in ["asnyc", "async:x", "async:1:", "async:1:2:3", "sync:1"]:
        with pytest.raises(ValueError, match="FERRY_LOOPBACK"):
            loopback_options(text)


def test_ferry_loopback_does_not_touch_a_session_without_loopback(monkeypatch):
    monkeypatch.setenv("FERRY_LOOPBACK", "asnyc")
    with pytest.raises(ValueError, match="no CUDA device"):
        ferry.offload()


def test_a_view_of_a_parameter_stays_as_the_parameter_does():
    """Note [Views of parameters]: a linear layer saves `weight.t()`, the weight's own memory
    (which FSDP2 frees after forward); only the input is copied out."""
    layer = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    ctx = ferry.offload(loopback=True, min_bytes=0, window_bytes=0)
    with ctx:
        loss = layer(x).sum()
    loss.backward()
    t = ctx.telemetry()
    assert t["bytes_d2h"] == x.numel() * x.element_size()
    assert t["kept"] >= 1
