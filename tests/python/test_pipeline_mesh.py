"""A pipeline on the mesh (docs/parallelism.md, "The pipeline on the mesh"): `ferry compare` and
`ferry plan --pp N` with FSDP x TP on the 70B-like preset and FSDP x EP on the traced
Mixtral. Every pipeline row and the checked plan are hazard-free, each stage's peaks are
reported, the plan is never slower than the fastest fixed row that fits every stage, and the
report says why it runs its schedule."""

import os

from ferry_cli import REPO
from plan_checks import cli_json

MIXTRAL = os.path.join(REPO, "tests", "data", "traced", "sized", "mixtral.json")


def plan_holds(report, stages):
    plan = report["plan"]
    assert plan["checked"] and plan["hazards"] == 0 and plan["failure"] is None
    assert len(plan["stage_peak_reserved_bytes"]) == stages
    assert len(plan["stage_peak_allocated_bytes"]) == stages
    assert max(plan["stage_peak_reserved_bytes"]) <= report["planned_budget_bytes"]
    fitting = [c for c in report["configurations"] if c["fixed"] and c["fits"]]
    assert fitting and all(plan["step_time_ns"] <= c["step_time_ns"] for c in fitting)
    assert report["schedule_reason"].startswith("schedule: 1f1b (none asked: torchtitan's")


def rows_hold(document, stages):
    rows = document["pipeline"]
    assert rows and all(r["hazards"] == 0 for r in rows), [r["name"] for r in rows]
    assert all(len(r["device_peak_allocated_bytes"]) == stages for r in rows)


def test_llama_70b_at_fsdp_tp_pp_over_128_gpus(cli):
    mesh = ["--fsdp", "8", "--tp", "4", "--pp", "4", "--micro-batches", "8"]
    code, document, err = cli_json(cli, "compare", "--model", "llama-70b-s8192", *mesh)
    assert code == 0, err
    rows_hold(document, 4)
    assert document["fsdp"]["ranks"] == 8 and document["tp"]["ranks"] == 4
    code, report, err = cli_json(cli, "plan", "--model", "llama-70b-s8192", *mesh, "--margin", "0")
    assert code == 0, err
    plan_holds(report, 4)
    assert report["fsdp"]["reshard_after_forward"] is False


def test_traced_mixtral_at_ep_pp(cli):
    mesh = ["--fsdp", "8", "--ep", "8", "--pp", "2", "--micro-batches", "8"]
    code, document, err = cli_json(cli, "compare", "--model", MIXTRAL, *mesh, "--schedule", "1f1b")
    assert code == 0, err
    rows_hold(document, 2)
    code, report, err = cli_json(
        cli, "plan", "--model", MIXTRAL, *mesh, "--budget", "6.5GiB", "--margin", "0"
    )
    assert code == 0, err
    plan_holds(report, 2)
    assert report["ep"]["ranks"] == 8
