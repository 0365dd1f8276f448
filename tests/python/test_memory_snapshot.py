"""`ferry simulate --memory-snapshot FILE` writes the run as the pickle
torch.cuda.memory._dump_snapshot writes: it loads with pickle, torch.cuda._memory_viz draws and
summarizes it, its final segments are where its trace ends, and replaying its trace gives the
peaks `ferry simulate --json` reports."""

import json
import os
import pickle
import pickletools
import subprocess
from collections import Counter

import pytest
from torch.cuda import _memory_viz

from ferry_cli import REPO, cli

MODELS = os.path.join(REPO, "scenarios", "models")
PROGRAMS = os.path.join(REPO, "scenarios", "programs")
GOLDEN_PICKLE = os.path.join(REPO, "tests", "golden", "pickle", "values.hex")

# Each a run ferry simulates on one device: presets with offload (ferry's policy, trl's stash),
# checkpointing, and model files from scenarios/.
SCENARIOS = {
    "tiny-gpt-ferry": ["--model", "tiny-gpt", "--policy", "ferry"],
    "tiny-llama-trl": ["--model", "tiny-llama", "--policy", "trl"],
    "tiny-gpt-checkpoint": ["--model", "tiny-gpt", "--policy", "none", "--checkpoint", "every:1"],
    "llama3-8b-ferry": ["--model", "llama3-8b-s4096", "--policy", "ferry", "--steps", "1"],
    "mlp-json-ferry": [
        "--model",
        os.path.join(MODELS, "mlp.json"),
        "--policy",
        "ferry",
        "--min-bytes",
        "0",
    ],
    "unused-branch-json-trl": [
        "--model",
        os.path.join(MODELS, "unused_branch.json"),
        "--policy",
        "trl",
        "--min-bytes",
        "0",
    ],
    # The caching allocator with expandable segments (docs/allocators.md).
    "tiny-gpt-ferry-expandable": [
        "--model",
        "tiny-gpt",
        "--policy",
        "ferry",
        "--allocator",
        "expandable",
    ],
    "titan-fsdp8-expandable": [
        "--model",
        "titan-llama3-8b-s8192",
        "--fsdp",
        "8",
        "--policy",
        "none",
        "--checkpoint",
        "every:1",
        "--steps",
        "1",
        "--allocator",
        "expandable",
    ],
}
EXPANDABLE = {name for name, args in SCENARIOS.items() if "expandable" in args}
ACTIONS = {
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
}
STATES = {"active_allocated", "active_pending_free", "inactive"}


def simulate(path, args):
    """Runs `ferry simulate ARGS --json --memory-snapshot PATH`; the --json document."""
    result = subprocess.run(
        [cli(), "simulate", *args, "--json", "--memory-snapshot", str(path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Scenario name -> (the --json summary, the snapshot's path, the loaded snapshot)."""
    folder = tmp_path_factory.mktemp("snapshots")
    out = {}
    for name, args in SCENARIOS.items():
        path = folder / f"{name}.pickle"
        summary = simulate(path, args)
        with open(path, "rb") as f:
            out[name] = (summary, path, pickle.load(f))
    return out


def replay(trace):
    """Allocated and reserved bytes over the trace: (final, peak) of each, as the memory
    visualizer's timelines add them up (an allocation counts until its free completes)."""
    allocated = reserved = peak_allocated = peak_reserved = 0
    for e in trace:
        if e["action"] == "alloc":
            allocated += e["size"]
        elif e["action"] == "free_completed":
            allocated -= e["size"]
        elif e["action"] in ("segment_alloc", "segment_map"):
            reserved += e["size"]
        elif e["action"] in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
        peak_allocated = max(peak_allocated, allocated)
        peak_reserved = max(peak_reserved, reserved)
    return allocated, peak_allocated, reserved, peak_reserved


def check_frames(frames, where):
    assert isinstance(frames, list), where
    for f in frames:
        assert set(f) == {"filename", "line", "name"}, where
        assert isinstance(f["filename"], str) and isinstance(f["name"], str), where
        assert isinstance(f["line"], int) and f["line"] >= 0, where


@pytest.mark.parametrize("name", SCENARIOS)
def test_snapshot_has_the_schema_pytorch_writes(runs, name):
    _, _, snap = runs[name]
    assert list(snap) == ["segments", "device_traces", "allocator_settings", "external_annotations"]
    assert snap["external_annotations"] == []
    settings = snap["allocator_settings"]
    expandable = name in EXPANDABLE
    assert settings["PYTORCH_CUDA_ALLOC_CONF"] == ("expandable_segments:True" if expandable else "")
    assert settings["expandable_segments"] is expandable
    assert isinstance(settings["garbage_collection_threshold"], float)
    assert list(settings["roundup_power2_divisions"]) == [str(1 << i) for i in range(16)]
    assert len(snap["device_traces"]) == 1, "one simulated device"
    for i, seg in enumerate(snap["segments"]):
        where = f"segments[{i}]"
        assert seg["device"] == 0 and seg["segment_type"] in ("small", "large"), where
        assert seg["segment_pool_id"] == (0, 0) and seg["is_expandable"] is expandable, where
        check_frames(seg["frames"], where)
        address = seg["address"]
        for j, b in enumerate(seg["blocks"]):
            assert b["address"] == address, f"{where}.blocks[{j}] follows the previous block"
            assert b["state"] in STATES and 0 <= b["requested_size"] <= b["size"], where
            check_frames(b["frames"], f"{where}.blocks[{j}]")
            address += b["size"]
        assert address == seg["address"] + seg["total_size"], f"{where}: blocks fill it"
        active = [b for b in seg["blocks"] if b["state"] != "inactive"]
        assert seg["active_size"] == sum(b["size"] for b in active), where
        assert seg["allocated_size"] == sum(
            b["size"] for b in active if b["state"] == "active_allocated"
        ), where
    times = []
    for i, e in enumerate(snap["device_traces"][0]):
        where = f"device_traces[0][{i}]"
        assert e["action"] in ACTIONS, where
        assert isinstance(e["addr" if e["action"] != "oom" else "device_free"], int), where
        assert e["size"] > 0 and isinstance(e["stream"], int), where
        check_frames(e["frames"], where)
        times.append(e["time_us"])
    assert times == sorted(times), "the trace follows simulated time"


@pytest.mark.parametrize("name", SCENARIOS)
def test_replayed_trace_peaks_are_the_peaks_ferry_reports(runs, name):
    summary, _, snap = runs[name]
    _, peak_allocated, _, peak_reserved = replay(snap["device_traces"][0])
    assert peak_allocated == summary["result"]["peak_allocated_bytes"]
    assert peak_reserved == summary["result"]["peak_reserved_bytes"]
    assert peak_allocated > 0


@pytest.mark.parametrize("name", SCENARIOS)
def test_segments_are_the_state_where_the_trace_ends(runs, name):
    _, _, snap = runs[name]
    trace = snap["device_traces"][0]
    allocated, _, reserved, _ = replay(trace)
    blocks, segments = {}, {}
    for e in trace:
        if e["action"] == "alloc":
            blocks[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            del blocks[e["addr"]]
        elif e["action"] == "segment_alloc":
            segments[e["addr"]] = e["size"]
        elif e["action"] == "segment_free":
            del segments[e["addr"]]
        elif e["action"] == "segment_map":
            segments = mapped(segments, e["addr"], e["size"], True)
        elif e["action"] == "segment_unmap":
            segments = mapped(segments, e["addr"], e["size"], False)
    if name in EXPANDABLE:
        # An expandable segment is reported as its contiguous mapped ranges, as torch does.
        segments = merged(segments)
        assert any(e["action"] == "segment_map" for e in trace)
        assert not any(e["action"] in ("segment_alloc", "segment_free") for e in trace)
    assert segments == {s["address"]: s["total_size"] for s in snap["segments"]}
    active = {
        b["address"]: b["size"]
        for s in snap["segments"]
        for b in s["blocks"]
        if b["state"] != "inactive"
    }
    assert blocks == active
    assert allocated == sum(active.values())
    assert reserved == sum(segments.values())


def mapped(ranges, address, size, on):
    """`ranges` (start -> size, disjoint) with [address, address + size) mapped (`on`) or
    unmapped."""
    out = {}
    for start, length in ranges.items():
        end = start + length
        if on:
            assert end <= address or address + size <= start, "mapped twice"
            out[start] = length
            continue
        if start < address:
            out[start] = min(end, address) - start
        if end > address + size:
            out[max(start, address + size)] = end - max(start, address + size)
    if on:
        out[address] = size
    return out


def merged(ranges):
    """`ranges` with adjacent ones joined."""
    out = {}
    for start in sorted(ranges):
        last = max(out, default=None)
        if last is not None and last + out[last] == start:
            out[last] += ranges[start]
        else:
            out[start] = ranges[start]
    return out


def check_program(path, program):
    """Runs `ferry check PROGRAM --json --memory-snapshot PATH`; (exit code, --json document,
    loaded snapshot)."""
    result = subprocess.run(
        [cli(), "check", program, "--json", "--memory-snapshot", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    with open(path, "rb") as f:
        return result.returncode, json.loads(result.stdout), pickle.load(f)


@pytest.mark.parametrize(
    "program",
    [
        "free_with_record_stream",
        "two_gpu_pipeline",
        "record_stream_on_one_of_two_readers",
        "offload_step",
    ],
)
def test_check_writes_the_snapshot_of_a_program(tmp_path, program):
    _, summary, snap = check_program(
        tmp_path / "p.pickle", os.path.join(PROGRAMS, f"{program}.json")
    )
    devices = summary["memory"]["devices"]
    assert len(snap["device_traces"]) == len(devices)
    for d, (trace, device) in enumerate(zip(snap["device_traces"], devices)):
        _, peak_allocated, _, peak_reserved = replay(trace)
        assert peak_allocated == device["allocated_peak_bytes"], f"device {d}"
        assert peak_reserved == device["reserved_peak_bytes"], f"device {d}"
        _, _, reserved, _ = replay(trace)
        assert reserved == sum(s["total_size"] for s in snap["segments"] if s["device"] == d)


def test_record_stream_free_completes_after_the_other_streams_work(tmp_path):
    _, summary, snap = check_program(
        tmp_path / "p.pickle", os.path.join(PROGRAMS, "free_with_record_stream.json")
    )
    assert summary["memory"]["devices"][0]["deferred_frees"] == 1
    trace = snap["device_traces"][0]
    requested = [i for i, e in enumerate(trace) if e["action"] == "free_requested"]
    completed = [i for i, e in enumerate(trace) if e["action"] == "free_completed"]
    assert len(requested) == len(completed) == 1
    assert completed[0] > requested[0] + 1, "other actions came between request and completion"
    assert trace[completed[0]]["time_us"] > trace[requested[0]]["time_us"]
    assert trace[completed[0]]["frames"] == trace[requested[0]]["frames"]


def test_out_of_memory_is_an_oom_event(tmp_path):
    code, summary, snap = check_program(
        tmp_path / "oom.pickle", os.path.join(REPO, "tests", "cli", "oom.json")
    )
    assert code == 1 and summary["memory"]["devices"][0]["ooms"] == 1
    ooms = [e for e in snap["device_traces"][0] if e["action"] == "oom"]
    assert len(ooms) == 1 and "addr" not in ooms[0]
    with open(os.path.join(REPO, "scenarios", "devices", "h100-sxm-pcie5.json")) as f:
        capacity = json.load(f)["memory_bytes"]
    reserved = sum(s["total_size"] for s in snap["segments"])
    assert ooms[0]["device_free"] + reserved == capacity, "free: what is not reserved"
    assert ooms[0]["size"] == 32 << 30, "the request that did not fit"


def test_a_run_out_of_memory_ends_its_trace_with_the_oom(tmp_path):
    """A device too small even for the rerun with eight times its memory: the snapshot is of
    the run that failed, up to the allocation that did not fit."""
    with open(os.path.join(REPO, "scenarios", "devices", "h100-sxm-pcie5.json")) as f:
        profile = json.load(f)
    profile["name"] = "small"
    profile["memory_bytes"] = 5 << 26
    device = tmp_path / "small.json"
    device.write_text(json.dumps(profile))
    path = tmp_path / "oom.pickle"
    result = subprocess.run(
        [
            cli(),
            "simulate",
            "--model",
            "gpt2-small-s2048",
            "--device",
            str(device),
            "--policy",
            "none",
            "--json",
            "--memory-snapshot",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    summary = json.loads(result.stdout)["result"]
    assert summary["failure"].startswith("out of memory")
    with open(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]
    assert trace[-1]["action"] == "oom"
    _, peak_allocated, reserved, peak_reserved = replay(trace)
    assert trace[-1]["device_free"] == profile["memory_bytes"] - reserved
    assert peak_allocated == summary["peak_allocated_bytes"]
    assert peak_reserved == summary["peak_reserved_bytes"] <= profile["memory_bytes"]


def test_frames_name_the_call_and_the_layers(runs):
    _, _, snap = runs["tiny-gpt-ferry"]
    allocs = [e for e in snap["device_traces"][0] if e["action"] == "alloc"]
    frames = allocs[0]["frames"]
    assert frames[0]["filename"] == "alloc"
    names = [f["name"] for e in allocs for f in e["frames"]]
    assert any(n.startswith("layers.0.") for n in names)
    assert "layers.0" in names and "layers" in names, "the dotted prefixes are outer frames"
    for e in allocs:
        inner, outer = e["frames"][0]["name"], [f["name"] for f in e["frames"][1:]]
        assert all(inner.startswith(o + ".") for o in outer), e["frames"]


@pytest.mark.parametrize("name", ["tiny-gpt-ferry", "mlp-json-ferry", "tiny-gpt-ferry-expandable"])
def test_memory_viz_draws_and_summarizes_it(runs, name):
    _, path, snap = runs[name]
    for html in (
        _memory_viz.trace_plot(snap),
        _memory_viz.trace_plot(snap, plot_segments=True),
        _memory_viz.segment_plot(snap),
    ):
        assert html.startswith("\n<!DOCTYPE html>") and "snapshot.pickle" in html
    summary = _memory_viz.segsum(snap)
    assert f"segments: {len(snap['segments'])}" in summary
    text = _memory_viz.trace(snap)
    assert f"{len(snap['device_traces'][0])} entries" in text and "TOTAL MEM" in text
    # The flame graphs' input lines (the flamegraph.pl step itself downloads a script).
    lines = _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    assert "active_allocated" in lines
    lines = _memory_viz.segments(snap, format_flamegraph=lambda lines: lines)
    assert "seg_" in lines
    # As the command line tool reads it.
    result = subprocess.run(
        [os.sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "total_reserved" in result.stdout


def test_snapshot_uses_protocol_2_opcodes_only(runs):
    _, path, _ = runs["tiny-gpt-ferry"]
    data = path.read_bytes()
    opcodes = Counter(op.name for op, _, _ in pickletools.genops(data))
    assert all(
        pickletools.opcodes[[o.name for o in pickletools.opcodes].index(n)].proto <= 2
        for n in opcodes
    ), opcodes
    assert data[:2] == b"\x80\x02"


def test_same_input_gives_byte_identical_snapshots(tmp_path):
    args = SCENARIOS["tiny-llama-trl"]
    first, second = tmp_path / "a.pickle", tmp_path / "b.pickle"
    simulate(first, args)
    simulate(second, args)
    assert first.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("bad", ["no_such_folder/x.pickle", "."])
def test_unwritable_path_is_bad_input(tmp_path, bad):
    result = subprocess.run(
        [cli(), "simulate", "--model", "tiny-gpt", "--memory-snapshot", str(tmp_path / bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--memory-snapshot: cannot write" in result.stderr


def test_pipeline_says_it_has_no_snapshot(tmp_path):
    result = subprocess.run(
        [
            cli(),
            "simulate",
            "--model",
            "tiny-gpt",
            "--pp",
            "2",
            "--memory-snapshot",
            str(tmp_path / "p.pickle"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "no memory snapshot yet" in result.stderr
    assert not (tmp_path / "p.pickle").exists()


def test_golden_pickle_bytes_load_as_the_value_the_writer_was_given():
    """tests/unit/pickle_test.cpp checks PickleWriter writes exactly these bytes."""
    with open(GOLDEN_PICKLE) as f:
        data = bytes.fromhex(f.read().strip())
    value = pickle.loads(data)
    assert value == {
        "ints": [0, 255, 256, 65535, 65536, -1, 2**31, -(2**31) - 1, 2**32, -(2**63), 2**63 - 1],
        "float": -0.25,
        "flags": (True, False, None),
        "text": "caf\u00e9",
        "bad": "a\ufffdb",
        "shared": [[1, 2], [1, 2]],
        "empty": {},
    }
    assert value["shared"][0] is value["shared"][1], "a recalled container is one object"
    assert max(op.proto for op, _, _ in pickletools.genops(data)) <= 2


# A plan that recomputes (at its floor, 66 MiB: the two 32 MiB cuBLAS workspaces of the H100
# profile and 2 MiB) and one that keeps everything; no margin, these are the simulator's peaks.
@pytest.mark.parametrize("budget", ["66MiB", "70MiB"])
def test_plan_writes_the_snapshot_of_its_run(tmp_path, budget):
    """`ferry plan --memory-snapshot`: the plan's run, whose replayed peaks are the plan's."""
    path = tmp_path / "plan.pickle"
    result = subprocess.run(
        [
            cli(),
            "plan",
            "--model",
            "tiny-llama",
            "--budget",
            budget,
            "--margin",
            "0",
            "--json",
            "--memory-snapshot",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    with open(path, "rb") as f:
        snap = pickle.load(f)
    _, peak_allocated, _, peak_reserved = replay(snap["device_traces"][0])
    assert peak_allocated == report["peak_allocated_bytes"]
    assert peak_reserved == report["peak_reserved_bytes"]
    assert _memory_viz.trace_plot(snap)


def test_plan_sweep_has_no_snapshot(tmp_path):
    result = subprocess.run(
        [
            cli(),
            "plan",
            "--model",
            "tiny-gpt",
            "--sweep",
            "2",
            "--memory-snapshot",
            str(tmp_path / "s.pickle"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2
    assert "not with --sweep" in result.stderr
