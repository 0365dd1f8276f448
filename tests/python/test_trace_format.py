"""The Chrome/Perfetto trace `ferry check --trace` and `ferry simulate --trace` write follows the
trace-event format (the "JSON Object Format" of Google's Trace Event Format document) and keeps
one track per stream and per copy engine, with memory counters."""

import json
import os
import subprocess
from collections import Counter
from numbers import Number

import pytest

from ferry_cli import REPO, cli

PROGRAMS = os.path.join(REPO, "scenarios", "programs")
MODELS = os.path.join(REPO, "scenarios", "models")
# Phases the writer may use and those that need a thread id: complete, instant, counter,
# metadata, flow (start/step/end).
PHASES = set("XiICMsf") | {"t"}
NEEDS_TID = set("XiIsft")


def events_of(path):
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        assert isinstance(data.get("traceEvents"), list), "an object needs a traceEvents array"
        return data["traceEvents"]
    assert isinstance(data, list), "the trace is an object or an array"
    return data


def validate(path):
    """Checks the trace-event structure; returns the thread names by (pid, tid) and the
    counters' names."""
    events = events_of(path)
    assert events, "an empty trace"
    processes, threads, used_pids, used_threads, counters = {}, Counter(), set(), set(), set()
    names = {}
    for i, e in enumerate(events):
        where = f"traceEvents[{i}] {e}"
        assert isinstance(e, dict), where
        ph = e.get("ph")
        assert ph in PHASES, where
        assert isinstance(e.get("name"), str), where
        assert isinstance(e.get("pid"), int), where
        if ph in NEEDS_TID or (ph == "M" and e["name"].startswith("thread_")):
            assert isinstance(e.get("tid"), int), where
        if ph != "M":
            assert isinstance(e.get("ts"), Number) and e["ts"] >= 0, where
            used_pids.add(e["pid"])
            if "tid" in e:
                used_threads.add((e["pid"], e["tid"]))
        if ph == "X":
            assert isinstance(e.get("dur"), Number) and e["dur"] >= 0, where
        if ph == "C":
            args = e.get("args")
            assert isinstance(args, dict) and args, where
            assert all(isinstance(v, Number) for v in args.values()), where
            counters.add(e["name"])
        if ph == "M":
            assert isinstance(e.get("args"), dict), where
            if e["name"] == "process_name":
                assert e["pid"] not in processes, f"{where}: a second process_name"
                processes[e["pid"]] = e["args"]["name"]
            elif e["name"] == "thread_name":
                key = (e["pid"], e["tid"])
                threads[key] += 1
                assert threads[key] == 1, f"{where}: a second thread_name"
                names[key] = e["args"]["name"]
    for pid in used_pids:
        assert pid in processes, f"pid {pid} has events but no process_name"
    for key in used_threads:
        assert key in names, f"pid/tid {key} has events but no thread_name"
    for pid, _ in names:
        assert pid in processes, f"pid {pid} names a thread but has no process_name"
    return processes, names, counters


def run(*args):
    result = subprocess.run([cli(), *args], capture_output=True, text=True, timeout=120)
    return result


# Every bundled program, the field pairs' of scenarios/programs/field/ included.
@pytest.mark.parametrize(
    "program",
    sorted(
        os.path.relpath(os.path.join(d, f), PROGRAMS)
        for d, _, files in os.walk(PROGRAMS)
        for f in files
        if f.endswith(".json")
    ),
)
def test_check_trace(tmp_path, program):
    path = tmp_path / "trace.json"
    source = json.loads(open(os.path.join(PROGRAMS, program)).read())
    result = run("check", os.path.join(PROGRAMS, program), "--trace", str(path))
    assert result.returncode in (0, 1), result.stdout + result.stderr  # safe or findings
    processes, threads, counters = validate(path)
    labels = Counter(threads.values())
    # One track per stream of the program, and one per copy engine of each device.
    for stream in source["streams"]:
        assert labels[f"stream {stream['name']}"] == 1, (stream, threads)
    for device in source["devices"]:
        engines = [n for n in labels if n.startswith(f"engine {device['name']} ")]
        assert engines, (device, threads)
        assert all(labels[n] == 1 for n in engines)
        assert device["name"] in processes.values()
    assert "device memory" in counters, counters


@pytest.mark.parametrize("checkpoint", ["none", "every:1"])
def test_simulate_trace(tmp_path, checkpoint):
    path = tmp_path / "trace.json"
    # No offload horizon: the small model's tensors all go to pinned host memory (with the
    # horizon the link derives, none of them would), so the trace has both memory counters.
    result = run(
        "simulate",
        "--model",
        os.path.join(MODELS, "mlp.json"),
        "--checkpoint",
        checkpoint,
        "--horizon",
        "none",
        "--trace",
        str(path),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    processes, threads, counters = validate(path)
    labels = Counter(threads.values())
    assert all(count == 1 for count in labels.values()), labels
    assert any(n.startswith("stream ") for n in labels), labels
    assert any(n.startswith("engine ") for n in labels), labels
    assert {"device memory", "pinned host memory"} <= counters, counters


def test_pipeline_trace_is_refused_not_silently_missing(tmp_path):
    path = tmp_path / "trace.json"
    result = run(
        "simulate",
        "--model",
        os.path.join(MODELS, "mlp.json"),
        "--pp",
        "2",
        "--trace",
        str(path),
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "has no trace yet" in result.stderr
    assert not path.exists()


def test_validator_catches_malformed_traces(tmp_path):
    """The checks above are not vacuous: each defect of the format, planted, fails them."""
    good = tmp_path / "good.json"
    assert (
        run("check", os.path.join(PROGRAMS, "offload_step.json"), "--trace", str(good)).returncode
        == 0
    )
    validate(good)
    events = events_of(good)
    thread = next(e for e in events if e["name"] == "thread_name")
    x = next(e for e in events if e["ph"] == "X")
    c = next(e for e in events if e["ph"] == "C")
    plants = {
        "second thread_name": lambda ev: ev.append(dict(thread)),
        "X without dur": lambda ev: ev[ev.index(x)].pop("dur"),
        "negative dur": lambda ev: ev[ev.index(x)].update(dur=-1),
        "counter with a string": lambda ev: ev[ev.index(c)]["args"].update(allocated="1"),
        "unnamed tid": lambda ev: ev.append(dict(x, tid=424242)),
        "string ts": lambda ev: ev[ev.index(x)].update(ts="0"),
    }
    for name, plant in plants.items():
        bad = json.loads(good.read_text())
        plant(bad["traceEvents"])
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(AssertionError):
            validate(path)
        print(f"caught: {name}")
