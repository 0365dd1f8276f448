"""Traces a PyTorch model into a ``ferry.model/1`` document (see docs/trace.md).

One forward and one backward run under ``FakeTensorMode``: every tensor has its shape, dtype and
storage but no memory, so a model of billions of parameters traces on a small host. A dispatch
mode records each aten op; a ``saved_tensors_hooks`` pack hook records each tensor autograd saves,
where it saves it. Which op a saved tensor belongs to is read back from the autograd graph: the
node an op created unpacks the tensors it saved (Note [Which op saved a tensor]).

``_record`` records the step, ``_document`` writes the document (``TracedModel``). The package is
free of ``ferry._C``: tracing needs torch only.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .._modules import head_of
from .._tensor_parallel import is_dtensor, whole_model
from ._compiled import is_normalization
from ._costs import moves_data, storage_key
from ._document import TracedModel, traced_model
from ._record import Tracer, TraceRecorder, byte_count, layer_of
from ._values import Routing, Values

__all__ = ["trace", "TracedModel", "Routing", "layer_of", "loss_of"]


def loss_of(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """The loss of a model's output: ``loss_fn(output)``, else the output itself when it is a
    tensor, its ``.loss`` or its first element. Raises TypeError or ValueError when that is no
    scalar tensor that requires grad."""
    if loss_fn is not None:
        loss = loss_fn(out)
        where = "loss_fn(output)"
    elif isinstance(out, torch.Tensor):
        loss, where = out, "the model's output"
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss, where = out.loss, "the model's output .loss"
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss, where = out[0], "the model's output [0]"
    else:
        raise TypeError(
            f"ferry.trace: cannot find the loss in the model's output ({type(out).__name__}); "
            "pass loss_fn=, a function of the output that returns a scalar tensor"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"ferry.trace: {where} is not a scalar tensor (got {shape}); pass loss_fn= to reduce "
            "it to the loss"
        )
    if not loss.requires_grad:
        raise ValueError(f"ferry.trace: {where} does not require grad: nothing to trace backward")
    return loss


def _fake(fake_mode: Any, t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor of ``t``'s shape, dtype and requires_grad (meta tensors included; a
    DTensor at its global shape, as the model before ``parallelize_module`` holds it)."""
    if is_dtensor(t):
        with fake_mode:
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        return out.requires_grad_(t.requires_grad)
    if isinstance(t, torch.Tensor) and t.device.type == "meta":
        with fake_mode:
            out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return out.requires_grad_(t.requires_grad)
    return fake_mode.from_tensor(t)


def _module_hooks(model: torch.nn.Module, tracer: Tracer) -> list[Any]:
    # The output head the offloader keeps on the device (``ferry.offload_model``'s search).
    head = head_of(model)
    handles = []
    for path, module in model.named_modules():  # a shared module under its first name
        is_head = module is head
        is_norm = is_normalization(module)

        def enter(module, args, path=path, is_head=is_head, is_norm=is_norm):
            tracer.modules.append(path)
            tracer.heads += is_head
            tracer.norm_calls.append(tracer.norm_call_count if is_norm else None)
            tracer.norm_call_count += is_norm

        def leave(module, args, output, is_head=is_head):
            tracer.modules.pop()
            tracer.heads -= is_head
            tracer.norm_calls.pop()

        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    return handles


# Note [The optimizer step as the device runs it]
# A torch optimizer whose `foreach` and `fused` are both left None picks its implementation by
# the parameters' device (torch.optim.optimizer `_default_to_fused_or_foreach`): the foreach
# kernels on an accelerator, a loop over the parameters on the CPU. The trace's parameters are
# CPU fakes, so for a device scenario the copy that steps takes foreach, as the device would
# (not where the step is differentiable, or where torch declines foreach: a tensor `lr` without
# `capturable`). Foreach costs memory: `_multi_tensor_adam` makes `exp_avg_sq_sqrt`, one tensor
# per parameter of the group, all alive at once (the documented "~ sizeof(params) more peak
# memory" of torch.optim.AdamW); the loop makes them for one parameter at a time, the fused
# kernel none. So the copy steps twice: the first makes the state, the second, a step as every later
# one is, is measured (`_StepMeter`): the bytes its kernels read and write, and the storages it
# makes that are alive together at its peak.


class _StepMeter(TorchDispatchMode):
    """Counts what one optimizer step's kernels move, and the storages it makes that are alive
    together at its peak (their bytes, in the order they were made)."""

    def __init__(self) -> None:
        super().__init__()
        self.traffic = 0
        self.peak: list[int] = []
        self._made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if moves_data(func, args, kwargs, out):
            self.traffic += _step_traffic(func, args, kwargs, out)
        inputs = {storage_key(t) for t in _tensors((args, kwargs))}
        for o in _tensors(out):
            if storage_key(o) not in inputs:
                storage = o.untyped_storage()
                self._made.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        self._made = {k: v for k, v in self._made.items() if not v[0].expired()}
        live = sum(nbytes for _, nbytes in self._made.values())
        if live > sum(self.peak):
            self.peak = [nbytes for _, nbytes in self._made.values()]
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(byte_count(t) for t in {id(t): t for t in tensors}.values())


def _step_traffic(func, args, kwargs, out) -> int:
    """Bytes a kernel of the step moves: every tensor it reads, every argument its schema marks
    written, and every new tensor it returns."""
    inputs = _tensors((args, kwargs))
    written = []
    for argument, value in zip(func._schema.arguments, args):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written += _tensors(value)
    keys = {storage_key(t) for t in inputs}
    fresh = [o for o in _tensors(out) if storage_key(o) not in keys]
    return _distinct_bytes(inputs) + _distinct_bytes(written) + _distinct_bytes(fresh)


def _on_device(group: dict[str, Any]) -> dict[str, Any]:
    """The group as an accelerator's step would run it (Note [The optimizer step as the device
    runs it])."""
    if "foreach" not in group or group["foreach"] is not None or group.get("fused"):
        return group
    if group.get("differentiable", False):
        return group
    if isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable", False):
        return group
    return {**group, "foreach": True}


def _optimizer_state(
    optimizer: torch.optim.Optimizer, fake_of: dict[int, torch.Tensor], on_device: bool
) -> tuple[Any, dict[str, Any]]:
    """The optimizer's state tensors after a step over the fake parameters, by parameter, and
    what a step costs: ``{"bytes": moved, "temporaries": [bytes of each tensor alive at the
    peak]}``."""
    groups = []
    for group in optimizer.param_groups:
        params = [fake_of[id(p)] for p in group["params"] if id(p) in fake_of]
        group = {**group, "params": params}
        groups.append(_on_device(group) if on_device else group)
    # A shallow copy with its own groups and an empty state: the user's optimizer keeps its own.
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.param_groups = groups
    twin.state = collections.defaultdict(dict)
    twin.step()
    meter = _StepMeter()
    with meter:
        twin.step()
    return twin.state, {"bytes": meter.traffic, "temporaries": meter.peak}


# Note [Dropout as the device runs it]
# `F.dropout` decides by device: on an accelerator, for 0 < p < 1 out of place, it runs the fused
# `native_dropout`, which saves a one-byte mask; on the CPU it multiplies by a noise tensor it
# saves in the input's dtype (two bytes an element in bf16). The trace runs on CPU tensors, so
# for a device scenario `F.dropout` is swapped, for the trace only, for the device's choice.


@contextlib.contextmanager
def _device_dropout() -> Iterator[None]:
    functional = torch.nn.functional
    host = functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace and input.numel() > 0:
            return torch.native_dropout(input, p, True)[0]
        return host(input, p, training, inplace)

    functional.dropout = dropout
    try:
        yield
    finally:
        functional.dropout = host


# Note [Attention as the device runs it]
# `F.scaled_dot_product_attention` picks its kernel by device. When the values' head size differs
# from the queries' (DeepSeek-V3's latent attention: 192 against 128), neither flash kernel runs
# it: the CPU falls back to the math path, which saves the whole attention matrix (2 GiB a layer
# for DeepSeek-V3 16B at 2 x 4096 tokens), while a CUDA device runs the memory-efficient kernel
# (torch's sdp_utils: flash needs equal head sizes, the efficient kernel does not), which saves
# its output and log-sum-exp. The CPU takes the math path too under dropout, or over a mask that
# needs a gradient (T5's learned position bias), where a CUDA device runs flash (no mask: flash
# keeps dropout) or the memory-efficient kernel (a mask, and its gradient). For a device scenario
# such a call runs that kernel, for the trace only; with as many key/value heads as query heads
# (grouped queries take the usual path).


@contextlib.contextmanager
def _device_attention() -> Iterator[None]:
    functional = torch.nn.functional
    host = functional.scaled_dot_product_attention

    def attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        unequal = value.shape[-1] != query.shape[-1]
        mask_grad = attn_mask is not None and torch.is_grad_enabled() and attn_mask.requires_grad
        fused = query.dim() == 4 and key.shape[-3] == query.shape[-3] == value.shape[-3]
        if fused and not unequal and attn_mask is None and dropout_p > 0:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        if fused and (unequal or dropout_p > 0 or mask_grad):
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
            )[0]
        return host(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )

    functional.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = host


# Note [Packed sequences as the device reads them]
# Without an attention mask or a cache (training with `use_cache=False`, as checkpointing and the
# trainers set it), transformers looks for packed sequences in the position ids: it reads whether
# any row restarts its positions, and where none does (one sequence a row) builds no mask, so
# SDPA and flash attention run causal. On fake tensors it cannot read them and assumes packing:
# a sequence-squared mask, turned into a bf16 bias each layer's attention saves, priced as full
# rather than causal attention. Where the trace knows the positions' values (the model made them
# from `arange`, `Values`), the check reads them as the device does; positions it does not know
# (a caller's) keep transformers' answer.


@contextlib.contextmanager
def _device_packed_sequences(values: Values) -> Iterator[None]:
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    host = getattr(masking_utils, "find_packed_sequence_indices", None)
    if host is None:
        yield
        return

    def find(position_ids):
        from torch.utils._python_dispatch import _disable_current_modes

        packed = host(position_ids)
        known = values._value(packed) if isinstance(packed, torch.Tensor) else None
        with _disable_current_modes():
            single = known is not None and bool((known[0][:, -1] == 0).all())
        return None if single else packed

    masking_utils.find_packed_sequence_indices = find
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = host


def allocator_setting(conf: str) -> str | None:
    """The ``"allocator"`` member a scenario traced under ``PYTORCH_CUDA_ALLOC_CONF=conf``
    records (docs/model-format.md): ``"expandable"`` when the configuration turns on
    ``expandable_segments`` (its last ``expandable_segments:True|False`` wins), else None: the
    default allocator, nothing recorded."""
    expandable = False
    for option in conf.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            expandable = value.strip() == "True"
    return "expandable" if expandable else None


def matmul_precision_setting() -> str | None:
    """The ``"matmul_fp32_precision"`` member a scenario traced now records (docs/model-format.md):
    ``"tf32"`` when torch's float32 matmul precision lets cuBLAS use TF32 (``"high"`` or
    ``"medium"``, ``torch.backends.cuda.matmul.fp32_precision = "tf32"``, or the legacy
    ``allow_tf32``), else None: torch's default, full float32, nothing recorded. Read from
    ``torch.backends.cuda.matmul.fp32_precision``, which reflects every way of setting it."""
    return "tf32" if torch.backends.cuda.matmul.fp32_precision == "tf32" else None


def conv_precision_setting() -> str | None:
    """The ``"conv_fp32_precision"`` member a scenario traced now records (docs/model-format.md):
    ``"ieee"`` when torch's cuDNN convolutions may not use TF32
    (``torch.backends.cudnn.conv.fp32_precision`` other than ``"tf32"``, or the legacy
    ``torch.backends.cudnn.allow_tf32 = False``), else None: torch's default, TF32, nothing
    recorded. Read from ``torch.backends.cudnn.conv.fp32_precision``, which resolves an unset
    setting through its parents as cuDNN's convolutions do."""
    return None if torch.backends.cudnn.conv.fp32_precision == "tf32" else "ieee"


def trace(
    model: torch.nn.Module,
    *example_inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    name: str | None = None,
    target: str = "device",
    routing: str | Routing = "balanced",
    compiled: bool = False,
    fused_norms: bool = False,
    **kwargs: Any,
) -> TracedModel:
    """Traces one training step of ``model`` into a ``ferry.model/1`` document (docs/trace.md).

    Runs ``model(*example_inputs, **kwargs)``, the loss (``loss_fn(output)``, else the output
    itself when it is a scalar, its ``.loss`` or its first element) and ``loss.backward()``
    under ``FakeTensorMode``: nothing is allocated, parameters on the meta device are welcome,
    and the model is left untouched (no gradients, no optimizer step). Autocast and dtypes in
    effect around the call are traced as they run. With ``optimizer``, a copy of it steps over
    the fake parameters as the target would run it: its state (Adam's moments, ...) becomes
    static memory, and what its step moves and holds the document's ``optimizer_step`` (Note
    [The optimizer step as the device runs it]).
    ``target`` is where the scenario runs: ``"device"`` (an accelerator: random ops draw from
    the device's generator, dropout is the device's fused kernel, Note [Dropout as the device
    runs it], and so is attention whose values' head size differs from the queries', Note
    [Attention as the device runs it]) or ``"host"`` (the CPU, as the trace itself runs). When
    ``PYTORCH_CUDA_ALLOC_CONF`` turns on ``expandable_segments``, the document records
    ``"allocator": "expandable"``, and ferry's commands simulate that allocator; when torch's
    float32 matmul precision allows TF32 (``torch.set_float32_matmul_precision("high")``), a
    ``"device"`` trace records ``"matmul_fp32_precision": "tf32"``, and float32 matmuls run at
    the profile's TF32 rate; when cuDNN's convolutions may not use TF32 (torch's default lets
    them), it records ``"conv_fp32_precision": "ieee"``. Where the
    model's shapes follow a router's choice (a mixture of experts that gathers each expert's
    tokens), or its grouped matmuls' rows per expert do, the choice is ``routing``'s, and the
    document records it (Note [Routing as a stated assumption] in ``_values``). With
    ``compiled``, each chain of ops torch.compile fuses between two library kernels costs what
    its fused kernel reads and writes; tensors, ops and saved lists stay the eager trace's
    (Note [Costs of a compiled step] in ``_compiled``); with ``fused_norms`` only each call of a
    normalization module does (Note [Fused norms]). A model that ``parallelize_module``
    parallelized is traced as the whole model: its DTensor parameters at their global shapes,
    the hooks its parallel styles registered left out (``ferry plan --tp N`` then cuts it for
    one rank).

    Args:
        model: The model; its parameters may be on the meta device.
        *example_inputs: The positional inputs of one step.
        loss_fn: A function of the model's output that returns the scalar loss.
        optimizer: The optimizer the loop steps: its state becomes static memory, its step the
            document's ``optimizer_step``.
        name: The document's name (default: the model's class name).
        target: ``"device"`` or ``"host"``.
        routing: ``"balanced"``, ``"loads=W0,W1,..."`` or ``"random[,seed=S][,capacity=C]"``
            (``Routing``).
        compiled: Time each chain of fusible ops as one fused kernel.
        fused_norms: Time each call of a normalization module as one fused kernel (a trainer's
            fused RMSNorm or LayerNorm); implied by ``compiled``.
        **kwargs: The keyword inputs of one step.

    Returns:
        The traced model.

    Raises:
        TypeError: ``model`` is no ``torch.nn.Module``, or the loss is not found in the output.
        ValueError: A bad ``target`` or ``routing``, loads for another number of experts
            than a router chooses among, or the loss is no scalar tensor that requires grad.
        RuntimeError: An op needs values that follow from no routing choice.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.autograd.graph import saved_tensors_hooks
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_map

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ferry.trace: model must be a torch.nn.Module, got {type(model).__name__}")
    if target not in ("device", "host"):
        raise ValueError(f'ferry.trace: target must be "device" or "host", got {target!r}')
    routing = Routing(routing)
    tracer = Tracer("device" if target == "device" else "cpu")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    tracer.values = Values(fake_mode, routing)
    fake_of = {}
    state = {}
    for param_name, p in model.named_parameters():
        fake_of[id(p)] = state[param_name] = _fake(fake_mode, p)
        # A frozen parameter is resident and gets no gradient: what the format calls a buffer.
        tracer.declare(state[param_name], param_name, "param" if p.requires_grad else "buffer")
    for buffer_name, b in model.named_buffers():
        state[buffer_name] = _fake(fake_mode, b)
        tracer.declare(state[buffer_name], buffer_name, "buffer")

    def fake_input(prefix):
        counter = iter(range(1 << 30))

        def convert(x):
            if not isinstance(x, torch.Tensor):
                return x
            t = _fake(fake_mode, x)
            k = next(counter)
            tracer.declare(t, prefix if k == 0 else f"{prefix}.{k}", "input")
            return t

        return convert

    args = tuple(tree_map(fake_input(f"input.{i}"), a) for i, a in enumerate(example_inputs))
    kw = {key: tree_map(fake_input(f"input.{key}"), v) for key, v in kwargs.items()}
    handles = _module_hooks(model, tracer)
    try:
        dropout = _device_dropout() if target == "device" else contextlib.nullcontext()
        attention = _device_attention() if target == "device" else contextlib.nullcontext()
        # A model parallelize_module parallelized runs as the whole model, its parameters' fakes
        # at their global shapes.
        whole = whole_model(model)
        # The fake parameters stand in for the model's through backward too: a checkpointed
        # region runs its forward again there.
        packed = _device_packed_sequences(tracer.values)
        with fake_mode, _reparametrize_module(model, state, tie_weights=True), dropout, attention:
            with whole, packed:
                with TraceRecorder(tracer), saved_tensors_hooks(tracer.pack, tracer.unpack):
                    out = model(*args, **kw)
                    loss = loss_of(out, loss_fn)
                tracer.end_forward()
                tracer.phase = "backward"
                with TraceRecorder(tracer):
                    loss.backward()
                tracer.phase = "done"
                optimizer_state, step = {}, None
                if optimizer is not None:
                    optimizer_state, step = _optimizer_state(optimizer, fake_of, target == "device")
    finally:
        for handle in handles:
            handle.remove()
    traced = traced_model(
        tracer, name or type(model).__name__, loss, state, optimizer_state, compiled, fused_norms
    )
    allocator = allocator_setting(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if allocator is not None:
        traced.document["allocator"] = allocator
    precision = matmul_precision_setting() if target == "device" else None
    if precision is not None:
        traced.document["matmul_fp32_precision"] = precision
    precision = conv_precision_setting() if target == "device" else None
    if precision is not None:
        traced.document["conv_fp32_precision"] = precision
    if tracer.values.decided:
        # The shapes follow the assumption: the document says which (docs/model-format.md).
        traced.routing = routing.to_json()
        traced.document["routing"] = traced.routing
    if step is not None:
        traced.document["optimizer_step"] = step
    return traced
