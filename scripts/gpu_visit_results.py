"""What a GPU visit writes (scripts/gpu_visit.py, run by scripts/gpu.sh): the results' format,
assembled from the parts the steps wrote, the results as Markdown tables, and the rehearsal's
checks of a complete run and of a build that took the packed packages alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

FORMAT = "ferry.gpu-visit/1"
# The steps of scripts/gpu.sh, in order (the rehearsal adds its check after them).
STEPS = (
    "unpack",
    "configure",
    "build",
    "gpu-ctest",
    "gpu-pytest",
    "probe",
    "kernels",
    "validate",
    "bench",
)
MODELS = ("gpt2-medium", "llama-1b", "mixtral-tiny")
POLICIES = ("none", "ferry", "trl", "checkpoint", "auto")
FIGURES = ("peak_allocated_bytes", "peak_reserved_bytes", "step_time_ns")
BENCH_METHODS = ("none", "checkpoint", "trl", "ferry")
BENCH_FIELDS = (
    "method",
    "seq",
    "batch",
    "tokens_per_s",
    "step_time_ns",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
)
# The visit's sizes and the rehearsal's: sequence lengths of the benchmark, steps timed.
BENCH_SEQS = {"full": (1024, 2048, 4096), "rehearse": (16, 32)}
BENCH_TIMED = {"full": 3, "rehearse": 1}


def write_json(path, value):
    """Writes JSON to ``path`` through a temporary file, so a step killed mid-write leaves the
    last whole version."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path):
    """The JSON in ``path``; None where it is missing or not whole."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _steps(work):
    rows = []
    path = Path(work) / "steps.tsv"
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            name, status, seconds, limit = line.split("\t")
            rows.append(
                {"name": name, "status": status, "seconds": int(seconds), "limit_s": int(limit)}
            )
    return rows


def _gtest_counts(path):
    doc = read_json(path)
    if doc is None:
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for suite in doc.get("testsuites", []):
        for test in suite.get("testsuite", []):
            if test.get("failures"):
                counts["failed"] += 1
            elif test.get("result") == "SKIPPED":
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    return counts


def _junit_counts(path):
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped}


def assemble(work, rehearse):
    parts = Path(work) / "parts"
    validate = read_json(parts / "validate.json")
    bench = read_json(parts / "bench.json")
    kernels = read_json(parts / "kernels.json")
    device = next((p["device"] for p in (kernels, validate, bench) if p and "device" in p), None)
    return {
        "format": FORMAT,
        "mode": "rehearsal" if rehearse else "visit",
        "device": device,
        "steps": _steps(work),
        "tests": {
            "ctest": _gtest_counts(parts / "gpu-ctest.json"),
            "pytest": _junit_counts(parts / "gpu-pytest.xml"),
        },
        "probe": {"profile": read_json(parts / "profile.json"), "kernels": kernels},
        "validate": validate,
        "bench": bench,
    }


def _bytes(value):
    if value is None:
        return "–"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def _ms(value):
    return "–" if value is None else f"{value / 1e6:.1f} ms"


def _pct(value):
    return "–" if value is None else f"{100 * value:+.1f} %"


def markdown(results):
    """The results as the tables of docs/validate.md, "Where a GPU is lent"."""
    device = results.get("device") or {}
    lines = [
        f"# GPU visit results ({results['mode']})",
        "",
        f"Device: {device.get('name', 'unknown')}; torch {device.get('torch', '?')}, CUDA "
        f"{device.get('cuda') or '–'}.",
        "",
        "| step | status | seconds | limit |",
        "|---|---|---|---|",
    ]
    for s in results["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']} | {s['limit_s']} |")
    for name, counts in results["tests"].items():
        if counts:
            lines.append("")
            lines.append(
                f"gpu tests ({name}): {counts['passed']} passed, {counts['failed']} failed, "
                f"{counts['skipped']} skipped"
            )
    profile = (results["probe"] or {}).get("profile")
    kernels = (results["probe"] or {}).get("kernels")
    if profile:
        lines += [
            "",
            f"Probed profile `{profile.get('name')}`: flops_per_s "
            f"{profile.get('flops_per_s', 0):.3g}, memory_bytes_per_s "
            f"{profile.get('memory_bytes_per_s', 0):.3g}.",
        ]
    if kernels:
        lines += [
            "",
            f"Kernel figures: sm_count {kernels.get('sm_count')}, "
            + ", ".join(f"{k} {v}" for k, v in sorted(kernels.get("permille", {}).items())),
        ]
    validate = results.get("validate")
    if validate:
        lines += [
            "",
            f"### Predicted against measured (profile `{validate.get('profile')}`, "
            f"{validate.get('steps')} steps, the last measured)",
            "",
            "| model | policy | figure | measured | ferry | error | counts |",
            "|---|---|---|---|---|---|---|",
        ]
        names = {
            "peak_allocated_bytes": "allocated",
            "peak_reserved_bytes": "reserved",
            "step_time_ns": "step time",
        }
        for model, row in validate["models"].items():
            if row.get("error"):
                lines.append(f"| {model} | – | failed: {row['error']} | | | | |")
            for policy, r in row["policies"].items():
                exact = {True: "exact", False: "differ", None: "–"}[r.get("counts_exact")]
                for f in FIGURES:
                    show = _ms if f == "step_time_ns" else _bytes
                    lines.append(
                        f"| {model} | {policy} | {names[f]} | {show(r['measured'][f])} | "
                        f"{show(r['predicted'][f])} | {_pct(r['error'][f])} | {exact} |"
                    )
    bench = results.get("bench")
    if bench:
        lines += [
            "",
            f"### Offload benchmark ({bench['model']}, {bench['parameters']:,} parameters, "
            f"median of {bench['timed_steps']} steps)",
            "",
            "| seq | method | tokens/s | peak allocated | peak reserved |",
            "|---|---|---|---|---|",
        ]
        for r in bench["rows"]:
            tokens = r["tokens_per_s"] if r.get("tokens_per_s") is not None else r.get("error")
            lines.append(
                f"| {r['seq']} | {r['method']} | {tokens} | {_bytes(r['peak_allocated_bytes'])} "
                f"| {_bytes(r['peak_reserved_bytes'])} |"
            )
    return "\n".join(lines) + "\n"


# --- check -----------------------------------------------------------------------------------


def check_results(results, rehearse=True):
    """What a complete run wrote: every step, in order, ok; every field of every model and
    policy; every row of the benchmark. Returns the problems found (empty: complete)."""
    problems = []
    names = [s["name"] for s in results.get("steps", [])]
    if names[: len(STEPS)] != list(STEPS):
        problems.append(f"steps ran as {names}, not {list(STEPS)}")
    problems += [
        f"step {s['name']}: {s['status']}" for s in results.get("steps", []) if s["status"] != "ok"
    ]
    for name, counts in (results.get("tests") or {}).items():
        if not counts or counts["passed"] + counts["skipped"] == 0:
            problems.append(f"tests {name}: no test ran")
        elif counts["failed"]:
            problems.append(f"tests {name}: {counts['failed']} failed")
    probe = results.get("probe") or {}
    if not probe.get("profile"):
        problems.append("probe: no profile")
    kernels = probe.get("kernels") or {}
    for key in ("sm_count", "matmul", "memory", "attention", "permille"):
        if key not in kernels:
            problems.append(f"kernels: no {key}")
    models = ((results.get("validate") or {}).get("models")) or {}
    for model in MODELS:
        row = models.get(model)
        if row is None:
            problems.append(f"validate {model}: missing")
            continue
        if row.get("error"):
            problems.append(f"validate {model}: {row['error']}")
        for policy in POLICIES:
            r = row.get("policies", {}).get(policy)
            if r is None:
                problems.append(f"validate {model} {policy}: missing")
                continue
            for side in ("predicted", "measured", "error"):
                for f in FIGURES:
                    if f not in r.get(side, {}):
                        problems.append(f"validate {model} {policy}: no {side} {f}")
            for f in FIGURES:
                if not isinstance(r.get("predicted", {}).get(f), int):
                    problems.append(f"validate {model} {policy}: predicted {f} is no count")
            if not isinstance(r.get("measured", {}).get("step_time_ns"), int):
                problems.append(f"validate {model} {policy}: no measured step time")
            if not rehearse:
                for f in FIGURES:
                    if r.get("measured", {}).get(f) is None:
                        problems.append(f"validate {model} {policy}: measured {f} is empty")
    bench = results.get("bench") or {}
    scale = "rehearse" if rehearse else "full"
    have = {(r.get("seq"), r.get("method")): r for r in bench.get("rows", [])}
    for seq in BENCH_SEQS[scale]:
        for method in BENCH_METHODS:
            r = have.get((seq, method))
            if r is None:
                problems.append(f"bench seq {seq} {method}: missing")
                continue
            for f in BENCH_FIELDS:
                if f not in r:
                    problems.append(f"bench seq {seq} {method}: no {f}")
            if r.get("error"):
                problems.append(f"bench seq {seq} {method}: {r['error']}")
            elif not r.get("tokens_per_s"):
                problems.append(f"bench seq {seq} {method}: no tokens/s")
    return problems


def check_build(build, prefix, system_files):
    """The build took the packed packages from ``prefix`` alone: no file of the system's copies
    among the headers its objects read (ninja's dependency log) or the files its programs link
    (ninja's commands), and the shared libraries of the packages resolved under the prefix
    (ldd). Returns (problems, evidence lines)."""
    system = {line.strip() for line in Path(system_files).read_text().splitlines() if line.strip()}
    problems, evidence = [], []
    deps = subprocess.run(
        ["ninja", "-C", build, "-t", "deps"], capture_output=True, text=True, check=True
    ).stdout
    read = {line.strip() for line in deps.splitlines() if line.startswith("    ")}
    used = sorted(read & system)
    problems += [f"build read the system's {f}" for f in used[:20]]
    from_prefix = sorted(f for f in read if f.startswith(prefix))
    evidence.append(f"headers read from the private prefix: {len(from_prefix)}")
    evidence += [f"  {f}" for f in from_prefix[:8]]
    commands = subprocess.run(
        ["ninja", "-C", build, "-t", "commands"], capture_output=True, text=True, check=True
    ).stdout
    linked = {
        word
        for line in commands.splitlines()
        for word in line.split()
        if word.endswith((".a", ".so")) or ".so." in word
    }
    problems += [f"build links the system's {f}" for f in sorted(linked & system)]
    evidence += [f"links {f}" for f in sorted(w for w in linked if w.startswith(prefix))]
    programs = [
        p
        for p in (
            Path(build) / "tests" / "prop_offloader_state",
            Path(build) / "bench" / "bench_core",
            Path(build) / "sim" / "ferry",
            Path(build) / "tests" / "real" / "gpu_real",
        )
        if p.is_file()
    ]
    for program in programs:
        ldd = subprocess.run(["ldd", str(program)], capture_output=True, text=True).stdout
        for line in ldd.splitlines():
            if "libfmt" in line or "libbenchmark" in line:
                where = line.split("=>")[-1].strip()
                evidence.append(f"{program.name}: {line.strip()}")
                if not where.startswith(prefix):
                    problems.append(f"{program.name} loads {where}, not the prefix's")
    if not programs:
        problems.append("no program was built")
    if not from_prefix:
        problems.append("no header was read from the private prefix")
    return problems, evidence
