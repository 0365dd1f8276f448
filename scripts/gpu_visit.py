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
* ``assemble``: OUT/results.json and OUT/results.md from the steps so far (run after each;
  scripts/gpu_visit_results.py holds the format, the tables and the checks).
* ``check``: the rehearsal's checks: the steps ran in order and wrote every field, and the
  build took the packed packages from the private prefix alone.

``--scale full`` runs on the current CUDA device; ``--scale rehearse`` on the CPU loopback
device with the models shrunk.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

from gpu_visit_results import (
    BENCH_FIELDS,
    BENCH_METHODS,
    BENCH_SEQS,
    BENCH_TIMED,
    FIGURES,
    MODELS,
    POLICIES,
    STEPS,
    assemble,
    check_build,
    check_results,
    markdown,
    read_json,
    write_json,
)

# The auto plan's budget: this share of the plain step's predicted peak reserved memory, so
# that the plan has to save memory (the planner's floor where that is below it).
AUTO_BUDGET_SHARE = 0.75


def _real_device(scale):
    return "cuda" if scale == "full" else "loopback"


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
    profile = read_json(Path(args.work) / "parts" / "profile.json") or {}
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
    out["sdpa_backend"] = None
    # The GPU's compute capability (a profile's "compute_capability"), from which the simulator
    # takes torch's kernel choices; the SDPA choice below checks it.
    out["compute_capability"] = None
    if cuda:
        major, minor = torch.cuda.get_device_capability(device)
        out["compute_capability"] = f"{major}.{minor}"
        batch, heads, seq, dim = 4, 16, 4096, 128
        flops_fwd = 4 * batch * heads * seq * seq * dim / 2  # causal: half the scores
        # The kernel SDPA picks on this GPU by default (a profile's "sdpa_backend").
        q = torch.randn(batch, heads, seq, dim, device=device, dtype=torch.bfloat16)
        choice = torch._fused_sdp_choice(q, q, q, None, 0.0, True)
        names = {SDPBackend.FLASH_ATTENTION: "flash"}
        if hasattr(SDPBackend, "CUDNN_ATTENTION"):
            names[SDPBackend.CUDNN_ATTENTION] = "cudnn"
        out["sdpa_backend"] = next(
            (name for backend, name in names.items() if int(backend) == choice), str(choice)
        )
        q = None
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
    if out["sdpa_backend"] in ("flash", "cudnn"):
        permille["sdpa_backend"] = out["sdpa_backend"]
    out["permille"] = permille
    write_json(Path(args.work) / "parts" / "kernels.json", out)
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
        "profile": profile and (read_json(profile) or {}).get("name"),
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
        write_json(part, out)
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
            write_json(part, out)
    return status


# --- assemble and check ---------------------------------------------------------------------


def cmd_assemble(args):
    results = assemble(args.work, args.rehearse)
    out = Path(args.out)
    write_json(out / "results.json", results)
    (out / "results.md").write_text(markdown(results), encoding="utf-8")
    profile = Path(args.work) / "parts" / "profile.json"
    if profile.is_file():
        (out / "device-profile.json").write_bytes(profile.read_bytes())
    return 0


def cmd_check(args):
    results = read_json(Path(args.out) / "results.json")
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
