"""The simulator and planner inside `ferry._simulator`: `ferry.simulate`, `ferry.compare` and
`ferry.plan` return the documents `ferry simulate / compare / plan --json` print, field for
field, without a subprocess; plans are checked and lowered by the simulator's own code."""

import json
import subprocess

import pytest
import torch

import ferry
from ferry_cli import cli
from models import TinyLM, loss_of

DEVICE = "a100-pcie4"


def run_cli(*args):
    done = subprocess.run([cli(), *args], capture_output=True, text=True, check=False)
    return done.returncode, done.stdout, done.stderr


def cli_json(*args):
    code, out, err = run_cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    torch.manual_seed(0)
    model, x = TinyLM(d=64), torch.randn(8, 16, 64)
    t = ferry.trace(model, x, loss_fn=loss_of, target="host")
    path = tmp_path_factory.mktemp("traced") / "model.json"
    t.save(path)
    return t, str(path)


@pytest.mark.parametrize(
    "options, flags",
    [
        ({}, []),
        ({"policy": "trl", "steps": 3}, ["--policy", "trl", "--steps", "3"]),
        (
            {"checkpoint": "every:1", "horizon": "none"},
            ["--checkpoint", "every:1", "--horizon", "none"],
        ),
        ({"prefetch": False, "check": False}, ["--no-prefetch", "--no-checker"]),
        # A pipeline, as `ferry simulate --pp N` runs it (docs/pipeline.md).
        (
            {"pp": 2, "micro_batches": 6, "schedule": "gpipe", "pipeline_checkpoint": "always"},
            ["--pp", "2", "--micro-batches", "6", "--schedule", "gpipe"]
            + ["--pipeline-checkpoint", "always"],
        ),
        (
            {"pp": 2, "schedule": "interleaved-1f1b", "virtual_stages": 2, "split": "balanced"},
            ["--pp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"]
            + ["--split", "balanced"],
        ),
    ],
)
def test_simulate_is_the_cli_document(options, flags):
    got = ferry.simulate("tiny-gpt", device=DEVICE, **options)
    assert got == cli_json("simulate", "--model", "tiny-gpt", "--device", DEVICE, *flags)
    assert list(got) == list(
        cli_json("simulate", "--model", "tiny-gpt", "--device", DEVICE, *flags)
    )


def test_a_traced_model_simulates_as_its_file_does(traced):
    model, path = traced
    assert ferry.simulate(model, device=DEVICE, policy="ferry") == ferry.simulate(
        path, device=DEVICE, policy="ferry"
    )
    assert ferry.simulate(model, device=DEVICE)["result"]["hazards"] == 0


def test_compare_is_the_cli_document():
    assert ferry.compare("tiny-gpt", device=DEVICE) == cli_json(
        "compare", "--model", "tiny-gpt", "--device", DEVICE
    )


def test_compare_runs_ferry_under_the_horizon_asked_as_simulate_does():
    # gpt2-small-s1024 on the H100 profile: the derived horizon keeps 179 MiB of 1 GiB off the
    # link (docs/offload.md), so `none` changes the ferry row.
    model, device = "gpt2-small-s1024", "h100-sxm-pcie5"
    for horizon in ("none", "auto"):
        rows = {r["name"]: r for r in ferry.compare(model, device=device, horizon=horizon)["rows"]}
        alone = ferry.simulate(model, device=device, policy="ferry", horizon=horizon)["result"]
        assert rows["ferry"]["step_time_ns"] == alone["step_time_ns"], horizon
        assert rows["ferry"]["d2h_bytes"] == alone["d2h_bytes"], horizon
    flags = ("compare", "--model", model, "--device", device, "--horizon", "none")
    assert ferry.compare(model, device=device, horizon="none") == cli_json(*flags)
    none, auto = (
        {r["name"]: r for r in ferry.compare(model, device=device, horizon=h)["rows"]}["ferry"]
        for h in ("none", "auto")
    )
    assert none["d2h_bytes"] > auto["d2h_bytes"]


def test_compare_has_the_cli_pipeline_rows():
    got = ferry.compare("tiny-gpt", device=DEVICE, steps=1, pp=2, micro_batches=2)
    want = cli_json(
        "compare",
        "--model",
        "tiny-gpt",
        "--device",
        DEVICE,
        "--steps",
        "1",
        "--pp",
        "2",
        "--micro-batches",
        "2",
    )
    assert got == want
    assert [row["devices"] for row in got["pipeline"]] == [2] * len(got["pipeline"])


def test_compare_takes_an_interleaved_schedule_as_the_cli_does():
    options = {"pp": 2, "micro_batches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2}
    got = ferry.compare("tiny-gpt", device=DEVICE, steps=1, split="balanced", **options)
    want = cli_json(
        *("compare", "--model", "tiny-gpt", "--device", DEVICE, "--steps", "1"),
        *("--pp", "2", "--micro-batches", "4", "--schedule", "interleaved-1f1b"),
        *("--virtual-stages", "2", "--split", "balanced"),
    )
    assert got == want
    assert {row["schedule"] for row in got["pipeline"]} == {"interleaved-1f1b"}
    assert "pipeline" not in ferry.compare("tiny-gpt", device=DEVICE, steps=1)


def test_a_plan_and_its_text_name_the_parallelism_as_the_cli_does():
    # The text `ferry plan` prints and the one `ferry.plan`'s run returns end with the same
    # FSDP line (the report builders write it).
    model, device = "gpt2-small-s1024", "h100-sxm-pcie5"
    made = ferry._sim.run_planner(model, "1536MiB", device, None, fsdp=8)
    code, out, err = run_cli(
        "plan", "--model", model, "--budget", "1536MiB", "--device", device, "--fsdp", "8"
    )
    assert code == 0, err
    assert made["text"] == out
    assert made["text"].endswith(
        "every figure is one rank's (its pinned memory: its part of the node's)\n"
    )


def test_plan_is_the_cli_report_and_plan(traced, tmp_path):
    _, path = traced
    report = ferry.plan(path, budget="40MiB", device=DEVICE)
    out = tmp_path / "plan.json"
    want = cli_json(
        "plan", "--model", path, "--budget", "40MiB", "--device", DEVICE, "--out", str(out)
    )
    assert report == want
    plan = report["plan"]
    assert plan == json.loads(out.read_text())
    # The plan comes back checked: applying it checks nothing again.
    assert ferry.load_plan(plan) is plan


def test_a_plan_comes_with_the_options_the_planner_lowered_it_to(monkeypatch):
    # A plan the planner made carries its lowered offload options, the core rule's: the plan
    # goes back to the simulator only when it was read from elsewhere.
    made = ferry._sim.run_planner("tiny-gpt", "40MiB", DEVICE, "2GiB")
    plan = made["report"]["plan"]
    assert plan.lowered == made["offload_options"]
    again = ferry._simulator.plan_offload_options(json.dumps(plan), "plan")
    assert plan.lowered == again
    assert plan.lowered["host_cap"] == 2 << 30

    def refuse(text, source):
        raise AssertionError("the plan was sent back to be lowered again")

    monkeypatch.setattr(ferry._simulator, "plan_offload_options", refuse)
    assert ferry._plan.offload_options(plan) == again
    # Planted: the same plan as a plain dict (read from elsewhere) is lowered by the simulator.
    with pytest.raises(AssertionError, match="lowered again"):
        ferry._plan.offload_options(ferry.load_plan(dict(plan)))


def test_auto_applies_the_options_the_planner_lowered(monkeypatch):
    def refuse(text, source):
        raise AssertionError("the plan was sent back to be lowered again")

    monkeypatch.setattr(ferry._simulator, "plan_offload_options", refuse)
    model, x = TinyLM(d=64), torch.randn(8, 16, 64)
    ctx = ferry.auto(model, x, budget="1536MiB", loss_fn=loss_of)
    assert ctx.plan.lowered is not None and ctx.plan.lowered["policy"] in ("none", "ferry")


def test_bad_input_names_what_is_wrong():
    with pytest.raises(
        ValueError, match=r'unknown policy "nope" \(none, trl, trl-seed, trl-1.7, ferry\)'
    ):
        ferry.simulate("tiny-gpt", policy="nope")
    with pytest.raises(ValueError, match="--checkpoint: "):
        ferry.simulate("tiny-gpt", checkpoint="every:zero")
    with pytest.raises(ValueError, match="no-such-device"):
        ferry.simulate("tiny-gpt", device="no-such-device")
    with pytest.raises(ValueError, match="no-such-model"):
        ferry.compare("no-such-model")
    with pytest.raises(TypeError):
        ferry.simulate("tiny-gpt", polcy="ferry")
    with pytest.raises(TypeError, match="TracedModel"):
        ferry.simulate(42)
    with pytest.raises(ferry.PlanError, match="budget") as e:
        ferry.plan("tiny-gpt", budget="40 parsecs")
    assert e.value.exit_code == 2


def test_a_budget_below_the_floor_names_the_floor():
    with pytest.raises(ferry.PlanError, match="the floor .* is [0-9.]+ [KM]iB") as e:
        ferry.plan("tiny-gpt", budget="1KiB", device=DEVICE)
    assert e.value.exit_code == 1
    assert isinstance(e.value.floor, int) and e.value.floor > 1024
    # The CLI refuses it with the same floor.
    code, _, err = run_cli("plan", "--model", "tiny-gpt", "--budget", "1KiB", "--device", DEVICE)
    assert code == 1 and f"({e.value.floor} bytes)" in err


def test_auto_and_validate_run_no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    model, x = TinyLM(d=64), torch.randn(8, 16, 64)
    ctx = ferry.auto(model, x, budget="1536MiB", loss_fn=loss_of)
    assert "step time" in ctx.report
    report = ferry.validate("gpt", policies=["none"], steps=1)
    assert report["policies"]["none"]["simulated"]["step_time_ns"] > 0


def lowered(**fields):
    plan = {
        "format": "ferry.plan/1",
        "model": "m",
        "device": DEVICE,
        "budget_bytes": 0,
        "ops": [{"name": "a/mm", "saved": "keep"}, {"name": "b/mm", "saved": "keep"}],
        **fields,
    }
    return ferry._plan.offload_options(ferry.load_plan(plan))


def test_a_plan_is_lowered_by_the_core_rule():
    assert lowered()["policy"] == "none"
    offloads = lowered(
        ops=[{"name": "a/mm", "saved": "offload"}, {"name": "b/mm", "saved": "keep"}]
    )
    assert offloads["policy"] == "ferry"
    inputs = lowered(regions=[{"first_op": 0, "end_op": 2, "inputs": "offload"}])
    assert inputs["policy"] == "ferry"
    knobs = lowered(
        knobs={"min_bytes": 7, "prefetch": False, "horizon_bytes": 99}, host_budget_bytes=5
    )
    assert (knobs["min_bytes"], knobs["prefetch"], knobs["horizon_bytes"], knobs["host_cap"]) == (
        7,
        False,
        99,
        5,
    )
    assert "host_cap" not in lowered() and "horizon_bytes" not in lowered()


def test_fsdp_arguments_are_the_cli_flags():
    flags = ["--fsdp", "16", "--nodes", "2", "--reshard-after-forward", "8"]
    options = {"fsdp": 16, "nodes": 2, "reshard_after_forward": 8}
    model, device = "gpt2-small-s1024", "h100-sxm-pcie5"
    got = ferry.simulate(model, device=device, **options)
    assert got == cli_json("simulate", "--model", model, "--device", device, *flags)
    assert got["fsdp"]["ranks"] == 16 and got["fsdp"]["per_rank"] is True
    assert ferry.compare(model, device=device, fsdp=8, reshard_after_forward=False) == cli_json(
        "compare",
        "--model",
        model,
        "--device",
        device,
        "--fsdp",
        "8",
        "--reshard-after-forward",
        "false",
    )
    report = ferry.plan(model, budget="1536MiB", device=device, fsdp=8)
    assert report["fsdp"]["ranks"] == 8
    assert report == cli_json(
        "plan", "--model", model, "--budget", "1536MiB", "--device", device, "--fsdp", "8"
    )
    assert report["plan"]["parallelism"] == {"fsdp": 8}
    assert report["node_check_ranks"] == 2


def test_a_plan_replays_under_the_parallelism_it_was_made_for(tmp_path):
    model, device = "gpt2-small-s1024", "h100-sxm-pcie5"
    report = ferry.plan(model, budget="1536MiB", device=device, fsdp=8, reshard_after_forward=2)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(dict(report["plan"])))
    code, out, err = run_cli("simulate", "--model", model, "--device", device, "--plan", str(path))
    assert code == 0, err
    assert "FSDP2 over 8 ranks on 1 node, reshard after forward: 2" in out
    # The file's parallelism is what the flags would give.
    args = ["simulate", "--model", model, "--device", device, "--plan", str(path)]
    replayed = cli_json(*args)
    assert replayed == cli_json(*args, "--fsdp", "8", "--reshard-after-forward", "2")
    assert replayed["fsdp"]["reshard_after_forward"] == 2
    assert replayed != cli_json(*args, "--fsdp", "16")


def test_fsdp_misuse_names_the_option():
    with pytest.raises(ValueError, match='gh200 has no "collectives" links'):
        ferry.simulate("tiny-gpt", device="gh200", fsdp=4)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        ferry.simulate("tiny-gpt", fsdp=4, reshard_after_forward="sometimes")


def test_ferry_jobs_is_read_and_checked(monkeypatch):
    """FERRY_JOBS sets the planner's simulations at once; unset or 0 is one per hardware
    thread, and a value that is no count in 0..1024 is refused by name."""
    from ferry._sim import planner_jobs

    monkeypatch.delenv("FERRY_JOBS", raising=False)
    assert planner_jobs() == 0
    monkeypatch.setenv("FERRY_JOBS", " 3 ")
    assert planner_jobs() == 3
    for bad in ("two", "-1", "1025"):
        monkeypatch.setenv("FERRY_JOBS", bad)
        with pytest.raises(ValueError, match=r"FERRY_JOBS: .* give 1\.\.1024"):
            planner_jobs()


def test_the_progress_line_is_redrawn_and_cleared(capsys):
    """The planner's progress on a terminal: one line, drawn over itself, then erased."""
    from ferry._sim import ProgressLine

    line = ProgressLine()
    line("exact: layer options", 3, 40, 1_500_000)
    line("too soon", 4, 40, None)  # within a tenth of a second: not drawn
    line.clear()
    err = capsys.readouterr().err
    assert err == "\r\033[Kferry plan: exact: layer options 3/40, best 1.5 ms\r\033[K"
