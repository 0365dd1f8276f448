"""scripts/gpu_visit.py, the Python steps of scripts/gpu.sh, and scripts/gpu_visit_results.py,
what they write: the rehearsal's checks catch a
step out of order, a missing field, a missing row of the benchmark and a build that read a
system header; the results table; the visit models' scales."""

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    """scripts/NAME.py as the module NAME, as `python scripts/gpu_visit.py` imports it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_visit_results = _load("gpu_visit_results")
gpu_visit = _load("gpu_visit")


def complete_results():
    """Results as a rehearsal writes them: every step ok, every field, every row."""
    figures = {
        "predicted": {f: 1000 for f in gpu_visit_results.FIGURES},
        "measured": {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "step_time_ns": 7},
        "error": dict.fromkeys(gpu_visit_results.FIGURES),
        "counts_exact": True,
    }
    policies = {p: copy.deepcopy(figures) for p in gpu_visit_results.POLICIES}
    rows = [
        {
            "method": m,
            "seq": s,
            "batch": 2,
            "tokens_per_s": 10.0,
            "step_time_ns": 5,
            "peak_allocated_bytes": None,
            "peak_reserved_bytes": None,
        }
        for s in gpu_visit_results.BENCH_SEQS["rehearse"]
        for m in gpu_visit_results.BENCH_METHODS
    ]
    return {
        "format": gpu_visit_results.FORMAT,
        "mode": "rehearsal",
        "device": {"name": "CPU loopback device", "torch": "2.11.0", "cuda": None},
        "steps": [
            {"name": n, "status": "ok", "seconds": 1, "limit_s": 60}
            for n in gpu_visit_results.STEPS
        ],
        "tests": {
            "ctest": {"passed": 0, "failed": 0, "skipped": 6},
            "pytest": {"passed": 0, "failed": 0, "skipped": 8},
        },
        "probe": {
            "profile": {"name": "probed-cpu", "flops_per_s": 1e10, "memory_bytes_per_s": 1e10},
            "kernels": {
                "sm_count": None,
                "matmul": {},
                "memory": {},
                "attention": {},
                "permille": {},
            },
        },
        "validate": {
            "profile": "profile.json",
            "steps": 2,
            "models": {m: {"policies": copy.deepcopy(policies)} for m in gpu_visit_results.MODELS},
        },
        "bench": {"model": "llama-1b", "parameters": 1, "timed_steps": 1, "rows": rows},
    }


def test_complete_results_pass():
    assert gpu_visit_results.check_results(complete_results()) == []


def test_a_step_out_of_order_or_failed_is_named():
    results = complete_results()
    steps = results["steps"]
    steps[5], steps[6] = steps[6], steps[5]
    assert any("steps ran as" in p for p in gpu_visit_results.check_results(results))
    results = complete_results()
    results["steps"][2]["status"] = "timeout"
    assert gpu_visit_results.check_results(results) == ["step build: timeout"]


def test_a_missing_field_is_named():
    results = complete_results()
    del results["validate"]["models"]["llama-1b"]["policies"]["auto"]["measured"][
        "peak_reserved_bytes"
    ]
    assert gpu_visit_results.check_results(results) == [
        "validate llama-1b auto: no measured peak_reserved_bytes"
    ]
    results = complete_results()
    del results["validate"]["models"]["mixtral-tiny"]["policies"]["trl"]
    assert gpu_visit_results.check_results(results) == ["validate mixtral-tiny trl: missing"]


def test_a_visit_needs_measured_peaks():
    """The loopback device's null peaks pass a rehearsal, not a visit."""
    problems = gpu_visit_results.check_results(complete_results(), rehearse=False)
    assert "validate gpt2-medium none: measured peak_allocated_bytes is empty" in problems


def test_a_missing_benchmark_row_or_failed_test_is_named():
    results = complete_results()
    results["bench"]["rows"] = [r for r in results["bench"]["rows"] if r["method"] != "ferry"]
    assert gpu_visit_results.check_results(results) == [
        "bench seq 16 ferry: missing",
        "bench seq 32 ferry: missing",
    ]
    results = complete_results()
    results["tests"]["pytest"]["failed"] = 1
    assert gpu_visit_results.check_results(results) == ["tests pytest: 1 failed"]


def test_markdown_has_a_row_per_model_policy_and_figure():
    text = gpu_visit_results.markdown(complete_results())
    rows = [line for line in text.splitlines() if line.startswith("| gpt2-medium | auto |")]
    assert [r.split(" | ")[2] for r in rows] == ["allocated", "reserved", "step time"]
    assert "| 16 | ferry | 10.0 | – | – |" in text


@pytest.mark.skipif(
    shutil.which("ninja") is None or shutil.which("cc") is None, reason="needs ninja and cc"
)
def test_check_build_catches_a_system_header(tmp_path):
    """A build whose object read a header of the system's copy fails the check; the same build
    reading the prefix's copy passes it."""
    system, prefix, build = tmp_path / "system", tmp_path / "prefix", tmp_path / "build"
    for d in (system, prefix, build):
        d.mkdir()
    (system / "pkg.h").write_text("int f(void);\n")
    (prefix / "pkg.h").write_text("int f(void);\n")
    (tmp_path / "main.c").write_text('#include "pkg.h"\nint main(void) { return 0; }\n')
    listed = tmp_path / "system-files.txt"
    listed.write_text(f"{system / 'pkg.h'}\n")

    def build_with(include):
        (build / "build.ninja").write_text(
            "rule cc\n  command = cc -MD -MF $out.d -I" + str(include) + " -c $in -o $out\n"
            "  deps = gcc\n  depfile = $out.d\n"
            "rule link\n  command = cc $in -o $out\n"
            f"build main.o: cc {tmp_path / 'main.c'}\n"
            "build sim/ferry: link main.o\n"
        )
        subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
        return gpu_visit_results.check_build(str(build), str(prefix), str(listed))

    problems, _ = build_with(system)
    assert problems == [
        f"build read the system's {system / 'pkg.h'}",
        "no header was read from the private prefix",
    ]
    problems, evidence = build_with(prefix)
    assert problems == []
    assert "headers read from the private prefix: 1" in evidence


def test_assemble_reads_the_parts(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "parts").mkdir(parents=True)
    out.mkdir()
    (work / "steps.tsv").write_text("unpack\tok\t1\t60\nconfigure\tfailed\t3\t180\n")
    (work / "parts" / "profile.json").write_text(json.dumps({"name": "probed-cpu"}))
    assert gpu_visit.main(["assemble", "--work", str(work), "--out", str(out), "--rehearse"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["steps"][1] == {
        "name": "configure",
        "status": "failed",
        "seconds": 3,
        "limit_s": 180,
    }
    assert results["probe"]["profile"] == {"name": "probed-cpu"}
    assert results["validate"] is None and results["bench"] is None
    assert (out / "device-profile.json").is_file()
    assert "| configure | failed | 3 | 180 |" in (out / "results.md").read_text()


def test_visit_models_refuse_an_unknown_scale():
    from ferry.examples._visit import VISIT_MODELS

    with pytest.raises(ValueError, match="scale must be one of"):
        VISIT_MODELS["llama-1b"]("tiny")


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--bogus"], "unknown option --bogus"),
        (["run", "--jobs", "0"], "--jobs and --budget take positive integers"),
        (["run", "--reuse-build", "/nonexistent"], "--reuse-build /nonexistent: no CMakeCache"),
    ],
)
def test_gpu_sh_refuses_bad_options(args, message):
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu.sh"), *args], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert message in done.stderr


def test_gpu_sh_without_a_verb_prints_its_usage():
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu.sh")], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "scripts/gpu.sh pack" in done.stderr and "--rehearse" in done.stderr
