"""A budget ``ferry plan`` would refuse (empty, unreadable, out of range, or no byte count at
all) is refused before anything is traced or planned, naming the argument, with the message the
request layer gives (the simulator reads it once, and the planner takes it as read)."""

import pytest
import torch

import ferry
from ferry._cli import auto as auto_cli
from ferry._cli import trace as trace_cli
from models import TinyLM, loss_of


@pytest.fixture
def no_trace(monkeypatch):
    """Tracing fails the test: the budget is checked first."""

    def trace(*args, **kwargs):
        raise AssertionError("traced before the budget was checked")

    monkeypatch.setattr(ferry._auto, "trace", trace)


@pytest.mark.parametrize("budget", ["", "  "])
def test_auto_refuses_an_empty_budget(no_trace, budget):
    with pytest.raises(
        ValueError, match="^ferry.auto: budget: empty; give a byte count such as 40GiB$"
    ):
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget=budget, loss_fn=loss_of)


@pytest.mark.parametrize(
    "budget, message",
    [
        ("40 parsecs", 'budget: "40 parsecs" is not a byte count'),
        ("-5", 'budget: "-5" is not a byte count'),
        (-5, "budget: -5 is not in 0..1125899906842624$"),
        (2**70, f"budget: {2**70} is not in 0..1125899906842624$"),
    ],
)
def test_auto_refuses_a_budget_ferry_plan_refuses_before_tracing(no_trace, budget, message):
    with pytest.raises(ValueError, match="^ferry.auto: " + message) as refused:
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget=budget, loss_fn=loss_of)
    # The request layer's message, as ferry.plan (and ferry plan --budget) give it.
    if not isinstance(budget, int) or budget < 2**63:
        with pytest.raises(ferry.PlanError) as planned:
            ferry.plan("tiny-gpt", budget=budget)
        assert str(planned.value) == "ferry plan: " + str(refused.value).replace(
            "ferry.auto: budget", "--budget"
        )


@pytest.mark.parametrize("budget", [None, 4.5e9, True, b"40GiB"])
def test_auto_refuses_a_budget_that_is_not_a_byte_count(no_trace, budget):
    with pytest.raises(TypeError, match=r"^ferry.auto: budget: .* is not a byte count"):
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget=budget, loss_fn=loss_of)


def test_auto_refuses_a_host_budget_that_is_not_a_byte_count(no_trace):
    with pytest.raises(TypeError, match=r"^ferry.auto: host_budget: 1.5 is not a byte count"):
        ferry.auto(
            TinyLM(), torch.randn(2, 16, 32), budget="1GiB", host_budget=1.5, loss_fn=loss_of
        )


def test_auto_refuses_an_empty_host_budget(no_trace):
    with pytest.raises(
        ValueError,
        match="^ferry.auto: host_budget: empty; give a byte count such as 40GiB, or leave the "
        "option out$",
    ):
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget="1GiB", host_budget="", loss_fn=loss_of)


@pytest.mark.parametrize(
    "budgets",
    [["--budget", ""], ["--budget", "1GiB", "--host-budget", ""]],
    ids=["budget", "host-budget"],
)
def test_python_m_ferry_auto_refuses_an_empty_budget(monkeypatch, capsys, budgets):
    def trace_main(argv):
        raise AssertionError("traced before the budget was checked")

    monkeypatch.setattr(trace_cli, "main", trace_main)
    args = [*budgets, "--plan", "plan.json", "--out", "model.json", "config.json"]
    assert auto_cli.main(args) == 2
    assert (
        f"python -m ferry auto: {budgets[-2]}: empty; give a byte count" in capsys.readouterr().err
    )


def test_auto_reads_the_budget_once_and_the_planner_takes_it_as_read(monkeypatch):
    # ferry.auto reads each budget once, before tracing (ferry._simulator.read_bytes); the
    # planner gets what it read and does not check it again (ferry._sim.byte_count is not
    # called, and the plan binding receives ReadBytes, which it takes as read).
    reads, handed = [], []
    read, plan = ferry._simulator.read_bytes, ferry._simulator.plan

    def counting_read(value, what, **kwargs):
        reads.append(what)
        return read(value, what, **kwargs)

    def recording_plan(*args, **kwargs):
        handed.append((kwargs["budget"], kwargs["host_budget"]))
        return plan(*args, **kwargs)

    def check(*args, **kwargs):
        raise AssertionError("ferry._sim checked a budget")

    monkeypatch.setattr(ferry._simulator, "read_bytes", counting_read)
    monkeypatch.setattr(ferry._simulator, "plan", recording_plan)
    monkeypatch.setattr(ferry._sim, "byte_count", check)
    ctx = ferry.auto(
        TinyLM(), torch.randn(2, 16, 32), budget="1GiB", host_budget=2**31, loss_fn=loss_of
    )
    assert "step time" in ctx.report
    assert reads == ["ferry.auto: budget", "ferry.auto: host_budget"]
    [(budget, host_budget)] = handed
    assert isinstance(budget, ferry._simulator.ReadBytes) and budget.bytes == 2**30
    assert isinstance(host_budget, ferry._simulator.ReadBytes) and host_budget.bytes == 2**31
    # ferry.plan checks the kinds in Python, once, and the request layer reads the values.
    with pytest.raises(AssertionError, match="checked a budget"):
        ferry.plan("tiny-gpt", budget="1GiB")
