"""The simulated pipeline schedules (docs/pipeline.md) on traced models of several families:
encoder-decoders (T5, BART, Whisper), mixtures of experts (Mixtral, Qwen3-MoE) and a vision
transformer, each built tiny from transformers' own config and traced for one training step
(hf_families.py). Every schedule splits each model over two devices with four micro-batches
and runs hazard-free, with the gradients of the same micro-batches run one after another on one
device (the row's failure names a mismatch), offloading its saved tensors where the schedule
allows it; the first stage holds as many micro-batches as the schedule's analytic count. A
pipeline plan (`ferry plan --pp`) under a budget the plan of everything kept exceeds fits
every stage, checked hazard-free, no slower than the fixed rows that fit; below its floor it is
refused with that floor named."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hf_families  # noqa: E402
from plan_checks import cli_json  # noqa: E402

pytest.importorskip("transformers")

FAMILIES = ("t5", "bart", "whisper", "mixtral", "qwen3_moe", "vit")
DEVICES, MICRO_BATCHES = 2, 4
#: schedule -> (virtual stages a device, the policy its stages run)
SCHEDULES = {
    "gpipe": (1, "ferry"),
    "1f1b": (1, "ferry"),
    "interleaved-1f1b": (2, "ferry"),
    # The zero-bubble schedules keep a node's saved tensors from its input-gradient step to its
    # weight step, which the offloader does not model (ferry simulate refuses the pair).
    "interleaved-zero-bubble": (2, "none"),
    "zbv": (2, "none"),
}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """Each family's trace, written once as a ferry.model/1 file."""
    folder = tmp_path_factory.mktemp("pipeline-families")
    paths = {}
    for family in FAMILIES:
        path = folder / f"{family}.json"
        path.write_text(hf_families.trace_tiny(family).to_json())
        paths[family] = str(path)
    return paths


def pipeline_command(cli, command, model, *flags):
    """`ferry COMMAND --model MODEL` over this file's devices and micro-batches, as JSON."""
    return cli_json(
        cli,
        command,
        "--model",
        model,
        "--pp",
        str(DEVICES),
        "--micro-batches",
        str(MICRO_BATCHES),
        *flags,
    )


def simulate(cli, model, schedule):
    virtual, policy = SCHEDULES[schedule]
    code, result, err = pipeline_command(
        cli,
        "simulate",
        model,
        "--schedule",
        schedule,
        "--virtual-stages",
        str(virtual),
        "--policy",
        policy,
    )
    assert code == 0 and result is not None, err
    (row,) = result["rows"]
    return row


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_schedule_runs_a_traced_family_safely(cli, traced, family, schedule):
    row = simulate(cli, traced[family], schedule)
    assert row["failure"] is None, row
    assert row["hazards"] == 0, row
    assert row["step_time_ns"] > 0
    assert len(row["device_peak_allocated_bytes"]) == DEVICES
    assert all(peak > 0 for peak in row["device_peak_allocated_bytes"]), row
    assert 0 <= row["bubble_permille"] < 1000
    if SCHEDULES[schedule][1] == "ferry":
        assert row["d2h_bytes"] > 0, f"{family} under {schedule} offloaded nothing"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_first_stage_holds_the_analytic_count_of_micro_batches(cli, traced, family):
    gpipe = simulate(cli, traced[family], "gpipe")
    one_f_one_b = simulate(cli, traced[family], "1f1b")
    # GPipe runs every forward before any backward; 1F1B's stage r warms up with pp - r of them.
    assert gpipe["device_peak_in_flight"] == [MICRO_BATCHES] * DEVICES
    assert one_f_one_b["device_peak_in_flight"] == [
        min(DEVICES - r, MICRO_BATCHES) for r in range(DEVICES)
    ]


def pipeline_plan(cli, model, budget):
    return pipeline_command(
        cli,
        "plan",
        model,
        "--margin",
        "0",
        *(["--budget", f"{budget}B"] if budget else []),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pipeline_plan_fits_every_stage_of_a_traced_family(cli, traced, family):
    # At the device's memory: every configuration's binding peak, the fixed rows among them.
    code, roomy, err = pipeline_plan(cli, traced[family], None)
    assert code == 0, err
    ran = [c for c in roomy["configurations"] if c["failure"] is None]
    never = next(c for c in ran if c["name"].endswith("x4 never"))
    floor = min(c["max_stage_peak_reserved_bytes"] for c in ran)
    # A budget keeping everything does not fit: the plan recomputes or offloads somewhere.
    budget = max(floor, never["max_stage_peak_reserved_bytes"] - 1)
    code, doc, err = pipeline_plan(cli, traced[family], budget)
    assert code == 0, err
    plan = doc["plan"]
    assert plan["checked"] and plan["hazards"] == 0, plan
    assert max(plan["stage_peak_reserved_bytes"]) <= budget, plan
    fixed = [
        c
        for c in doc["configurations"]
        if c["fixed"] and c["failure"] is None and c["max_stage_peak_reserved_bytes"] <= budget
    ]
    assert plan["step_time_ns"] <= min(c["step_time_ns"] for c in fixed), (plan, fixed)
    # One byte below the smallest binding peak, nothing plans, and the refusal names that floor.
    code, refusal, _ = pipeline_plan(cli, traced[family], floor - 1)
    assert code == 1 and refusal["floor_bytes"] == floor, refusal
