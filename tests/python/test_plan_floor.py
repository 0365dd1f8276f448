"""The floor a refusal names is the smallest budget that plans (docs/plan.md, "A budget below the
floor"): the smallest peak reserved the planner reached with the margin added back. Asked for
again, in `ferry.plan`, `ferry plan` and `ferry.auto`, it plans, and one byte less is refused;
the peak itself, asked for, is refused where there is a margin. Where that budget is above the
device's memory the refusal names no floor: it says no budget on the device plans, and what
would, and the margin it names plans there."""

import json
import os
import re

import pytest
import torch

import ferry
from ferry._cli import trace as trace_cli
from ferry_cli import REPO
from models import TinyLM, loss_of
from plan_checks import cli_json
from test_auto import LLAMA_CONFIG

DEVICE = "h100-sxm-pcie5"


@pytest.fixture(scope="module")
def hf_model_file(tmp_path_factory):
    """A Hugging Face Llama config traced into a model file, as `python -m ferry trace` writes
    it."""
    folder = tmp_path_factory.mktemp("floor")
    config = folder / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    out = folder / "llama.json"
    assert trace_cli.main([str(config), "--seq", "64", "--out", str(out)]) == 0
    return str(out)


def model_of(name, hf_model_file):
    return hf_model_file if name == "hf" else name


def refused(model, budget, margin):
    with pytest.raises(ferry.PlanError) as e:
        ferry.plan(model, budget=budget, device=DEVICE, margin=margin)
    error = e.value
    assert error.exit_code == 1, error
    assert error.floor is not None and error.floor == error.smallest_budget, error
    assert error.device_memory_needed is None, error
    assert error.peak_floor <= error.floor, error
    return error


def plans_at(model, budget, margin):
    report = ferry.plan(model, budget=budget, device=DEVICE, margin=margin)
    assert report["budget_bytes"] == budget and report["hazards"] == 0
    assert report["peak_reserved_bytes"] <= report["planned_budget_bytes"]
    return report


@pytest.mark.parametrize("margin", [None, 12.5])
@pytest.mark.parametrize("name", ["tiny-gpt", "gpt2-small-s1024", "hf"])
def test_ferry_plan_plans_at_the_floor_and_not_one_byte_under(name, margin, hf_model_file):
    model = model_of(name, hf_model_file)
    error = refused(model, "1MiB", margin)
    assert error.peak_floor < error.floor  # the margin is added back
    plans_at(model, error.floor, margin)
    refused(model, error.floor - 1, margin)
    # The peak itself, the floor as it was named before the margin, is refused too; the floor
    # that refusal names plans.
    again = refused(model, error.peak_floor, margin)
    plans_at(model, again.floor, margin)


@pytest.mark.parametrize("name", ["tiny-gpt", "hf"])
def test_the_cli_names_the_floor_ferry_plan_names_and_plans_at_it(cli, name, hf_model_file):
    model = model_of(name, hf_model_file)
    error = refused(model, "1MiB", None)
    args = ["plan", "--model", model, "--device", DEVICE]
    code, document, err = cli_json(cli, *args, "--budget", "1MiB")
    assert code == 1, err
    assert document["format"] == "ferry.plan-refusal/1"
    assert document["floor_bytes"] == document["smallest_budget_bytes"] == error.floor
    assert document["peak_floor_bytes"] == error.peak_floor
    assert document["device_memory_needed_bytes"] is None
    assert "the floor (the smallest budget that plans) is " in err
    assert f"({error.floor} bytes)" in err
    code, plan, err = cli_json(cli, *args, "--budget", str(error.floor))
    assert code == 0 and plan["budget_bytes"] == error.floor, err
    code, document, err = cli_json(cli, *args, "--budget", str(error.floor - 1))
    assert code == 1 and document["format"] == "ferry.plan-refusal/1", err


@pytest.mark.parametrize("budget", [1, "1MiB"])
def test_auto_plans_at_the_floor_and_not_one_byte_under(budget):
    model, inputs = TinyLM(), torch.randn(2, 16, 32)
    traced = ferry.trace(model, inputs, loss_fn=loss_of, target="host")
    with pytest.raises(ferry.PlanError) as e:
        ferry.auto(model, inputs, budget=budget, loss_fn=loss_of, traced=traced)
    floor = e.value.floor
    assert e.value.exit_code == 1 and e.value.peak_floor < floor == e.value.smallest_budget
    ctx = ferry.auto(model, inputs, budget=floor, loss_fn=loss_of, traced=traced)
    assert ctx.plan["budget_bytes"] == floor
    for under in (floor - 1, e.value.peak_floor):
        with pytest.raises(ferry.PlanError, match=r"the floor \(the smallest budget that plans\)"):
            ferry.auto(model, inputs, budget=under, loss_fn=loss_of, traced=traced)


def test_a_floor_above_the_device_names_no_budget_and_the_margin_that_plans(tmp_path):
    """A device whose memory holds the peak but not the peak with the margin: no budget on it
    plans at the default margin; the refusal names the largest margin that does, which plans at
    the device's memory, and a tenth of a percent more is refused."""
    error = refused("tiny-gpt", "1MiB", None)
    with open(os.path.join(REPO, "scenarios", "devices", f"{DEVICE}.json")) as f:
        profile = json.load(f)
    memory = (error.peak_floor + error.floor) // 2
    profile.update(name="small-gpu", memory_bytes=memory)
    device = tmp_path / "small-gpu.json"
    device.write_text(json.dumps(profile))

    with pytest.raises(ferry.PlanError) as e:
        ferry.plan("tiny-gpt", device=str(device))
    small = e.value
    assert small.exit_code == 1
    assert small.floor is None and small.smallest_budget is None
    assert small.peak_floor <= memory < small.device_memory_needed
    message = str(small)
    assert "no budget on small-gpu plans: " in message
    assert f"({small.device_memory_needed} bytes, margin 7 %)" in message
    assert re.search(r"it plans on a device with at least [0-9.]+ [KMG]iB of memory", message)
    assert "(--fsdp N, --tp N)" in message
    found = re.search(r"with a margin of at most ([0-9.]+) % \(--margin \1\)", message)
    assert found, message
    margin = float(found.group(1))
    assert 0 <= margin < 16
    report = ferry.plan("tiny-gpt", device=str(device), margin=margin)
    assert report["budget_bytes"] == memory and report["hazards"] == 0
    with pytest.raises(ferry.PlanError, match="no budget on small-gpu plans"):
        ferry.plan("tiny-gpt", device=str(device), margin=round(margin + 0.1, 1))
