"""An empty budget is refused before anything is traced or planned, naming the argument:
``ferry plan`` would take it as no budget at all (the device's whole memory)."""

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
    with pytest.raises(ValueError, match=f'^ferry.auto: budget: "{budget}" is not a byte count'):
        ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget=budget, loss_fn=loss_of)


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
    with pytest.raises(ValueError, match='^ferry.auto: host_budget: "" is not a byte count'):
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
    assert f'python -m ferry auto: {budgets[-2]}: "" is not a byte count' in capsys.readouterr().err


def test_auto_checks_the_budget_once_before_the_request_layer(monkeypatch):
    # ferry.auto checks the budgets' kinds before tracing; the planner's run does not check them
    # again (the request layer reads their values).
    def check(*args, **kwargs):
        raise AssertionError("ferry._sim checked a budget")

    monkeypatch.setattr(ferry._sim, "byte_count", check)
    monkeypatch.setattr(ferry._sim, "percentage", check)
    ctx = ferry.auto(TinyLM(), torch.randn(2, 16, 32), budget="1GiB", loss_fn=loss_of)
    assert "step time" in ctx.report
    # ferry.plan still checks them, once.
    with pytest.raises(AssertionError, match="checked a budget"):
        ferry.plan("tiny-gpt", budget="1GiB")
