"""`ferry.plan(..., pp=N)` plans a pipeline as `ferry plan --pp N` does (docs/plan.md,
"A pipeline"): the same document on both edges, every stage within the planned budget and
checked, a budget below the floor refused with the floor, which itself plans."""

import pytest

import ferry
from plan_checks import cli_json

DEVICE = "h100-sxm-pcie5"


def stage_fits(report):
    plan = report["plan"]
    assert report["format"] == "ferry.pipeline-plan/1"
    assert plan["checked"] and plan["hazards"] == 0 and plan["failure"] is None
    assert len(plan["stage_peak_reserved_bytes"]) == report["devices"]
    assert max(plan["stage_peak_reserved_bytes"]) <= report["planned_budget_bytes"]
    binding = plan["binding_stage"]
    assert plan["stage_peak_reserved_bytes"][binding] == plan["max_stage_peak_reserved_bytes"]


@pytest.mark.parametrize("stages", [2, 4])
def test_the_plan_is_the_cli_s_and_fits_every_stage(cli, stages):
    report = ferry.plan("tiny-gpt", device=DEVICE, pp=stages, micro_batches=2 * stages)
    stage_fits(report)
    assert report["schedule_defaulted"] and report["schedules"] == ["1f1b"]
    code, document, err = cli_json(
        cli, "plan", "--model", "tiny-gpt", "--device", DEVICE, "--pp", str(stages),
        "--micro-batches", str(2 * stages),
    )  # fmt: skip
    assert code == 0, err
    assert document == report
    # Never slower than a fixed row that fits.
    fitting = [c for c in report["configurations"] if c["fixed"] and c["fits"]]
    assert fitting and all(report["plan"]["step_time_ns"] <= c["step_time_ns"] for c in fitting)


def test_a_budget_below_the_floor_is_refused_and_the_floor_plans():
    with pytest.raises(ferry.PlanError) as e:
        ferry.plan("tiny-gpt", budget="1MiB", device=DEVICE, pp=2, micro_batches=4)
    error = e.value
    assert error.exit_code == 1 and "no pipeline configuration" in str(error)
    assert error.floor is not None and error.peak_floor <= error.floor
    report = ferry.plan("tiny-gpt", budget=error.floor, device=DEVICE, pp=2, micro_batches=4)
    stage_fits(report)
    with pytest.raises(ferry.PlanError):
        ferry.plan("tiny-gpt", budget=error.floor - 1, device=DEVICE, pp=2, micro_batches=4)


def test_auto_names_each_schedule_and_keeps_the_fastest():
    report = ferry.plan("tiny-gpt", device=DEVICE, pp=2, micro_batches=4, schedule="auto")
    stage_fits(report)
    reason = report["schedule_reason"]
    for name in ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble"):
        assert name in reason
    fits = [c["step_time_ns"] for c in report["configurations"] if c["fits"]]
    assert report["plan"]["step_time_ns"] == min(fits)


def test_pipeline_options_without_pp_are_refused():
    with pytest.raises(ferry.PlanError) as e:
        ferry.plan("tiny-gpt", device=DEVICE, schedule="gpipe")
    assert e.value.exit_code == 2 and "give --pp 2 or more" in str(e.value)


def test_a_per_stage_plan_is_the_cli_s_and_names_each_stage_s_configuration(cli):
    # GPT-2 small over 4 stages at 1300 MiB: only the first stage, with the most micro-batches in
    # flight under 1F1B, is over the budget without recompute.
    args = dict(budget="1300MiB", margin=0, device=DEVICE, pp=4, micro_batches=8)
    report = ferry.plan("gpt2-small-s1024", **args)
    stage_fits(report)
    plan = report["plan"]
    assert [s["configuration"] for s in plan["stages"]] == ["except_last"] + ["never"] * 3
    assert plan["checkpoint"] is None and plan["policy"] is None
    uniform = [c for c in report["configurations"] if c["stages"] is None and c["fits"]]
    assert uniform and all(plan["step_time_ns"] < c["step_time_ns"] for c in uniform)
    code, document, err = cli_json(
        cli, "plan", "--model", "gpt2-small-s1024", "--device", DEVICE, "--pp", "4",
        "--micro-batches", "8", "--budget", "1300MiB", "--margin", "0",
    )  # fmt: skip
    assert code == 0, err
    assert document == report


def test_the_split_is_the_cli_s_and_names_each_stage_s_layers(cli):
    # GPT-2 small's 12 layers on 4 stages by torchtitan's default: 14 layer equivalents, 4, 4,
    # 3, 3 less the input on the first and the output on the last.
    args = dict(device=DEVICE, pp=4, micro_batches=4)
    report = ferry.plan("gpt2-small-s1024", **args)
    assert report["split"] == "layers"
    stages = report["stages"]
    assert [s["last_layer"] - s["first_layer"] + 1 for s in stages] == [3, 4, 3, 2]
    assert [s["device"] for s in stages] == [0, 1, 2, 3]
    assert stages[0]["first_op"] == 0
    assert all(a["end_op"] == b["first_op"] for a, b in zip(stages, stages[1:]))
    explicit = ferry.plan("gpt2-small-s1024", split="2,6,9", **args)
    assert explicit["split"] == "2,6,9"
    assert [s["first_layer"] for s in explicit["stages"]] == [0, 2, 6, 9]
    balanced = ferry.plan("gpt2-small-s1024", split="balanced", **args)
    assert balanced["split"] == "balanced"
    assert balanced["stages"] != stages
    code, document, err = cli_json(
        cli, "plan", "--model", "gpt2-small-s1024", "--device", DEVICE, "--pp", "4",
        "--micro-batches", "4", "--split", "2,6,9",
    )  # fmt: skip
    assert code == 0, err
    assert document == explicit
    rows = ferry.compare("gpt2-small-s1024", DEVICE, pp=4, split="2,6,9", steps=1)
    assert all(r["split"] == "2,6,9" for r in rows["pipeline"])
    assert all(r["stages"] == explicit["stages"] for r in rows["pipeline"])


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("2,6", "--split 2,6 gives 2 split points for 4 stages; give 3"),
        ("6,2,9", '--split "6,2,9": 2 does not follow 6'),
        ("2,6,13", "--split 2,6,13: split point 13 is not an increasing layer index from 0 to 12"),
        ("halves", '--split "halves": "halves" is not a layer index'),
    ],
)
def test_a_bad_split_is_refused_on_both_edges(cli, split, message):
    with pytest.raises(ferry.PlanError) as e:
        ferry.plan("gpt2-small-s1024", device=DEVICE, pp=4, micro_batches=4, split=split)
    assert e.value.exit_code == 2 and message in str(e.value)
    with pytest.raises(ValueError, match="--split"):
        ferry.compare("gpt2-small-s1024", DEVICE, pp=4, split=split, steps=1)
    code, _, err = cli_json(
        cli, "plan", "--model", "gpt2-small-s1024", "--device", DEVICE, "--pp", "4",
        "--micro-batches", "4", "--split", split,
    )  # fmt: skip
    assert code == 2 and message in err
