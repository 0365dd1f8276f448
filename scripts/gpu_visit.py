"""The Python steps of a GPU visit, run by scripts/gpu.sh (docs/validate.md, "Where a GPU is
lent"), each writing its part under WORK/parts as it goes:

* ``kernels``: what the device's kernels reach (SM count; a large matrix product's, the flash
  and cuDNN attention kernels' and a streaming copy's rates, each also as a share of the
  probed profile's peak).
* ``validate``: ``ferry.validate`` of the three visit models (``ferry.examples._visit``) under
  none, ferry, trl and checkpoint, and a ``ferry.auto`` plan: predicted against measured peak
  allocated, peak reserved and step time.
* ``bench``: the offload benchmark: tokens/s and peak memory of the Llama of about 1B under
  torch's checkpoint, TRL's offloader (``policy="trl"``) and ferry's, at several sequence
  lengths, beside the plain step.
* ``assemble``: OUT/results.json and OUT/results.md from the steps so far (run after each).
* ``check``: the rehearsal's checks: the steps ran in order and wrote every field, and the
  build took the packed packages from the private prefix alone.

``--scale full`` runs on the current CUDA device; ``--scale rehearse`` on the CPU loopback
device with the models shrunk.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
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
# The auto plan's budget: this share of the plain step's predicted peak reserved memory, so
# that the plan has to save memory (the planner's floor where that is below it).
AUTO_BUDGET_SHARE = 0.75


def _real_device(scale):
    return "cuda" if scale == "full" else "loopback"


def _write(path, value):
    """Writes JSON to ``path`` through a temporary file, so a step killed mid-write leaves the
    last whole version."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _read(path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _profile(work):
    """The probed profile (the probe step's), else None (the simulator's default)."""
    path = Path(work) / "parts" / "profile.json"
    return str(path) if path.is_file() else None


def _error(predicted, measured):
    if predicted is None or not measured:
        return None
    return round((predicted - measured) / measured, 4)


def _figures(predicted, measured):
    return {
        "predicted": {f: predicted.get(f) for f in FIGURES},
        "measured": {f: measured.get(f) for f in FIGURES},
        "error": {f: _error(predicted.get(f), measured.get(f)) for f in FIGURES},
    }


def _release():
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _device_info(real):
    import torch

    info = {"real_device": real, "torch": torch.__version__, "cuda": torch.version.cuda}
    if real == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, memory_bytes=props.total_memory)
    else:
        info.update(name="CPU loopback device", memory_bytes=None)
    return info


# --- kernels ---------------------------------------------------------------------------------


def _timed(fn, repeats, cuda):
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up."""
    import torch

    fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return sorted(samples)[len(samples) // 2]


def cmd_kernels(args):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    real = _real_device(args.scale)
    cuda = real == "cuda"
    device = "cuda" if cuda else "cpu"
    profile = _read(Path(args.work) / "parts" / "profile.json") or {}
    out = {"device": _device_info(real), "profile": profile.get("name")}
    if cuda:
        out["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        out["sm_count"] = None
    # A large matrix product in bf16 (the CPU's in float32, small).
    n, dtype = (8192, torch.bfloat16) if cuda else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(lambda a=a, b=b: a @ b, 10 if cuda else 3, cuda)
    out["matmul"] = {"shape": [n, n, n], "dtype": str(dtype), "flops_per_s": 2 * n**3 / seconds}
    # A streaming copy: read and write of 1 GiB (the CPU's 64 MiB).
    size = (1 << 30) if cuda else (64 << 20)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _timed(lambda src=src, dst=dst: dst.copy_(src), 10 if cuda else 3, cuda)
    out["memory"] = {"bytes": size, "bytes_per_s": 2 * size / seconds}
    a = b = src = dst = None
    # Attention: the flash and cuDNN kernels of SDPA, forward and backward (the CPU has
    # neither: their figures are None there).
    out["attention"] = {
        name: {"forward_flops_per_s": None, "backward_flops_per_s": None}
        for name in ("flash", "cudnn")
    }
    if cuda:
        batch, heads, seq, dim = 4, 16, 4096, 128
        flops_fwd = 4 * batch * heads * seq * seq * dim / 2  # causal: half the scores
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", None)):
            if backend is None:
                backend = getattr(SDPBackend, "CUDNN_ATTENTION", None)
            q, k, v = (
                torch.randn(
                    batch, heads, seq, dim, device=device, dtype=torch.bfloat16
                ).requires_grad_()
                for _ in range(3)
            )
            try:
                with sdpa_kernel(backend):

                    def forward(q=q, k=k, v=v):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                    fwd = _timed(forward, 5, True)
                    o = forward()
                    grad = torch.randn_like(o)

                    def backward(o=o, q=q, k=k, v=v, grad=grad):
                        return torch.autograd.grad(o, (q, k, v), grad, retain_graph=True)

                    bwd = _timed(backward, 5, True)
                out["attention"][name] = {
                    "forward_flops_per_s": flops_fwd / fwd,
                    "backward_flops_per_s": 2.5 * flops_fwd / bwd,
                }
            except RuntimeError as e:
                out["attention"][name] = {"error": str(e).splitlines()[0]}
    # Each rate as a share of the probed profile's peak, in thousandths (docs/devices.md,
    # "kernels"); the tile of a large GEMM is not measured here.
    flops, memory = profile.get("flops_per_s"), profile.get("memory_bytes_per_s")
    permille = {}
    if flops:
        permille["matmul_permille"] = round(1000 * out["matmul"]["flops_per_s"] / flops)
        for name, figures in out["attention"].items():
            for side in ("forward", "backward"):
                rate = figures.get(f"{side}_flops_per_s")
                if rate:
                    permille[f"{name}_{side}_permille"] = round(1000 * rate / flops)
    if memory:
        permille["memory_permille"] = round(1000 * out["memory"]["bytes_per_s"] / memory)
    out["permille"] = permille
    _write(Path(args.work) / "parts" / "kernels.json", out)
    print(json.dumps(out, indent=2))
    return 0


# --- validate --------------------------------------------------------------------------------


def _auto_row(model, inputs, loss_fn, traced, none_predicted, profile, real, steps):
    """The ``ferry.auto`` plan of the traced model, applied to a real run: its predicted and
    measured figures."""
    import ferry
    from ferry._plan import PlanError
    from ferry._validate import _placed, train_steps

    budget = int(none_predicted["peak_reserved_bytes"] * AUTO_BUDGET_SHARE)
    options = {"device": profile} if profile else {}
    placed, placed_inputs = _placed(model, inputs, real)
    try:
        ctx = ferry.auto(
            placed, budget=budget, traced=traced, loopback=real == "loopback", margin=0, **options
        )
    except PlanError as e:
        if not e.floor:
            raise
        budget = e.floor
        ctx = ferry.auto(
            placed, budget=budget, traced=traced, loopback=real == "loopback", margin=0, **options
        )
    predicted = ctx.plan["predicted"]
    measured = train_steps(placed, placed_inputs, loss_fn, ctx, steps, real)
    row = _figures(predicted, measured)
    row["budget_bytes"] = budget
    row["counts_exact"] = None  # a plan's counts are not compared here
    return row


def cmd_validate(args):
    import ferry
    from ferry._validate import validate
    from ferry.examples._visit import VISIT_MODELS

    real = _real_device(args.scale)
    profile = _profile(args.work)
    part = Path(args.work) / "parts" / "validate.json"
    out = {
        "device": _device_info(real),
        "profile": profile and (_read(profile) or {}).get("name"),
        "steps": args.steps,
        "models": {},
    }
    status = 0
    for name in MODELS:
        start = time.perf_counter()
        row = {"policies": {}}
        out["models"][name] = row
        try:
            model, inputs, loss_fn = VISIT_MODELS[name](args.scale)
            row["parameters"] = sum(p.numel() for p in model.parameters())
            traced = []

            def trace(*a, _traced=traced, **k):
                _traced.append(ferry.trace(*a, **k))
                return _traced[-1]

            report = validate(
                model,
                inputs,
                loss_fn,
                policies=["none", "ferry", "trl", "checkpoint"],
                steps=args.steps,
                device=profile,
                trace=trace,
                real_device=real,
            )
            for policy, r in report["policies"].items():
                row["policies"][policy] = _figures(r["simulated"], r["real"])
                row["policies"][policy]["counts_exact"] = not r["mismatches"]
                row["policies"][policy]["mismatches"] = r["mismatches"][:5]
            row["saved_at_end_of_forward"] = report["saved_at_end_of_forward"]
            _release()
            row["policies"]["auto"] = _auto_row(
                model,
                inputs,
                loss_fn,
                traced[0],
                report["policies"]["none"]["simulated"],
                profile,
                real,
                args.steps,
            )
        except Exception as e:  # one model's failure is recorded; the others still run
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            status = 1
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(f"validate {name}: {row['seconds']} s", flush=True)
        _write(part, out)
        model = inputs = traced = None
        _release()
    return status


# --- bench -----------------------------------------------------------------------------------


def cmd_bench(args):
    import torch

    import ferry
    from ferry._validate import _placed, train_steps
    from ferry.examples._hf import _tokens
    from ferry.examples._visit import llama_1b

    real = _real_device(args.scale)
    part = Path(args.work) / "parts" / "bench.json"
    seqs = BENCH_SEQS[args.scale]
    timed = BENCH_TIMED[args.scale]
    base, _, loss_fn = llama_1b(args.scale, seq=max(seqs))
    batch = 1 if args.scale == "full" else 2
    out = {
        "device": _device_info(real),
        "model": "llama-1b",
        "parameters": sum(p.numel() for p in base.parameters()),
        "timed_steps": timed,
        "rows": [],
    }
    status = 0
    for seq in seqs:
        torch.manual_seed(0)
        inputs = _tokens(base.config.vocab_size, batch, seq)
        for method in BENCH_METHODS:
            row = {"method": method, "seq": seq, "batch": batch}
            try:
                model, placed_inputs = _placed(base, inputs, real)
                ctx = None
                if method == "checkpoint":
                    # torch's own non-reentrant checkpoint around every layer, through the
                    # model's switch (activation_checkpointing_enable from transformers 5.23,
                    # gradient_checkpointing_enable before).
                    kwargs = {"use_reentrant": False}
                    if hasattr(model, "activation_checkpointing_enable"):
                        model.activation_checkpointing_enable(kwargs)
                    else:
                        model.gradient_checkpointing_enable(kwargs)
                elif method in ("trl", "ferry"):
                    ctx = ferry.offload_model(
                        model, policy=method, loopback=real == "loopback", warn_if_no_head=False
                    )
                train_steps(model, placed_inputs, loss_fn, ctx, 1, real)  # warm-up
                times, measured = [], {}
                for _ in range(timed):
                    measured = train_steps(model, placed_inputs, loss_fn, ctx, 1, real)
                    times.append(measured["step_time_ns"])
                step_ns = sorted(times)[len(times) // 2]
                row.update(
                    tokens_per_s=round(batch * seq * 1e9 / step_ns, 1),
                    step_time_ns=step_ns,
                    peak_allocated_bytes=measured["peak_allocated_bytes"],
                    peak_reserved_bytes=measured["peak_reserved_bytes"],
                )
            except Exception as e:  # an out-of-memory row is a result too
                traceback.print_exc()
                row.update(dict.fromkeys(BENCH_FIELDS[3:]))
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                status = 1
            model = ctx = placed_inputs = None
            _release()
            out["rows"].append(row)
            print(f"bench seq {seq} {method}: {row.get('tokens_per_s')} tokens/s", flush=True)
            _write(part, out)
    return status


# --- assemble --------------------------------------------------------------------------------


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
    doc = _read(path)
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
    validate = _read(parts / "validate.json")
    bench = _read(parts / "bench.json")
    kernels = _read(parts / "kernels.json")
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
        "probe": {"profile": _read(parts / "profile.json"), "kernels": kernels},
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


def cmd_assemble(args):
    results = assemble(args.work, args.rehearse)
    out = Path(args.out)
    _write(out / "results.json", results)
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    profile = Path(args.work) / "parts" / "profile.json"
    if profile.is_file():
        (out / "device-profile.json").write_bytes(profile.read_bytes())
    return 0


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


def cmd_check(args):
    results = _read(Path(args.out) / "results.json")
    if results is None:
        print("check: no results.json")
        return 1
    problems = check_results(results, rehearse=True)
    build_problems, evidence = check_build(args.build, args.prefix, args.system_files)
    problems += build_problems
    for line in evidence:
        print(f"check: {line}")
    for p in problems:
        print(f"check: FAILED: {p}")
    if not problems:
        print(
            f"check: ok: {len(STEPS)} steps in order, every field of {len(MODELS)} models × "
            f"{len(POLICIES)} policies and of the benchmark; the build saw the private prefix "
            f"{args.prefix} alone"
        )
    return 1 if problems else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="scripts/gpu_visit.py", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("kernels", "validate", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--work", required=True)
        p.add_argument("--scale", choices=("full", "rehearse"), required=True)
        if name == "validate":
            p.add_argument("--steps", type=int, default=2)
    p = sub.add_parser("assemble")
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rehearse", action="store_true")
    p = sub.add_parser("check")
    for option in ("--work", "--out", "--prefix", "--build", "--system-files"):
        p.add_argument(option, required=True)
    args = parser.parse_args(argv)
    return {
        "kernels": cmd_kernels,
        "validate": cmd_validate,
        "bench": cmd_bench,
        "assemble": cmd_assemble,
        "check": cmd_check,
    }[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
