"""The asynchronous loopback device (Note [The asynchronous loopback device]) through the Python
hooks: each planted ordering fault gives wrong gradients for one of at most ten seeds, while
the same steps without it give plain PyTorch's for each seed; FERRY_LOOPBACK is checked."""

import pytest
import torch
from torch import nn

import ferry
from ferry.testing import planted_offload


def mlp(width=256):
    return nn.Sequential(
        nn.Linear(64, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 8)
    )


def steps(policy, faults, frozen_first_step):
    """Two steps of two branches under one session; with `frozen_first_step` the first step asks
    for the trained branch's gradients only, so the frozen branch's tensors are prefetched and
    never unpacked, and their pinned buffers go back to the pool while the reloads may still
    read them. Returns each step's gradients, torch's and ferry's."""
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
def test_a_planted_ordering_fault_gives_wrong_gradients(
    policy, fault, frozen_first_step, monkeypatch
):
    for seed in range(1, 11):
        # A frozen-branch run's delays dwarf the host's work between its steps, which the
        # unread reloads must outlast.
        delay = 20000 if frozen_first_step else 2000
        monkeypatch.setenv("FERRY_LOOPBACK", f"async:{seed}:{delay}")
        assert right(*steps(policy, (), frozen_first_step)), f"seed {seed} without the fault"
        if not right(*steps(policy, (fault,), frozen_first_step)):
            return
    pytest.fail(f"{fault} under {policy} gave right gradients with ten seeds")


def test_the_synchronous_device_cannot_see_them(monkeypatch):
    """Why the asynchronous device exists: synchronously, a dropped wait still reads right."""
    monkeypatch.setenv("FERRY_LOOPBACK", "sync")
    assert right(*steps("ferry", ("skip_reload_wait", "skip_forward_guard"), False))


@pytest.mark.parametrize("text", ["asnyc", "async:x", "async:1:", "async:1:2:3", "async:1:2000000"])
def test_a_malformed_ferry_loopback_is_a_clear_error(text, monkeypatch):
    monkeypatch.setenv("FERRY_LOOPBACK", text)
    with pytest.raises(ValueError, match="FERRY_LOOPBACK"):
        ferry.offload(loopback=True)


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
