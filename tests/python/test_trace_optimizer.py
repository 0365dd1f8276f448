"""The optimizer step a trace measures (docs/trace.md, The optimizer step): the bytes its kernels
move and the tensors it makes that are alive together at its peak, with the implementation the
device would run (torch's foreach AdamW: a parameter set more at the step), and the simulator's
step with them (docs/model-format.md, Optimizer step)."""

import json

import pytest
import torch
from torch import nn

import ferry
from ferry._cli.trace import main
from ferry._trace import trace
from traced_families import SIZED_FAMILIES, sized_path


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(3)])
    return model, torch.randn(8, 512)


def total(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def moved(model, per_byte, traced):
    """Whether the step moved `per_byte` bytes a parameter byte, and its step counters (a
    float32 scalar a parameter, read and written by a few kernels) besides."""
    step = traced.document["optimizer_step"]["bytes"]
    count = len(list(model.parameters()))
    return per_byte * total(model) <= step <= per_byte * total(model) + 16 * count


def step_of(optimizer_kind, **kwargs):
    model, x = mlp()
    optimizer = optimizer_kind(model.parameters())
    traced = trace(model, x, loss_fn=lambda out: out.sum(), optimizer=optimizer, **kwargs)
    return model, optimizer, traced


def test_torchs_default_adamw_steps_foreach_on_a_device():
    model, optimizer, traced = step_of(torch.optim.AdamW)
    step = traced.document["optimizer_step"]
    sizes = sorted(p.numel() * p.element_size() for p in model.parameters())
    # exp_avg_sq_sqrt: a tensor for each parameter, all alive at once.
    assert sorted(step["temporaries"]) == sizes
    # lerp, mul, addcmul, sqrt, div, add, addcdiv and the weight decay's mul: 20 bytes a byte.
    assert moved(model, 20, traced)
    # The user's optimizer is left as it was: no state, its implementation undecided.
    assert not optimizer.state
    assert all(g["foreach"] is None for g in optimizer.param_groups)


def test_fused_adamw_makes_no_temporaries():
    model, _, traced = step_of(lambda params: torch.optim.AdamW(params, fused=True))
    step = traced.document["optimizer_step"]
    assert step["temporaries"] == []
    # Parameters, gradients (its schema marks them written too) and both moments, once.
    assert moved(model, 8, traced)


def test_the_loop_holds_one_parameters_tensors_at_a_time():
    model, _, looped = step_of(lambda params: torch.optim.AdamW(params, foreach=False))
    _, _, foreach = step_of(torch.optim.AdamW)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    held = looped.document["optimizer_step"]["temporaries"]
    assert max(held) == largest and sum(held) <= 3 * largest
    assert sum(held) < sum(foreach.document["optimizer_step"]["temporaries"])


def test_on_the_host_the_default_is_the_loop_the_cpu_runs():
    _, _, device = step_of(torch.optim.AdamW)
    _, _, looped = step_of(lambda params: torch.optim.AdamW(params, foreach=False))
    _, _, host = step_of(torch.optim.AdamW, target="host")
    assert host.document["optimizer_step"] == looped.document["optimizer_step"]
    assert host.document["optimizer_step"] != device.document["optimizer_step"]


def test_without_an_optimizer_there_is_no_step():
    model, x = mlp()
    assert "optimizer_step" not in trace(model, x, loss_fn=lambda out: out.sum()).document


def test_the_simulated_step_holds_foreachs_temporaries():
    """A wide MLP whose step holds the peak: torch's default AdamW peaks a parameter set above
    fused AdamW, and its step, moving 20 bytes a parameter byte against 8, is longer."""
    results = {}
    for name, kind in [
        ("foreach", torch.optim.AdamW),
        ("fused", lambda params: torch.optim.AdamW(params, fused=True)),
    ]:
        model, _, traced = step_of(kind)
        results[name] = ferry.simulate(traced, "h100-sxm-pcie5", policy="none")["result"]
    params = total(model)
    rise = results["foreach"]["peak_allocated_bytes"] - results["fused"]["peak_allocated_bytes"]
    assert 0.9 * params <= rise <= params
    assert results["foreach"]["step_time_ns"] > results["fused"]["step_time_ns"]


@pytest.mark.parametrize(
    "choice, temporaries",
    [("adamw", "per parameter"), ("adamw-fused", "none"), ("adamw-for-loop", "a few")],
)
def test_the_cli_steps_the_optimizer_it_names(tmp_path, choice, temporaries):
    pytest.importorskip("transformers")
    out = tmp_path / "model.json"
    argv = ["gpt2", "--seq", "16", "--dtype", "bf16", "--optimizer", choice, "--out", str(out)]
    assert main(argv) == 0
    document = json.loads(out.read_text())
    params = [t for t in document["tensors"] if t["role"] == "param" and "view_of" not in t]
    held = document["optimizer_step"]["temporaries"]
    if temporaries == "per parameter":
        assert sorted(held) == sorted(t["bytes"] for t in params)
    elif temporaries == "none":
        assert held == []
    else:
        assert 0 < len(held) <= 3


@pytest.mark.parametrize("family", SIZED_FAMILIES)
def test_each_familys_trace_holds_a_parameter_set_at_foreach_adamws_step(family):
    """The sized traces of Hugging Face families (decoders, a tied head, experts, an
    encoder-decoder), stepped by torch's default AdamW: a temporary for each trainable
    parameter, tied ones once."""
    with open(sized_path(family), encoding="utf-8") as f:
        document = json.load(f)
    params = [
        t["bytes"] for t in document["tensors"] if t["role"] == "param" and "view_of" not in t
    ]
    step = document["optimizer_step"]
    assert sorted(step["temporaries"]) == sorted(params)
    assert 20 * sum(params) <= step["bytes"] <= 20 * sum(params) + 16 * len(params)
