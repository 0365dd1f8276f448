"""`python -m ferry probe` and `ferry.probe`: on the CPU loopback device the probe writes a
profile that the `ferry` CLI's own validation accepts, with the spread of every measurement,
in a fixed layout; bad options are refused naming the option."""

import json
import os
import subprocess

import pytest

import ferry
from conftest import run_module

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUNDLED = os.path.join(REPO, "scenarios", "devices", "h100-sxm-pcie5.json")
SMALL = ["--device", "cpu", "--repeats", "3", "--bytes", "256KiB", "--matmul", "32x64x64"]
# What a loopback probe cannot measure (docs/devices.md, "Measuring a device: ferry probe").
LOOPBACK_ASSUMED = {
    "peer.bytes_per_s",
    "peer.latency_ns",
    "overheads_ns.event_query",
    "overheads_ns.host_access",
    "overheads_ns.host_alloc",
    "blas_workspace_bytes",
}


def probe_files(tmp_path, stem="probed-cpu", *extra):
    profile, report = tmp_path / f"{stem}.json", tmp_path / f"{stem}-report.json"
    out = run_module("probe", *SMALL, "--out", str(profile), "--report", str(report), *extra)
    assert out.returncode == 0, out.stderr
    with open(profile, encoding="utf-8") as f:
        profile_text = f.read()
    with open(report, encoding="utf-8") as f:
        report_doc = json.load(f)
    return out, profile_text, report_doc


def layout(value, prefix=""):
    """The keys of a JSON document in order, with the type of each leaf."""
    if isinstance(value, dict):
        return [
            item for k, v in value.items() for item in [f"{prefix}{k}", *layout(v, f"{prefix}{k}.")]
        ]
    return [f"{prefix}:{type(value).__name__}"]


def test_loopback_profile_is_accepted_by_the_cli(tmp_path, cli):
    out, profile_text, _ = probe_files(tmp_path)
    assert 'profile "probed-cpu": 21 keys measured, 6 assumed' in out.stdout
    path = tmp_path / "probed-cpu.json"
    for command in (["simulate", "--model", "tiny-gpt"], ["compare", "--model", "tiny-gpt"]):
        run = subprocess.run(
            [cli, *command, "--device", str(path)], capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, f"{command}: {run.stderr}"
    profile = json.loads(profile_text)
    assert profile["name"] == "probed-cpu"  # the --out file's name, as the format asks


def test_profile_has_the_bundled_layout_with_integers_only(tmp_path):
    _, profile_text, _ = probe_files(tmp_path)
    profile = json.loads(profile_text)
    with open(BUNDLED, encoding="utf-8") as f:
        bundled = json.load(f)
    # The probe measures one device: the optional links of collectives (docs/fsdp.md) are not
    # among its figures, nor are the optional kernel figures (docs/devices.md), which come from
    # published microbenchmarks of each kernel class rather than from one matmul and one copy.
    bundled.pop("collectives", None)
    bundled.pop("kernels", None)
    # Nor, on the loopback device (the CPU), a TF32 rate (the tensor cores') or a compute
    # capability.
    bundled.pop("tf32_flops_per_s", None)
    bundled.pop("compute_capability", None)
    # The probe writes the cuBLAS workspace torch reports; the bundled files leave it to their
    # compute capability (torch's default there).
    assert profile.pop("blas_workspace_bytes") == 0
    assert layout(profile) == layout(bundled)
    for key, value in profile.items():
        if key not in ("name", "description"):
            leaves = value.values() if isinstance(value, dict) else [value]
            assert all(isinstance(v, int) and not isinstance(v, bool) for v in leaves), key


def test_report_spreads_are_ordered_and_measured_keys_positive(tmp_path):
    _, profile_text, report = probe_files(tmp_path)
    assert report["format"] == "ferry.probe/1"
    assert report["device"] == "cpu" and report["loopback"] is True
    assert report["repeats"] == 3 and report["copy_bytes"] == 256 * 1024
    assert report["matmul"] == {"m": 32, "k": 64, "n": 64}
    assert report["profile"] == json.loads(profile_text)
    for m in report["measurements"]:
        once = m["key"] in ("memory_bytes", "pinned_host_capacity_bytes")
        assert len(m["samples"]) == (1 if once else 3), m["key"]
        assert m["min"] == min(m["samples"]) and m["max"] == max(m["samples"]), m["key"]
        assert m["min"] <= m["median"] <= m["max"], m["key"]
        if m["unit"] != "ns":  # rates and sizes; one API call may round to 0 ns
            assert m["min"] > 0, m["key"]
    keys = [m["key"] for m in report["measurements"]]
    for dtype in ("bf16", "fp16", "fp32"):
        assert f"matmul.{dtype}.flops_per_s" in keys
    assumed = {f["key"] for f in report["profile_keys"] if not f["measured"]}
    assert assumed == LOOPBACK_ASSUMED
    for f in report["profile_keys"]:
        assert f["source"], f["key"]
        if (
            f["measured"]
            and not f["key"].startswith("overheads_ns.")
            and not f["key"].endswith("latency_ns")
        ):
            assert f["value"] > 0, f["key"]


def test_layout_is_the_same_from_run_to_run(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    _, profile_a, report_a = probe_files(first)
    _, profile_b, report_b = probe_files(second)
    # Values are measurements and differ; the keys, their order and the lines do not.
    assert layout(json.loads(profile_a)) == layout(json.loads(profile_b))
    assert [line.split(":")[0] for line in profile_a.splitlines()] == [
        line.split(":")[0] for line in profile_b.splitlines()
    ]
    assert layout(report_a) == layout(report_b)
    assert [m["key"] for m in report_a["measurements"]] == [
        m["key"] for m in report_b["measurements"]
    ]
    assert [f["key"] for f in report_a["profile_keys"]] == [
        f["key"] for f in report_b["profile_keys"]
    ]


def test_json_prints_the_report():
    out = run_module("probe", *SMALL, "--json", "--quiet", "--name", "mine")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["name"] == "mine" and report["profile"]["name"] == "mine"
    assert out.stderr == ""  # --quiet


def test_python_function_returns_the_report_and_writes_the_profile(tmp_path):
    path = tmp_path / "fn.json"
    report = ferry.probe(
        "cpu", repeats=2, bytes="64KiB", matmul=(16, 16, 16), name="fn", out=str(path)
    )
    assert report["format"] == "ferry.probe/1" and report["repeats"] == 2
    with open(path, encoding="utf-8") as f:
        assert json.load(f) == report["profile"]
    assert report["profile"]["name"] == "fn"


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--repeats", "0"], "--repeats"),
        (["--bytes", "12"], "--bytes"),
        (["--bytes", "lots"], "--bytes"),
        (["--matmul", "2x3"], "--matmul"),
        (["--device", "tpu"], "--device"),
        (["--name", "Bad"], "--name"),
        (["--out", "/nonexistent/dir/p.json"], "--out"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_options_exit_2_naming_the_option(args, flag):
    out = run_module("probe", "--device", "cpu", *args)
    assert out.returncode == 2, out.stderr
    assert flag in out.stderr


@pytest.mark.parametrize(
    "options, word",
    [
        ({"device": "tpu"}, "--device"),
        ({"repeats": 0}, "--repeats"),
        ({"name": "Bad"}, "name"),
        ({"bytes": "12"}, "--bytes"),
        ({"matmul": (1, 2)}, "matmul"),
    ],
)
def test_bad_arguments_of_the_function_raise_value_error(options, word):
    with pytest.raises(ValueError, match=word):
        ferry.probe(**{"device": "cpu", **options})


def test_the_cli_runs_the_probe_binary(cli):
    """`ferry probe` is the same command through the CLI binary (which runs ferry-probe)."""
    run = subprocess.run(
        [cli, "probe", *SMALL, "--json", "--quiet"], capture_output=True, text=True, timeout=300
    )
    if run.returncode == 127:
        pytest.skip(f"this CLI has no ferry-probe beside it: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["format"] == "ferry.probe/1"
