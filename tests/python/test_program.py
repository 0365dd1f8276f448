"""The stream program a loopback session records is one `ferry check` proves safe, and a
planted fault is one it catches."""

import json
import subprocess

import pytest
import torch

import ferry
import ferry.testing
from ferry_cli import cli
from models import MLP, loss_of


def record_step(tmp_path, policy, steps=1, faults=()):
    torch.manual_seed(9)
    model = MLP(16, 32)
    # A zero-byte window and a one-tensor stash: originals leave the device during forward, so
    # backward reloads them and the reload synchronization matters.
    options = dict(
        policy=policy,
        loopback=True,
        record=True,
        min_bytes=0,
        window_bytes=0,
        max_fwd_stash_size=1,
    )
    ctx = (
        ferry.testing.planted_offload(faults=faults, **options)
        if faults
        else ferry.offload(**options)
    )
    ctx.update_model_params(model)
    for _ in range(steps):
        with ctx:
            loss = loss_of(model(torch.randn(4, 16)))
        loss.backward()
        assert ctx.tracked() == 0
    path = tmp_path / f"{policy}.json"
    ctx.write_program(path)
    json.loads(path.read_text())  # well-formed
    return path


def check(path):
    return subprocess.run([cli(), "check", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_recorded_program_is_safe(tmp_path, policy):
    result = check(record_step(tmp_path, policy))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("policy", ["ferry", "trl"])
def test_planted_reload_fault_is_caught(tmp_path, policy):
    result = check(record_step(tmp_path, policy, faults=["skip_reload_wait"]))
    assert result.returncode == 1, result.stdout + result.stderr


# Each synchronization the policy relies on, dropped, in a two-step recording (the second step
# reuses host buffers and allocator blocks of the first). The others do not show in this
# workload: ferry's backward guard (no reload reuses a block freed too early) and the
# record_stream fallback (no view escapes); trl's host guard protects a reuse on the same
# single stream, already ordered.
PLANTED = [
    ("ferry", f)
    for f in ("skip_offload_wait", "skip_reload_wait", "skip_forward_guard", "skip_host_guard")
] + [
    ("trl", f)
    for f in ("skip_offload_wait", "skip_reload_wait", "skip_forward_guard", "skip_backward_guard")
]


@pytest.mark.parametrize("policy,fault", PLANTED)
def test_planted_faults_are_caught(tmp_path, policy, fault):
    assert check(record_step(tmp_path, policy, steps=2)).returncode == 0
    result = check(record_step(tmp_path, policy, steps=2, faults=[fault]))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "hazards found" in result.stdout


def test_program_empty_without_record():
    ctx = ferry.offload(loopback=True)
    assert ctx.program_json() == ""


def test_offload_takes_no_fault_switches():
    with pytest.raises(TypeError):
        ferry.offload(loopback=True, skip_reload_wait=True)
    with pytest.raises(ValueError, match="unknown fault"):
        ferry.testing.planted_offload(faults=["skip_everything"], loopback=True)
