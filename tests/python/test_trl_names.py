"""The reference offloader's names (TRL's activation_offloading module) on ferry: the
OffloadActivations / NoOpManager / get_act_offloading_ctx_manager aliases, min_offload_size,
use_streams and use_pin_memory."""

import json

import pytest
import torch
from torch import nn

import ferry
from models import MLP, TinyLM, check_against_plain, loss_of
from test_program import check


@pytest.mark.parametrize("policy", ["ferry", "trl", "trl-1.7"])
def test_offload_activations_trains_like_plain(policy):
    ctx = ferry.OffloadActivations(
        min_offload_size=0, max_fwd_stash_size=1, policy=policy, loopback=True, window_bytes=0
    )
    assert isinstance(ctx, ferry.offload)
    check_against_plain(MLP, lambda: torch.randn(8, 32), ctx, steps=3)
    assert ctx.telemetry()["offloaded"] > 0
    assert ctx.telemetry()["bytes_h2d"] > 0
    assert ctx.tracked() == 0


def test_offload_activations_has_the_reference_signature():
    ctx = ferry.OffloadActivations(True, True, 2048, 3, loopback=True)
    with ctx:
        loss_of(MLP()(torch.randn(4, 32))).backward()
    with pytest.raises(TypeError):
        ferry.OffloadActivations(1, 2, 3, 4, 5)


def test_min_offload_size_is_min_bytes():
    def kept(**size):
        ctx = ferry.offload(loopback=True, **size)
        with ctx:
            loss = loss_of(MLP()(torch.randn(4, 32)))
        loss.backward()
        return ctx.telemetry()["kept"], ctx.telemetry()["offloaded"]

    assert kept(min_offload_size=1 << 20) == kept(min_bytes=1 << 20)
    assert kept(min_offload_size=0) == kept(min_bytes=0)
    assert kept(min_offload_size=1 << 20) != kept(min_offload_size=0)
    with pytest.raises(TypeError, match="min_bytes and min_offload_size"):
        ferry.offload(loopback=True, min_bytes=1, min_offload_size=2)


def test_use_pin_memory_false_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="use_pin_memory=False is not supported"):
        ferry.OffloadActivations(use_pin_memory=False, loopback=True)


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_without_streams_copies_run_on_the_compute_stream(tmp_path, policy):
    ctx = ferry.offload(
        policy=policy,
        loopback=True,
        use_streams=False,
        record=True,
        min_bytes=0,
        window_bytes=0,
        max_fwd_stash_size=1,
    )
    check_against_plain(MLP, lambda: torch.randn(8, 32), ctx, steps=2)
    program = json.loads(ctx.program_json())
    assert len(program["streams"]) == 1  # the compute stream only
    compute = program["streams"][0]["name"]
    copies = [op for op in program["ops"] if op["op"] == "copy"]
    assert copies and all(op["stream"] == compute for op in copies)
    path = tmp_path / "no_streams.json"
    ctx.write_program(path)
    result = check(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_trl_stash_size_is_checked_only_with_streams():
    with pytest.raises(ValueError, match="max_fwd_stash_size should be at least 1"):
        ferry.offload(policy="trl", loopback=True, max_fwd_stash_size=0)
    ferry.offload(policy="trl", loopback=True, max_fwd_stash_size=0, use_streams=False)


def test_noop_manager_keeps_its_region_on_the_device():
    ctx = ferry.OffloadActivations(min_offload_size=0, loopback=True)
    x = torch.randn(4, 32, requires_grad=True)
    model = MLP()
    with ctx:
        h = model.fc1(x)
        packed_before = ctx.telemetry()["packed"]
        with ferry.NoOpManager():
            h = torch.relu(model.fc2(h))
        assert ctx.telemetry()["packed"] == packed_before
        loss = loss_of(model.fc3(h))
    loss.backward()
    assert ctx.tracked() == 0


def test_get_act_offloading_ctx_manager_excludes_the_head():
    model = TinyLM()
    ctx = ferry.get_act_offloading_ctx_manager(model, min_offload_size=0, loopback=True)
    seen = {}

    def before_head(module, args):
        seen["head"] = ctx.telemetry()["packed"]  # returns None: the inputs stay

    model.lm_head.register_forward_pre_hook(before_head)
    with ctx:
        out = model(torch.randn(2, 16, 32))
        # The head's saved tensors went through the no-offload region, not the session.
        assert ctx.telemetry()["packed"] == seen["head"]
        loss = loss_of(out)
    loss.backward()
    assert ctx.tracked() == 0
    with pytest.warns(UserWarning, match="no output head"):
        ferry.get_act_offloading_ctx_manager(MLP(), loopback=True)


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_parameters_are_recognised_as_torch_does(policy):
    # An nn.Parameter, frozen or not, is never offloaded (no update_model_params needed); an
    # input leaf that requires grad is an activation like any other and is offloaded.
    weight = nn.Parameter(torch.randn(64, 64))
    frozen = nn.Parameter(torch.randn(1, 64), requires_grad=False)
    x = torch.randn(64, 64, requires_grad=True)
    ctx = ferry.offload(
        policy=policy, loopback=True, min_bytes=0, window_bytes=0, max_fwd_stash_size=1
    )
    with ctx:
        loss = (x * weight * frozen).sum()  # saves x, weight and frozen
    t = ctx.telemetry()
    assert t["packed"] == 3
    assert t["offloaded"] == 1
    assert t["bytes_d2h"] == x.numel() * x.element_size()
    loss.backward()
    assert torch.equal(x.grad, (weight * frozen).detach())
    assert ctx.tracked() == 0
