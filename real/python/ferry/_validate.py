"""Predictions checked against real runs (docs/validation.md).

A model is trained for a few steps for real under each policy (on the CPU loopback device, or
on a CUDA device with ``real_device="cuda"``), traced with ``ferry.trace``, and the traced model
simulated under the same policies by the simulator in this process (``ferry.simulate``).
``validate`` returns both sides of every policy; ``mismatches`` lists the counts and bytes that
differ where they must be equal.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _C
from ._checkpoint import checkpoint
from ._offload import offload_model
from ._sim import DEFAULT_DEVICE, simulate_with_snapshot
from ._trace import TracedModel, loss_of
from ._trace import trace as ferry_trace
from .compat.hf import enable_gradient_checkpointing

# name -> (offload policy, simulator checkpoint): what `validate` runs by default.
POLICIES = {
    "none": ("none", None),
    "ferry": ("ferry", None),
    "trl": ("trl", None),
    "checkpoint": ("none", "every:1"),
    "ferry+checkpoint": ("ferry", "every:1"),
}

# The scheduler's counters and the bytes, each compared over the last step (the simulator
# reports the last step's, as it does every figure). The counters are the offload telemetry's
# counts (ferry._C.TELEMETRY_COUNTS, which the simulator's `telemetry` reports by the same
# table) but these: the ones not compared, and why.
UNCOMPARED_COUNTERS = {
    "record_stream_fallbacks": "follows the references each backend holds to a reloaded buffer "
    "(the real one: torch's references to its storage)",
    "past_horizon": "a part of `kept`, which is compared",
    "kept_as_is": "the real backend's alone: tensors it cannot copy, which never reach a scheduler",
}
COUNTERS = tuple(name for name in _C.TELEMETRY_COUNTS if name not in UNCOMPARED_COUNTERS)
# Of the telemetry's bytes (ferry._C.TELEMETRY_BYTES): the bytes moved and the host pool's
# peak, which the simulator names otherwise (`d2h_bytes`, `h2d_bytes`, `pinned_peak_bytes`).
BYTES = ("bytes_d2h", "bytes_h2d", "pinned_peak")


class ModelSpecError(ValueError):
    """MODEL names no bundled example and no importable factory, or the factory's result is
    not (model, inputs[, loss_fn])."""


def load(spec):
    """(model, inputs, loss_fn) of a bundled example name or of ``pkg.mod:fn``."""
    from .examples import EXAMPLES

    if spec in EXAMPLES:
        factory, where = EXAMPLES[spec], f"example {spec!r}"
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        if not module_name or not attr:
            raise ModelSpecError(f"MODEL {spec!r}: a factory is written pkg.module:function")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ModelSpecError(f"MODEL {spec!r}: cannot import {module_name}: {e}") from e
        factory = getattr(module, attr, None)
        if not callable(factory):
            raise ModelSpecError(f"MODEL {spec!r}: {module_name} has no function {attr}")
        where = f"factory {spec}"
    else:
        raise ModelSpecError(
            f"MODEL {spec!r} is neither a bundled example ({', '.join(EXAMPLES)}) nor a "
            "factory pkg.module:function"
        )
    made = factory()
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 3):
        raise ModelSpecError(
            f"MODEL {spec!r}: the {where} returned {type(made).__name__}, not "
            "(model, inputs[, loss_fn])"
        )
    model, inputs = made[0], made[1]
    loss_fn = made[2] if len(made) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"MODEL {spec!r}: the {where} returned no torch.nn.Module first")
    return model, inputs, loss_fn


def _call_args(inputs):
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    return tuple(inputs), {}


# Where the real run trains: "loopback" (the CPU loopback device) or "cuda" (the current CUDA
# device, measured with torch.cuda's allocator statistics).
REAL_DEVICES = ("loopback", "cuda")


def _to(inputs, device):
    """``inputs`` (a tensor, a tuple or list of arguments, a dict of keywords) with every tensor
    moved to ``device``; other values as they are."""
    if isinstance(inputs, torch.Tensor):
        return inputs.to(device)
    if isinstance(inputs, dict):
        return {k: _to(v, device) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_to(v, device) for v in inputs)
    return inputs


def train_steps(model, inputs, loss_fn, ctx, steps, real_device="loopback", on_step=None):
    """Trains ``model`` (already on its device) for ``steps`` steps inside ``ctx`` (an offload
    region spanning forward and backward, or None), gradients freed before each step. Returns
    the last step's wall time in ns and, on CUDA, its peak allocated and reserved bytes
    (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` from a reset at the start of
    the last step, the device synchronized around it, less what was live before ``_placed``
    made the model: leftovers of earlier runs are not this run's; None on the loopback device,
    whose host memory has no allocator statistics). ``on_step`` is called before each step."""
    cuda = real_device == "cuda"
    args, kwargs = _call_args(inputs)
    step_ns, peaks = 0, (None, None)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        if on_step is not None:
            on_step()
        if cuda:
            torch.cuda.synchronize()
            if step == steps - 1:
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter_ns()
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = loss_of(model(*args, **kwargs), loss_fn)
            loss.backward()
        del loss
        if cuda:
            torch.cuda.synchronize()
        step_ns = time.perf_counter_ns() - start
    if cuda:
        before = getattr(model, "_ferry_live_before", (0, 0))
        peaks = (
            torch.cuda.max_memory_allocated() - before[0],
            torch.cuda.max_memory_reserved() - before[1],
        )
    return {
        "step_time_ns": step_ns,
        "peak_allocated_bytes": peaks[0],
        "peak_reserved_bytes": peaks[1],
    }


def _placed(model, inputs, real_device):
    """A copy of ``model`` and ``inputs`` on the real run's device. On CUDA unreachable objects
    are collected and the allocator's cached blocks returned first, and the bytes still
    allocated and reserved then (another model, a caller's tensors) recorded on the copy, for
    ``train_steps`` to leave out of the run's peaks."""
    if real_device != "cuda":
        return copy.deepcopy(model), inputs
    gc.collect()
    torch.cuda.empty_cache()
    live = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
    model = copy.deepcopy(model).cuda()  # a model already on the device is copied there
    model._ferry_live_before = live
    return model, _to(inputs, "cuda")


def _layer_list(model):
    """The first ModuleList of ``model``: the layers checkpointing wraps."""
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return module
    raise ModelSpecError(
        f"{type(model).__name__} has no nn.ModuleList of layers to checkpoint every layer of"
    )


def _checkpoint_layers(model):
    """Checkpoints every layer with ``ferry.checkpoint`` (non-reentrant): a Hugging Face
    model its own way (``ferry.enable_gradient_checkpointing``), any other model by wrapping
    the forward of each module of its first ModuleList."""

    def replaying(fn, layer):
        # `fn` called again inside backward is the checkpoint's recomputation of `layer`
        # (Note [Decisions per layer]); the layer's hooks, when validate installed them, count it.
        def replay(*args, **kwargs):
            if torch._C._current_graph_task_id() != -1:
                getattr(layer, "_ferry_replayed", lambda: None)()
            return fn(*args, **kwargs)

        return replay

    if getattr(model, "supports_gradient_checkpointing", False):
        enable_gradient_checkpointing(model)
        # Hugging Face layers checkpoint their forward through their _gradient_checkpointing_func.
        for layer in _layer_list(model):
            through = getattr(layer, "_gradient_checkpointing_func", None)
            if through is not None:
                layer._gradient_checkpointing_func = (
                    lambda fn, *args, _through=through, _layer=layer, **kwargs: _through(
                        replaying(fn, _layer), *args, **kwargs
                    )
                )
        return
    for layer in _layer_list(model):
        # The default binds this layer (a closure would see the loop's last).
        def forward(*args, _replay=replaying(layer.forward, layer), **kwargs):  # noqa: B008
            return checkpoint(_replay, *args, use_reentrant=False, **kwargs)

        layer.forward = forward


def _saved_at_end_of_forward(model, inputs, loss_fn, real_device="loopback"):
    """Bytes of the distinct storages of the saved activations a plain forward holds (the
    parameters' and buffers' own storages left out), the forward run on the real run's
    device."""
    model, inputs = _placed(model, inputs, real_device)
    owned = {t.untyped_storage().data_ptr() for t in model.parameters()}
    owned |= {t.untyped_storage().data_ptr() for t in model.buffers()}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in owned and s.nbytes() > 0:
            storages[s.data_ptr()] = s.nbytes()
        # Detached: a saved output returned as itself would hold its own node, a cycle through
        # autograd's C++ that no collection frees (the forward's activations would stay on the
        # device through every run after it).
        return t.detach()

    args, kwargs = _call_args(inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model(*args, **kwargs), loss_fn)
    del loss
    return sum(storages.values())


# The per-layer decisions compared (Note [Decisions per layer]).
LAYER_COUNTERS = ("packed", "offloaded", "kept", "deduplicated", "recomputed")
# The scheduler's counters among them (the session's telemetry); "recomputed" is counted by the
# layers' own hooks.
_SCHEDULER_LAYER_COUNTERS = LAYER_COUNTERS[:-1]


# Note [Decisions per layer]
# Besides the totals, `validate` compares what the scheduler decided for the saved tensors of
# each layer: packed, offloaded, kept and deduplicated, and how often backward recomputed it
# (the replays of the checkpointed regions the layer starts). The real run snapshots the session's
# counters when each module of the model's first ModuleList (the layers checkpointing wraps)
# starts and ends its forward, and charges the difference to that layer, by its index in the
# list; whatever is left is the rest of the model (-1). The simulator charges each pack to the
# layer of the op that packs it (`ferry simulate --json`, `result.layers`), which is the first
# integer of the traced op's module path: the same index. A checkpointed layer's inputs are
# packed when its call starts on both sides; recomputation packs into the checkpoint, not the
# scheduler, and counts on neither. A call of a layer inside backward
# (torch._C._current_graph_task_id() is not -1) is a recomputation: the checkpoint's replay of
# the layer's forward; the simulator counts its region replays by the layer of the region's
# first op. Layers are compared where the totals agree (a difference in the totals is named by
# them).


def _layer_counts(model, ctx):
    """Hooks on each layer that charge the session's counter increments to it; returns the
    dict they fill (layer index -> counters) and a function that removes the hooks."""
    counts = {}
    open_at = {}
    handles = []

    def snapshot():
        t = ctx.telemetry()
        return {name: t[name] for name in _SCHEDULER_LAYER_COUNTERS}

    def row_of(index):
        return counts.setdefault(index, dict.fromkeys(LAYER_COUNTERS, 0))

    for index, layer in enumerate(_layer_list(model)):

        def enter(module, args, index=index):
            if torch._C._current_graph_task_id() != -1:
                row_of(index)["recomputed"] += 1
            open_at.setdefault(index, []).append(snapshot())

        def leave(module, args, output, index=index):
            start, now = open_at[index].pop(), snapshot()
            row = row_of(index)
            for name in _SCHEDULER_LAYER_COUNTERS:
                row[name] += now[name] - start[name]

        # A layer checkpointed by wrapping its forward (_checkpoint_layers) is replayed without
        # its module hooks: the wrapper reports each replay.
        layer._ferry_replayed = lambda index=index: row_of(index).__setitem__(
            "recomputed", row_of(index)["recomputed"] + 1
        )

        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave, always_call=True))

    def remove():
        for h in handles:
            h.remove()
        for layer in _layer_list(model):
            layer.__dict__.pop("_ferry_replayed", None)

    return counts, remove


def run_real(
    model, inputs, loss_fn, policy, checkpoint, steps, horizon=None, real_device="loopback"
):
    """Trains a copy of ``model`` for ``steps`` steps under ``policy`` on ``real_device`` (the
    CPU loopback device, or CUDA); the offload context spans forward and backward, as the
    simulator's step does. ``horizon``: the ferry policy's offload horizon in bytes (None:
    none). Returns the counters and bytes of the last step, its time and peak memory
    (``train_steps``), and its counters per layer."""
    model, inputs = _placed(model, inputs, real_device)
    if checkpoint:
        _checkpoint_layers(model)
    options = {} if horizon is None else {"horizon_bytes": horizon}
    ctx = offload_model(
        model, policy=policy, loopback=real_device == "loopback", warn_if_no_head=False, **options
    )
    per_layer, unhook = _layer_counts(model, ctx)
    before = ctx.telemetry()

    def on_step():
        nonlocal before
        before = ctx.telemetry()
        per_layer.clear()  # the last step's, as the simulator counts them

    measured = train_steps(model, inputs, loss_fn, ctx, steps, real_device, on_step)
    after = ctx.telemetry()
    unhook()
    if ctx.tracked() != 0:
        raise RuntimeError(
            f"ferry validate: {ctx.tracked()} saved tensors still tracked after "
            f"the last step under {policy}"
        )
    out = {name: after[name] - before[name] for name in COUNTERS}
    out["bytes_d2h"] = after["bytes_d2h"] - before["bytes_d2h"]
    out["bytes_h2d"] = after["bytes_h2d"] - before["bytes_h2d"]
    out["pinned_peak"] = after["pinned_peak"]
    out.update(measured)
    rest = {
        name: after[name] - before[name] - sum(c[name] for c in per_layer.values())
        for name in _SCHEDULER_LAYER_COUNTERS
    }
    rest["recomputed"] = 0  # only the layers are checkpointed (_checkpoint_layers)
    out["layers"] = {**per_layer, -1: rest}
    return out


def _simulated(traced, policy, checkpoint, steps, device, horizon, memory_snapshot=False):
    """The simulator's run of the traced model, in this process: (``ferry simulate --json``'s
    ``result``, the memory snapshot pickle or None)."""
    options = {"policy": policy, "steps": steps, "horizon": str(horizon)}
    if checkpoint:
        options["checkpoint"] = checkpoint
    try:
        document, pickle = simulate_with_snapshot(
            traced, device or DEFAULT_DEVICE, memory_snapshot, **options
        )
    except ValueError as e:
        raise RuntimeError(f"ferry validate: the simulator refused {options}: {e}") from None
    return document["result"], pickle


def simulated_saved_peak(traced, device=None):
    """The most bytes of saved activation storages the simulator holds at once, in one step
    without offload: read from its memory history (``--memory-snapshot``), each allocation of a
    storage a saved activation or input lives in counted with the document's bytes (the
    allocator's rounding left out)."""
    import pickle

    document = traced.document
    tensors = {t["name"]: t for t in document["tensors"]}
    saved = set()
    for op in document["ops"]:
        for name in op["saved"]:
            t = tensors[name]
            if t["role"] in ("activation", "input"):
                saved.add(t.get("view_of", name))
    _, snapshot = _simulated(traced, "none", None, 1, device, "auto", memory_snapshot=True)
    events = pickle.loads(snapshot)["device_traces"][0]
    live, peak, at = 0, 0, {}
    for event in events:
        name = event["frames"][0]["name"] if event["frames"] else None
        if name not in saved:
            continue
        if event["action"] == "alloc":
            at[event["addr"]] = name
            live += tensors[name]["bytes"]
        elif event["action"] == "free_requested" and at.get(event["addr"]) == name:
            del at[event["addr"]]
            live -= tensors[name]["bytes"]
        peak = max(peak, live)
    return peak


def simulated_figures(traced, policy, checkpoint, steps, device=None, horizon="none"):
    """The figures of the simulator's run of the traced model (``ferry.simulate``) that
    ``validate`` sets beside the real run's: the counters and bytes of the last step, its time,
    peaks and horizon, and the decisions per layer. ``horizon``: ``none``, ``auto`` or a byte
    count (Note [Offload horizon in validate])."""
    result, _ = _simulated(traced, policy, checkpoint, steps, device, horizon)
    out = {name: result["telemetry"][name] for name in COUNTERS}
    out["bytes_d2h"] = result["d2h_bytes"]
    out["bytes_h2d"] = result["h2d_bytes"]
    out["pinned_peak"] = result["pinned_peak_bytes"]
    out["step_time_ns"] = result["step_time_ns"]
    out["peak_allocated_bytes"] = result["peak_allocated_bytes"]
    out["peak_reserved_bytes"] = result["peak_reserved_bytes"]
    out["horizon_bytes"] = result.get("horizon_bytes")  # None: no horizon
    out["layers"] = {
        row["layer"]: {name: row[name] for name in LAYER_COUNTERS}
        for row in result.get("layers", [])
    }
    return out


# Note [Offload horizon in validate]
# The simulator's ferry rows offload only up to the horizon it derives from the device profile
# (docs/offload.md, "The offload horizon"); the real run makes the same decisions when it is
# given the same number. Validate simulates each policy with the derived horizon
# (`--horizon auto`) and runs the real side with the `horizon_bytes` the simulation reports
# (None for the policies without one), so both sides are what `ferry compare`'s rows and
# `ferry.offload(horizon_bytes=...)` do. The horizon counts storage bytes in pack order, so the
# two sides agree layer by layer only where they pack the same storages in the same order: they
# do on the bundled GPT, GPT-2 and the Hugging Face Llama (tests/python/test_validate_layers.py).


def validate(
    spec_or_model: str | torch.nn.Module,
    inputs: Any = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    *,
    policies: Iterable[str] | None = None,
    steps: int = 2,
    device: str | None = None,
    keep: str | os.PathLike[str] | None = None,
    trace: Callable[..., TracedModel] | None = None,
    horizon: str = "auto",
    real_device: str = "loopback",
) -> dict[str, Any]:
    """Real and simulated runs of a model under each policy (docs/validation.md).

    The model is trained for ``steps`` steps for real under each policy on the CPU loopback
    device, traced, and the trace simulated under the same policies (``ferry.simulate``, in this
    process).

    Args:
        spec_or_model: A bundled example name or a factory ``pkg.mod:fn``, or a model.
        inputs: With a model: its inputs (a tensor, a tuple of positional arguments or a dict
            of keywords).
        loss_fn: With a model: a function of its output that returns the loss.
        policies: Names of ``POLICIES`` (default: all).
        steps: Training steps per policy.
        device: The simulator's device profile (name or file).
        keep: A path to write the traced document to.
        trace: Replaces ``ferry.trace`` (a function of the same arguments; tests plant
            mismatches with it).
        horizon: ``"auto"`` (the horizon the simulator derives, given to the real run too) or
            ``"none"`` (neither side has one; Note [Offload horizon in validate]).
        real_device: ``"loopback"`` (the CPU loopback device; the model is traced as the host
            runs it) or ``"cuda"`` (the current CUDA device, where peak allocated and reserved
            memory are measured; the model is traced as the device runs it).

    Returns:
        ``model``, ``steps``, ``saved_at_end_of_forward`` (real, traced and simulated),
        ``head_saves_per_step`` (Note [Saves in a no-offload region]) and ``policies``, each
        with ``real``, ``simulated`` (as the simulator reports it) and ``mismatches``.

    Raises:
        ModelSpecError: ``spec_or_model`` names no example or factory, or the factory's
            result is not ``(model, inputs[, loss_fn])``.
        TypeError: Neither a name nor a model with its inputs.
        ValueError: An unknown policy, fewer than one step or a bad ``horizon``.
        RuntimeError: The simulator failed, or saved tensors stayed tracked.
    """
    if isinstance(spec_or_model, str):
        name = spec_or_model
        model, inputs, loss_fn = load(spec_or_model)
    elif isinstance(spec_or_model, torch.nn.Module) and inputs is not None:
        model, name = spec_or_model, type(spec_or_model).__name__
    else:
        raise TypeError("ferry validate: give a MODEL name, or a torch.nn.Module with its inputs")
    policies = list(POLICIES) if policies is None else list(policies)
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(
                f"ferry validate: unknown policy {policy!r} (policies: {', '.join(POLICIES)})"
            )
    if steps < 1:
        raise ValueError(f"ferry validate: steps must be at least 1 (got {steps})")
    if horizon not in ("auto", "none"):
        raise ValueError(f"ferry validate: horizon must be 'auto' or 'none' (got {horizon!r})")
    if real_device not in REAL_DEVICES:
        raise ValueError(
            f"ferry validate: real_device must be one of {', '.join(REAL_DEVICES)} "
            f"(got {real_device!r})"
        )
    if real_device == "cuda" and not torch.cuda.is_available():
        raise ValueError("ferry validate: real_device 'cuda': torch sees no CUDA device")
    args, kwargs = _call_args(inputs)
    target = "host" if real_device == "loopback" else "device"
    traced = (trace or ferry_trace)(model, *args, loss_fn=loss_fn, target=target, **kwargs)
    document = traced.document
    report = {"model": name, "steps": steps, "real_device": real_device, "policies": {}}
    if keep is not None:
        traced.save(keep)
    report["saved_at_end_of_forward"] = {
        "real": _saved_at_end_of_forward(model, inputs, loss_fn, real_device),
        "traced": traced.saved_bytes(roles=("activation", "input")),
        "simulated": simulated_saved_peak(traced, device),
    }
    head_saves = _head_saves(document)
    report["head_saves_per_step"] = head_saves
    for policy in policies:
        offload_policy, checkpoint = POLICIES[policy]
        # See Note [Offload horizon in validate].
        sim = simulated_figures(
            traced, offload_policy, checkpoint, steps, device=device, horizon=horizon
        )
        real = run_real(
            model,
            inputs,
            loss_fn,
            offload_policy,
            checkpoint,
            steps,
            horizon=sim["horizon_bytes"],
            real_device=real_device,
        )
        report["policies"][policy] = {
            "real": real,
            "simulated": sim,
            "mismatches": mismatches(real, sim, head_saves, offload_policy),
        }
    return report


def _head_saves(document):
    """Saved tensors of the ops in the output head's no-offload region, per step. The real
    backend's no-offload region keeps them from the scheduler; the simulator packs them and
    keeps them (Note [Saves in a no-offload region])."""
    return sum(len(op["saved"]) for op in document["ops"] if op.get("no_offload"))


# Note [Saves in a no-offload region]
# Under `ferry.no_offload` (the output head of `offload_model`) the real backend's pack hook
# does not hand a saved tensor to the session at all, so the scheduler never counts it; the
# simulator hands it to the offloader marked "in a no-offload region", which counts it as
# packed and kept. The tensor stays on the device either way: only the counting differs, and
# by exactly the head's saves per step, which the comparison takes off the simulated side.


def mismatches(real, sim, head_packs, policy="ferry"):
    """The counts and bytes that differ, as "name: real R, simulated S" strings. The host
    pool's peak is ferry's alone: the real backend counts no pool under trl (its host copies
    are not pooled), while the simulator reports the pinned memory trl allocates."""
    out = []
    for name in COUNTERS + BYTES:
        if name == "pinned_peak" and policy != "ferry":
            continue
        expected = sim[name]
        if name in ("packed", "kept"):
            expected -= head_packs
        if real[name] != expected:
            out.append(f"{name}: real {real[name]}, simulated {expected}")
    # Note [Decisions per layer]; the head's saves are the rest of the model's (-1). Where the
    # totals differ, they say it; where they agree, a difference between layers is named.
    real_layers, sim_layers = real.get("layers"), sim.get("layers")
    if out or real_layers is None or sim_layers is None:
        return out
    zero = dict.fromkeys(LAYER_COUNTERS, 0)
    for layer in sorted(set(real_layers) | set(sim_layers)):
        r, s = real_layers.get(layer, zero), sim_layers.get(layer, zero)
        for name in LAYER_COUNTERS:
            expected = s[name] - (head_packs if layer == -1 and name in ("packed", "kept") else 0)
            if r[name] != expected:
                out.append(f"layer {layer}: {name}: real {r[name]}, simulated {expected}")
    return out
