"""Every bundled device profile (scenarios/devices/*.json) loads, simulates the default scenario
of `ferry simulate` (Llama-3-8B at sequence 8192 under the ferry policy) and plans: the model
either fits and runs, or runs out of the profile's memory and says so; the planner plans a
GPT-2 on every profile at the device's memory, and Llama-3-8B wherever its floor fits
(docs/devices.md, "Bundled profiles")."""

import json
import os

import pytest

from plan_checks import cli_json

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCENARIOS = os.path.join(REPO, "scenarios")
PROFILES = sorted(
    name[: -len(".json")]
    for name in os.listdir(os.path.join(SCENARIOS, "devices"))
    if name.endswith(".json")
)


def profile(name):
    with open(os.path.join(SCENARIOS, "devices", f"{name}.json")) as f:
        return json.load(f)


def test_the_profiles_people_train_on_are_bundled():
    for name in (
        "a100-pcie4",
        "a100-sxm4-40gb",
        "b200",
        "gh200",
        "gh200-quad",
        "h100-pcie-80gb",
        "h100-sxm-96gb",
        "h100-sxm-pcie5",
        "h200",
        "l4",
        "l40s",
        "rtx-4090",
    ):
        assert name in PROFILES


@pytest.mark.parametrize("name", PROFILES)
def test_the_default_scenario_simulates_on_every_profile(cli, name):
    code, result, err = cli_json(cli, "simulate", "--device", name, "--scenarios", SCENARIOS)
    assert result is not None, err
    row = result["result"]
    assert row["step_time_ns"] > 0
    if row["fits"]:
        assert code == 0, err
        assert row["failure"] is None
        assert row["peak_reserved_bytes"] <= profile(name)["memory_bytes"]
    else:
        # A model larger than the device runs out of the profile's memory, a simulated outcome.
        assert code == 1, err
        assert row["failure"].startswith("out of memory"), row["failure"]
        capacity_gib = profile(name)["memory_bytes"] / 2**30
        assert f"capacity {capacity_gib:.1f} GiB" in row["failure"], row["failure"]


def check_plan(plan, budget):
    assert plan["format"] == "ferry.plan-report/1", plan
    assert plan["hazards"] == 0
    assert 0 < plan["peak_reserved_bytes"] <= budget
    assert plan["lower_bound_ns"] <= plan["step_time_ns"]


@pytest.mark.parametrize("name", PROFILES)
def test_the_planner_plans_on_every_profile(cli, name):
    memory = profile(name)["memory_bytes"]
    common = ["--device", name, "--scenarios", SCENARIOS, "--margin", "0"]
    code, plan, err = cli_json(cli, "plan", "--model", "gpt2-small-s1024", *common)
    assert code == 0, err
    check_plan(plan, memory)
    assert plan["budget_bytes"] == memory  # the default budget is the device's memory

    code, plan, err = cli_json(cli, "plan", *common)
    if code == 0:
        check_plan(plan, memory)
    else:
        # Refused only where the smallest peak the planner reaches exceeds the device: then no
        # budget on it plans, and the refusal names none, only the memory a device would need.
        assert code == 1, err
        assert plan["format"] == "ferry.plan-refusal/1", plan
        assert plan["peak_floor_bytes"] > memory, plan
        assert plan["floor_bytes"] is None and plan["smallest_budget_bytes"] is None, plan
        assert plan["device_memory_needed_bytes"] == plan["peak_floor_bytes"], plan
        assert f"no budget on {name} plans" in plan["refusal"], plan
