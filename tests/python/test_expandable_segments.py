"""The caching allocator with expandable segments from Python: `allocator=` on
`ferry.simulate / compare / plan`, a model file's "allocator" member, and `ferry.trace` filling
it from PYTORCH_CUDA_ALLOC_CONF (docs/allocators.md, docs/model-format.md)."""

import json
import os
import subprocess

import pytest
import torch

import ferry
from ferry._trace import allocator_setting
from ferry_cli import REPO, cli

#: Records "allocator": "expandable"; its reserved peak differs between the two allocators.
MODEL_FILE = os.path.join(REPO, "tests", "cli", "three_layers_expandable.json")
TITAN = {"fsdp": 8, "policy": "none", "checkpoint": "every:1"}


@pytest.mark.parametrize(
    "conf, expected",
    [
        ("", None),
        ("expandable_segments:True", "expandable"),
        ("expandable_segments:False", None),
        ("max_split_size_mb:128, expandable_segments:True", "expandable"),
        ("expandable_segments:True,expandable_segments:False", None),
        ("garbage_collection_threshold:0.6", None),
    ],
)
def test_trace_reads_the_alloc_conf_as_its_last_expandable_segments_entry(conf, expected):
    assert allocator_setting(conf) == expected


def result(model, **options):
    return ferry.simulate(model, check=False, **options)["result"]


@pytest.mark.parametrize("set_to_none", [None, False])
def test_the_model_files_allocator_is_the_default_and_allocator_overrides_it(set_to_none):
    grads = {"set_to_none": set_to_none}
    from_file = result(MODEL_FILE, policy="none", **grads)
    expandable = result(MODEL_FILE, policy="none", allocator="expandable", **grads)
    default = result(MODEL_FILE, policy="none", allocator="default", **grads)
    assert from_file == expandable
    assert expandable["peak_reserved_bytes"] != default["peak_reserved_bytes"]
    if set_to_none is False:
        # With the gradients kept from set-up on, expandable segments reserve less; freed
        # between steps, this small model's step reserves less under the default allocator
        # (tests/cli/CMakeLists.txt: 144703488 B against 148897792 B).
        assert expandable["peak_reserved_bytes"] < default["peak_reserved_bytes"]
    rows = ferry.compare(MODEL_FILE, check=False, **grads)["rows"]
    assert rows[0]["name"] == "none"
    assert rows[0]["peak_reserved_bytes"] == expandable["peak_reserved_bytes"]


def test_expandable_segments_reserve_less_for_the_same_fsdp_step():
    default = result("titan-llama3-8b-s8192", **TITAN)
    expandable = result("titan-llama3-8b-s8192", allocator="expandable", **TITAN)
    assert expandable["peak_reserved_bytes"] < default["peak_reserved_bytes"]
    # The same step: the allocator changes where blocks lie, not what is allocated or when.
    assert expandable["step_time_ns"] == default["step_time_ns"]
    assert abs(expandable["peak_allocated_bytes"] - default["peak_allocated_bytes"]) < 2**21
    assert expandable["hazards"] == 0


def test_python_and_the_command_line_give_one_document():
    args = ["--model", "titan-llama3-8b-s8192", "--fsdp", "8", "--policy", "none"]
    args += ["--checkpoint", "every:1", "--no-checker", "--allocator", "expandable", "--json"]
    done = subprocess.run([cli(), "simulate", *args], capture_output=True, text=True, check=True)
    python = ferry.simulate("titan-llama3-8b-s8192", check=False, allocator="expandable", **TITAN)
    assert json.loads(done.stdout) == python


def test_a_plan_runs_under_expandable_segments():
    report = ferry.plan("tiny-gpt", allocator="expandable")
    assert report["hazards"] == 0
    with pytest.raises(ferry.PlanError, match='--allocator: "cuda" is not default or expandable'):
        ferry.plan("tiny-gpt", allocator="cuda")


def traced(monkeypatch, conf):
    if conf is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 2816), torch.nn.ReLU(), torch.nn.Linear(2816, 2048)
    )
    x = torch.randn(1024, 2048)
    return ferry.trace(model, x, loss_fn=lambda out: out.sum(), target="host")


def test_trace_records_expandable_segments_and_simulate_runs_them(monkeypatch):
    under_conf = traced(monkeypatch, "expandable_segments:True")
    plain = traced(monkeypatch, None)
    assert under_conf.document["allocator"] == "expandable"
    assert "allocator" not in plain.document
    assert "allocator" not in traced(monkeypatch, "expandable_segments:False").document
    expandable = result(under_conf, policy="none")
    assert expandable == result(plain, policy="none", allocator="expandable")
    assert result(under_conf, policy="none", allocator="default") == result(plain, policy="none")
    assert expandable != result(plain, policy="none")


def test_a_bad_allocator_in_a_model_document_names_the_place(tmp_path):
    with open(MODEL_FILE, encoding="utf-8") as f:
        document = json.load(f)
    document["allocator"] = "cuda-expandable"
    path = tmp_path / "bad_allocator.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(ValueError, match='allocator: expected "default" or "expandable"'):
        result(str(path))
