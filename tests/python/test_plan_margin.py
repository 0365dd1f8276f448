"""The plan margin (docs/plan.md, "What fits promises"): `ferry.plan`, `ferry.auto` and
`python -m ferry auto` plan to the budget less a share of it, by default the share that
docs/validation.md's table of published measurements supports, and report the band in which a
GPU's peak is expected; `margin=` and `--margin` choose another share, 0 the budget itself."""

import json

import pytest
import torch

import ferry
from ferry._cli import auto as auto_cli
from models import TinyLM, loss_of
from test_auto import LLAMA_CONFIG

MODEL = "gpt2-small-s1024"
DEVICE = "h100-sxm-pcie5"


@pytest.fixture(scope="module")
def no_offload_peak():
    """The peak reserved of the no-offload run, the plan of the whole device."""
    report = ferry.plan(MODEL, device=DEVICE, margin=0)
    return report["peak_reserved_bytes"]


def test_a_plan_for_budget_b_peaks_within_b_less_the_margin(no_offload_peak):
    # A budget the no-offload run fits by 3 %: the default margin (7 %) asks for more.
    budget = no_offload_peak * 103 // 100
    for margin, permille in ((None, 70), (0, 0), (12.5, 125), ("3%", 30)):
        report = ferry.plan(MODEL, budget=budget, device=DEVICE, margin=margin)
        planned = budget - (budget * permille + 999) // 1000
        assert report["margin_permille"] == permille
        assert report["budget_bytes"] == budget
        assert report["planned_budget_bytes"] == planned
        assert report["peak_reserved_bytes"] <= planned, margin
        assert report["hazards"] == 0
        band = report["expected_peak_reserved_bytes"]
        assert band["low"] < report["peak_reserved_bytes"] < band["high"]
        # The plan file keeps the budget asked for.
        assert report["plan"]["budget_bytes"] == budget
    # With no margin the no-offload run fits; with the default it does not, so the plan differs.
    without = ferry.plan(MODEL, budget=budget, device=DEVICE, margin=0)
    default = ferry.plan(MODEL, budget=budget, device=DEVICE)
    assert without["peak_reserved_bytes"] > budget - (budget * 70 + 999) // 1000
    assert default["peak_reserved_bytes"] < without["peak_reserved_bytes"]


def test_the_margin_moves_the_floor():
    """A budget that fits only without the margin is refused with it, naming the margin."""
    with pytest.raises(ferry.PlanError) as below:
        ferry.plan(MODEL, budget="1MiB", device=DEVICE, margin=0)
    floor = below.value.floor
    assert ferry.plan(MODEL, budget=floor, device=DEVICE, margin=0)["peak_reserved_bytes"] <= floor
    with pytest.raises(ferry.PlanError, match=r"less its 50 % margin") as e:
        ferry.plan(MODEL, budget=floor, device=DEVICE, margin=50)
    assert e.value.exit_code == 1


@pytest.mark.parametrize(
    "margin, error, message",
    [
        (True, TypeError, r"^margin: True is not a percentage"),
        ([6], TypeError, r"^margin: \[6\] is not a percentage"),
        (50.5, ferry.PlanError, r"--margin: 50\.5 % is not in 0\.\.50 %"),
        ("x", ferry.PlanError, r'--margin: "x" is not a percentage'),
    ],
)
def test_a_bad_margin_is_refused(margin, error, message):
    with pytest.raises(error, match=message):
        ferry.plan(MODEL, device=DEVICE, margin=margin)


def test_auto_takes_the_margin_and_refuses_a_bad_one_before_tracing(monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced before the margin was checked")

    monkeypatch.setattr("ferry._auto.trace", no_trace)
    with pytest.raises(TypeError, match=r"^ferry.auto: margin: b'6' is not a percentage"):
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget="1GiB", margin=b"6", loss_fn=loss_of)


def test_auto_plans_to_the_budget_less_the_margin():
    model, inputs = TinyLM(), torch.randn(2, 16, 32)
    ctx = ferry.auto(model, inputs, budget="1GiB", margin=20, loss_fn=loss_of)
    assert "planned to 819 MiB (margin 20 %)" in ctx.report


def test_python_m_ferry_auto_passes_the_margin(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_CONFIG))
    args = [str(config), "--seq", "64", "--budget", "1GiB", "--margin", "12.5"]
    plan = tmp_path / "plan.json"
    assert auto_cli.main([*args, "--out", str(tmp_path / "model.json"), "--plan", str(plan)]) == 0
    assert "planned to 896 MiB (margin 12.5 %)" in capsys.readouterr().out
    assert json.loads(plan.read_text())["budget_bytes"] == 1 << 30


@pytest.mark.parametrize("margin", [None, 0, 12.5, 50])
def test_a_refusal_names_the_smallest_budget_that_plans(margin):
    """The floor a refusal names is the smallest peak with the margin added back: asked for, it
    plans, and its budget less the margin is the smallest that holds the peak."""
    with pytest.raises(ferry.PlanError) as refused:
        ferry.plan(MODEL, budget="1MiB", device=DEVICE, margin=margin)
    error = refused.value
    assert error.exit_code == 1 and error.peak_floor is not None
    budget = error.floor
    assert error.smallest_budget == budget and error.device_memory_needed is None
    assert "the floor (the smallest budget that plans) is " in str(error)
    assert f"({budget} bytes)" in str(error) and f"({error.peak_floor} bytes)" in str(error)
    report = ferry.plan(MODEL, budget=budget, device=DEVICE, margin=margin)
    planned = report["planned_budget_bytes"]
    assert report["budget_bytes"] == budget and report["hazards"] == 0
    assert report["peak_reserved_bytes"] <= planned and planned >= error.peak_floor
    permille = report["margin_permille"]
    one_less = (budget - 1) - ((budget - 1) * permille + 999) // 1000
    assert one_less < error.peak_floor, (budget, error.peak_floor, permille)
    assert (budget > error.peak_floor) == (permille > 0)


def test_auto_plans_at_the_budget_its_refusal_names():
    """`ferry.auto(..., budget=e.floor)` after a refusal plans, at the default margin (the peak
    alone is refused again: it is the budget less the margin that must hold it)."""
    model, inputs = TinyLM(), torch.randn(2, 16, 32)
    traced = ferry.auto(model, inputs, budget="1GiB", loss_fn=loss_of).traced
    with pytest.raises(ferry.PlanError) as refused:
        ferry.auto(model, inputs, budget=1, loss_fn=loss_of, traced=traced)
    error = refused.value
    assert str(error).startswith("ferry.auto: ferry plan refused: ")
    assert error.exit_code == 1 and error.peak_floor < error.floor == error.smallest_budget
    with pytest.raises(ferry.PlanError, match=r"less its 7 % margin"):
        ferry.auto(model, inputs, budget=error.peak_floor, loss_fn=loss_of, traced=traced)
    ctx = ferry.auto(model, inputs, budget=error.floor, loss_fn=loss_of, traced=traced)
    assert ctx.plan["budget_bytes"] == error.floor


def test_a_trainers_refusal_names_the_smallest_budget_that_plans():
    """`trainer=`: no setting of the trainer's space fits; the floor it names plans."""
    with pytest.raises(ferry.PlanError, match=r"smallest budget that plans in hf's space") as e:
        ferry.plan("tiny-gpt", budget="1MiB", trainer="hf")
    budget = e.value.floor
    assert budget == e.value.smallest_budget
    assert f"({budget} bytes" in str(e.value)
    report = ferry.plan("tiny-gpt", budget=budget, trainer="hf")
    assert report["trainer"]["best"] is not None
