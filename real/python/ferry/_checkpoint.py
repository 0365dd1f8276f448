"""ferry.checkpoint and ferry.checkpoint_sequential, with torch.utils.checkpoint's interface.

The non-reentrant variant goes through ferry's runtime (checkpoint frames in ``ferry._C``): its
saved tensors are dropped and recomputed, nestable, with early stop, random-state replay, the
forward's autocast state and a determinism check. The reentrant variant is an autograd
Function that runs the forward without grad and recomputes it, whole, in backward.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as _tc
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from . import _C
from ._regions import Region

_DETERMINISM_CHECKS = ("default", "none")


def _no_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def runtime_call(fn: Callable[..., Any], *args: Any) -> Any:
    """Calls into ferry's runtime out of sight of dispatch modes: the host buffers it allocates
    and the state it copies are not ops of the model (a mode naming the model's ops, as
    ``ferry.offload(plan=...)`` does, must not count them). Tensor subclasses still dispatch:
    a jagged nested tensor detached by the runtime must stay one (with torch's Python dispatch
    off it would become a bare nested tensor of no kind torch knows), and the runtime reaches a
    saved DTensor's inner tensors through the subclass's own dispatch (Note [Wrapper
    subclasses] in real/python/src/ferry_ext.cpp), which switching all Python dispatch off
    would skip, handing back a plain tensor."""
    with _disable_current_modes():
        return fn(*args)


_Policy = _tc.CheckpointPolicy
_SAVE = (_Policy.MUST_SAVE, _Policy.PREFER_SAVE)
_OFFLOAD = (_Policy.MUST_CPU_OFFLOAD, _Policy.PREFER_CPU_OFFLOAD)


def _decide(policy_fn, is_recompute, func, args, kwargs):
    policy = policy_fn(
        _tc.SelectiveCheckpointContext(is_recompute=is_recompute), func, *args, **kwargs
    )
    if isinstance(policy, bool):  # the older boolean policies: True saves
        policy = _Policy.MUST_SAVE if policy else _Policy.PREFER_RECOMPUTE
    return policy


def _returns_alias(func):
    """Whether the op's outputs may alias its inputs (views, in-place ops)."""
    if isinstance(func, torch._ops.HigherOrderOperator):
        return False
    return any(ret.alias_info is not None for ret in func._schema.returns)


class _Offloaded:
    """A storage entry whose tensor went through the offload session."""

    __slots__ = ("saved",)

    def __init__(self, saved):
        self.saved = saved

    def get_val(self, allow_cache_entry_mutation):
        return self.saved.take(allow_cache_entry_mutation)


# Note [Selective offload]
# torch's create_selective_checkpoint_contexts returns a pair of dispatch modes: the forward's
# keeps the outputs of the ops its policy saves, the recomputation's hands them back instead of
# running the op. torch 2.11 names a third choice, {MUST,PREFER}_CPU_OFFLOAD, but recomputes
# those ops in eager mode. ferry.checkpoint replaces torch's pair by the pair below, built on
# the same policy function and storage: an op the policy offloads has its output packed by the
# region's offload session (Note [Offloaded outputs] in real/src/regions.cpp) and taken back,
# reloaded, when the recomputation reaches the op. Ops whose outputs alias their inputs (views,
# in-place ops) are saved instead: their outputs share memory that stays on the device anyway.
# Under torch.compile both modes defer to torch's own.


class _SelectiveForward(TorchDispatchMode):
    def __init__(self, torch_mode, session):
        super().__init__()
        self._torch_mode = torch_mode
        self._policy_fn = torch_mode.policy_fn
        self._storage = torch_mode.storage
        self._session = session  # a _C.Session, "no_offload" (save instead) or None

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in _tc.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        if _tc._is_compiling(func, args, kwargs):
            return self._torch_mode.__torch_dispatch__(func, types, args, kwargs)
        policy = _decide(self._policy_fn, False, func, args, kwargs)
        out = func(*args, **kwargs)
        aliases = _returns_alias(func)
        if policy in _OFFLOAD and not aliases and not isinstance(self._session, str):
            if self._session is None:
                raise RuntimeError(
                    f"ferry.checkpoint: the selective checkpoint policy chose {policy.name} for "
                    f"{func}, but the region runs in no offload session: pass "
                    "offload=ferry.offload(...) to ferry.checkpoint, or run it inside "
                    "`with ferry.offload(...)`"
                )
            self._storage[func].append(tree_map(self._offload, out))
        elif policy in _SAVE or policy in _OFFLOAD:
            self._storage[func].append(
                tree_map(lambda x: _tc._VersionWrapper(_tc._maybe_detach(x, aliases)), out)
            )
        return out

    def _offload(self, x):
        if isinstance(x, torch.Tensor):
            return _Offloaded(runtime_call(_C._OffloadedOutput, self._session, x))
        return _tc._VersionWrapper(x)


class _SelectiveRecompute(TorchDispatchMode):
    def __init__(self, torch_mode):
        super().__init__()
        self._torch_mode = torch_mode
        self._policy_fn = torch_mode.policy_fn
        self._storage = torch_mode.storage
        self._allow_mutation = torch_mode.allow_cache_entry_mutation

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func in _tc.SAC_IGNORED_OPS:
            return func(*args, **kwargs)
        if _tc._is_compiling(func, args, kwargs):
            return self._torch_mode.__torch_dispatch__(func, types, args, kwargs)
        policy = _decide(self._policy_fn, True, func, args, kwargs)
        if policy not in _SAVE and policy not in _OFFLOAD:
            return func(*args, **kwargs)
        entries = self._storage.get(func)
        if entries is None:
            raise RuntimeError(
                f"ferry.checkpoint: {func} encountered during backward, but not found in storage "
                "(the selective checkpoint policy saved or offloaded it in the recomputation "
                "only)"
            )
        if not entries:
            raise RuntimeError(
                "ferry.checkpoint: Trying to backward an extra time. You are only allowed to "
                "backward once on any region computed under selective activation checkpoint."
            )
        return tree_map(lambda entry: entry.get_val(self._allow_mutation), entries.pop(0))


def _selective_contexts(forward_context, recompute_context, offload):
    """torch's selective checkpoint contexts, replaced by ferry's (Note [Selective offload]);
    any other contexts as they are."""
    caching = getattr(_tc, "_CachingTorchDispatchMode", None)
    cached = getattr(_tc, "_CachedTorchDispatchMode", None)
    if caching is None or not (
        isinstance(forward_context, caching) and isinstance(recompute_context, cached)
    ):
        return forward_context, recompute_context
    if offload is not None:
        session = offload._session
    else:
        session = _C._enclosing_session()
    return _SelectiveForward(forward_context, session), _SelectiveRecompute(recompute_context)


class _OpLog(TorchDispatchMode):
    """debug=True: the aten ops a region runs, each with the innermost line of user code that
    ran it."""

    def __init__(self, log):
        super().__init__()
        self._log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        where = ""
        for frame in reversed(traceback.extract_stack()[:-1]):
            if not any(part in frame.filename for part in _LIBRARY_PATHS):
                where = f"   {frame.filename}:{frame.lineno} in {frame.name}"
                break
        self._log.append(f"{func}{where}")
        return func(*args, **(kwargs or {}))


_LIBRARY_PATHS = (os.sep + "torch" + os.sep, os.sep + "ferry" + os.sep + "_checkpoint.py")


def _debug_error(error, forward_ops, recompute_ops):
    def listing(ops):
        return "\n".join(f"{i + 1}. {op}" for i, op in enumerate(ops)) or "(none)"

    return RuntimeError(
        f"{error}\n\nferry.checkpoint (debug=True): the forward and the recomputation saved "
        "different tensors. Compare the operations they ran:\n\n"
        f"Operations executed during the original forward:\n\n{listing(forward_ops)}\n\n"
        f"Operations executed during recomputation:\n\n{listing(recompute_ops)}\n"
    )


def _debug_enabled(debug):
    # torch.utils.checkpoint.set_checkpoint_debug_enabled overrides the per-call argument.
    forced = getattr(_tc, "_checkpoint_debug_enabled", None)
    return debug if forced is None else forced


def _global_early_stop(early_stop):
    # torch.utils.checkpoint.set_checkpoint_early_stop overrides the per-call argument.
    forced = getattr(_tc, "_enable_checkpoint_early_stop", None)
    return early_stop if forced is None else forced


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool | None = None,
    context_fn: Callable[
        [], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]
    ] = _no_context,
    determinism_check: str = "default",
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    offload: Region | None = None,
    **kwargs: Any,
) -> Any:
    """Runs ``fn(*args, **kwargs)`` keeping none of its saved tensors; backward recomputes them.

    A drop-in for ``torch.utils.checkpoint.checkpoint``. ``use_reentrant=False`` (recommended):
    nestable, stops recomputing once every saved tensor is back (``early_stop``, or
    ``torch.utils.checkpoint.set_checkpoint_early_stop``), replays with the random state and
    the autocast state the forward saw, checks that the recomputation saves the same tensors
    (``determinism_check``), and takes a ``context_fn`` returning the contexts of the forward
    and of the recomputation (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
    ``use_reentrant=True``: the whole region is recomputed in backward, as torch's reentrant
    variant does. Left out, ``use_reentrant`` warns and is True, as in torch 2.11.
    Under ``torch.no_grad()`` the function just runs.

    Selective checkpointing (``context_fn=functools.partial(create_selective_checkpoint_contexts,
    policy_fn)``) has a third choice per op besides saving and recomputing:
    ``CheckpointPolicy.MUST_CPU_OFFLOAD`` (or ``PREFER_CPU_OFFLOAD``) saves the op's output
    through an offload session, copied to the host in forward and reloaded for the
    recomputation. The session is ``offload`` (a ``ferry.offload``) when given, else that of the
    offload region the call runs in; inside a ``ferry.no_offload`` region such outputs are saved.

    Args:
        fn: The function (or module) to run.
        *args: Its positional arguments.
        use_reentrant: The variant; left out, it warns and is True.
        context_fn: Returns the contexts of the forward and of the recomputation.
        determinism_check: ``"default"`` (compare the saved tensors of the recomputation
            with the forward's) or ``"none"``.
        debug: List the operations both ran when the determinism check fails.
        early_stop: Stop recomputing once every saved tensor is back.
        preserve_rng_state: Replay with the random state the forward saw.
        offload: The offload region (a ``ferry.offload``) whose session takes the outputs a
            selective policy offloads.
        **kwargs: Its keyword arguments (non-reentrant only).

    Returns:
        What ``fn`` returns.

    Raises:
        ValueError: An unknown ``determinism_check``, or an option the reentrant variant does
            not take.
        TypeError: ``offload`` is no ``ferry.offload``.
        RuntimeError: CUDA was initialized inside the region with ``preserve_rng_state``.
    """
    if use_reentrant is None:
        warnings.warn(
            "ferry.checkpoint: the use_reentrant parameter should be passed explicitly; as in "
            "torch.utils.checkpoint it defaults to True. use_reentrant=False is recommended.",
            stacklevel=2,
        )
        use_reentrant = True
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            "ferry.checkpoint: determinism_check should be one of "
            f"{list(_DETERMINISM_CHECKS)}, but got {determinism_check!r}"
        )
    if offload is not None and not hasattr(offload, "_session"):
        raise TypeError(
            f"ferry.checkpoint: offload should be a ferry.offload, got {type(offload).__name__}"
        )
    if use_reentrant:
        if context_fn is not _no_context or debug or offload is not None:
            raise ValueError(
                "ferry.checkpoint: passing `context_fn`, `debug` or `offload` is only supported "
                "when use_reentrant=False"
            )
        if kwargs:
            raise ValueError("ferry.checkpoint: unexpected keyword arguments: " + ",".join(kwargs))
        return _reentrant(fn, preserve_rng_state, *args)
    if torch.compiler.is_compiling():
        # Note [Checkpoints under torch.compile]
        if context_fn is not _no_context:
            kwargs = {"context_fn": context_fn, **kwargs}
        return _tc.checkpoint(
            fn,
            *args,
            use_reentrant=False,
            determinism_check=determinism_check,
            debug=debug,
            early_stop=early_stop,
            preserve_rng_state=preserve_rng_state,
            **kwargs,
        )
    _refuse_forward_ad(args, kwargs)
    debug = _debug_enabled(debug)
    if debug and context_fn is not _no_context:
        raise ValueError(
            "ferry.checkpoint: debug=True is incompatible with a non-default context_fn"
        )
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return _non_reentrant(
        fn,
        args,
        kwargs,
        context_fn,
        determinism_check,
        _global_early_stop(early_stop),
        preserve_rng_state,
        offload,
        debug,
    )


# Note [Checkpoints under torch.compile]
# While dynamo traces a function, a checkpoint must be one that it can trace: torch's
# non-reentrant checkpoint, which it turns into a higher-order op whose forward and
# recomputation AOTAutograd partitions as one graph. ferry's runtime (frames in C++, saved
# tensors packed through its hooks) is opaque to it: the graph breaks around the call and the
# compiled pieces inside save other tensors than the ones the recomputation makes. So under
# compilation ferry.checkpoint is torch's, with the same arguments; the selective policy's
# offload choice then follows torch's rule (torch 2.11 recomputes those ops), and an offload
# region around the compiled function still handles what the graph saves outside it.


def _refuse_forward_ad(args, kwargs):
    """Refuses dual tensors (forward-mode AD) among the inputs, as torch's checkpoint does: its
    non-reentrant variant saves them through an autograd Function without a jvp, which raises
    NotImplementedError before anything is saved."""
    if torch.autograd.forward_ad._current_level < 0:
        return
    for a in list(args) + list(kwargs.values()):
        if (
            isinstance(a, torch.Tensor)
            and torch.autograd.forward_ad.unpack_dual(a).tangent is not None
        ):
            raise NotImplementedError(
                "ferry.checkpoint: forward-mode AD is not supported: an input is a dual tensor "
                "(torch.autograd.forward_ad); torch.utils.checkpoint refuses it too. Run the "
                "function without checkpointing, or compute the JVP with torch.func.jvp outside "
                "the checkpoint"
            )


def _non_reentrant(
    fn, args, kwargs, context_fn, determinism_check, early_stop, preserve, offload=None, debug=False
):
    unpack = _C._unpack
    if debug:
        # The ops of the forward and of the latest recomputation, shown when the determinism
        # check fails on unpacking one of this region's saved tensors.
        forward_ops, recompute_ops = [], []

        def context_fn():
            return _OpLog(forward_ops), _OpLog(recompute_ops)

        def unpack(packed):
            try:
                return _C._unpack(packed)
            except RuntimeError as e:
                if "ferry.checkpoint:" not in str(e) or "Operations executed" in str(e):
                    raise
                raise _debug_error(e, forward_ops, recompute_ops) from e

    forward_context, recompute_context = _selective_contexts(*context_fn(), offload)
    # The tensor inputs go to the runtime, which keeps them for the replay (inside another
    # checkpoint, saved by it) and hands them back; the replay keeps only the rest.
    inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    arg_slots = [None if isinstance(a, torch.Tensor) else a for a in args]
    kwarg_slots = {k: None if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    tensor_args = [isinstance(a, torch.Tensor) for a in args]
    tensor_kwargs = {k: isinstance(v, torch.Tensor) for k, v in kwargs.items()}

    # Under torch.autograd.graph.allow_mutation_on_saved_tensors the inputs are saved through
    # its hooks, as torch.utils.checkpoint saves them: a later in-place change then clones the
    # forward's value for the replay instead of failing the version check.
    kept_by_torch = _allow_mutation_hooks()
    handles = None
    if kept_by_torch is not None:
        handles = [(t, kept_by_torch[0](t)) for t in inputs]

    def replay(saved):
        if debug:
            recompute_ops.clear()
        if handles is not None:
            saved = [_as_replay_input(t, kept_by_torch[1](h)) for t, h in handles]
        saved = iter(saved)  # detached by the runtime, leaves excepted (the same objects)
        replay_args = [next(saved) if is_t else a for a, is_t in zip(arg_slots, tensor_args)]
        replay_kwargs = {k: next(saved) if tensor_kwargs[k] else v for k, v in kwarg_slots.items()}
        with torch.enable_grad(), recompute_context, saved_tensors_hooks(_C._pack, _C._unpack):
            fn(*replay_args, **replay_kwargs)

    # The replay restores the random state of the CUDA devices the forward saw: a forward that
    # first initializes CUDA has no state to restore, which torch refuses too.
    had_cuda = torch.cuda.is_initialized()
    token = runtime_call(
        _C._frame_begin,
        replay,
        inputs,
        early_stop,
        determinism_check == "default",
        preserve,
        handles is None,
    )
    try:
        with forward_context, saved_tensors_hooks(_C._pack, unpack):
            out = fn(*args, **kwargs)
    finally:
        _C._frame_end(token)
    if preserve and not had_cuda and torch.cuda.is_initialized():
        raise RuntimeError(
            "ferry.checkpoint: CUDA state was initialized in the forward pass of a checkpointed "
            "region, which is not allowed with preserve_rng_state=True; initialize CUDA before "
            "the region (e.g. torch.cuda.init()) or pass preserve_rng_state=False"
        )
    return out


def _allow_mutation_hooks():
    """The (pack, unpack) hooks of ``torch.autograd.graph.allow_mutation_on_saved_tensors`` when
    they are the saved-tensor hooks in force (innermost), else None."""
    if not getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False):
        return None
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return None
    pack = top[0]
    while isinstance(pack, functools.partial):  # a ferry region's own object for the hook
        pack = pack.func
    if "_swap_with_cloned" not in getattr(pack, "__qualname__", ""):
        return None
    return top


def _as_replay_input(forward_input, value):
    """``value`` (the forward's input or its clone) as the replay gets an input: a leaf as the
    very object, anything else detached, requiring grad as the forward's input did."""
    if value is forward_input and forward_input.is_leaf:
        return value
    return value.detach().requires_grad_(forward_input.requires_grad)


def _autocast_state():
    """The autocast state to replay: per device type, (enabled, dtype); and the cache switch."""
    return {
        device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
    }, torch.is_autocast_cache_enabled()


def _autocast_contexts(state):
    per_device, cache = state
    return [
        torch.autocast(device, enabled=enabled, dtype=dtype, cache_enabled=cache)
        for device, (enabled, dtype) in per_device.items()
        if device == "cpu" or torch.cuda.is_available()
    ]


class _Reentrant(torch.autograd.Function):
    """The reentrant variant: forward without grad; backward reruns the region with grad and
    backpropagates through the rerun."""

    @staticmethod
    def forward(ctx, fn, preserve, *args):
        ctx.fn = fn
        ctx.preserve = preserve
        ctx.autocast = _autocast_state()
        ctx.devices = sorted(
            {a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
        )
        if preserve:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.devices]
        ctx.tensor_slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*[args[i] for i in ctx.tensor_slots])
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "ferry.checkpoint: use_reentrant=True is incompatible with .grad() or with "
                "passing `inputs` to .backward(); use use_reentrant=False, or call .backward() "
                "without `inputs`"
            )
        args = list(ctx.others)
        for slot, saved in zip(ctx.tensor_slots, ctx.saved_tensors):
            args[slot] = saved.detach().requires_grad_(saved.requires_grad)
        with torch.random.fork_rng(devices=ctx.devices, enabled=ctx.preserve):
            if ctx.preserve:
                torch.set_rng_state(ctx.cpu_rng)
                for device, state in zip(ctx.devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, device)
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for autocast in _autocast_contexts(ctx.autocast):
                    stack.enter_context(autocast)
                outputs = ctx.fn(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [
            (out, grad)
            for out, grad in zip(outputs, grad_outputs)
            if isinstance(out, torch.Tensor) and out.requires_grad
        ]
        if not pairs:
            raise RuntimeError(
                "ferry.checkpoint: none of the outputs requires grad; this checkpoint is not "
                "necessary"
            )
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if isinstance(a, torch.Tensor) else None for a in args)
        return (None, None) + grads


def _reentrant(fn, preserve, *args):
    if torch.is_grad_enabled() and not any(
        isinstance(a, torch.Tensor) and a.requires_grad for a in args
    ):
        warnings.warn(
            "ferry.checkpoint: none of the inputs has requires_grad=True; gradients will be None",
            stacklevel=3,
        )
    return _Reentrant.apply(fn, preserve, *args)


def checkpoint_in(region: Region, function: Any, *args: Any, **kwargs: Any) -> Any:
    """``checkpoint`` inside ``region`` (a ``ferry.offload``): the checkpoint's inputs, which
    it keeps for the recomputation, are offloaded by the region's session (Note [Checkpoint
    inputs offloaded]); the tensors the checkpointed function saves are dropped and recomputed
    as without it."""
    with region:
        return checkpoint(function, *args, **kwargs)


# Note [Checkpoint inputs offloaded]
# transformers' offload flag puts torch's save_on_cpu around torch's checkpoint: what a
# checkpoint keeps for its recomputation, its inputs, goes to pinned host memory, copied on the
# compute stream. ferry.checkpoint opened inside an offload region gives its inputs to the
# region's session (frame_begin in real/src/checkpoint.cpp), which copies them out on its own
# stream, overlapped with the layers that follow, and prefetches them for backward; the
# recomputation takes them back from the session. The region is entered around each
# checkpointed call only, so the saved tensors of the layers that are not checkpointed stay
# as they are, as with the flag in transformers (and with accelerate's offload_wrapper).


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[[Any], Any]],
    segments: int,
    input: Any,
    use_reentrant: bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoints a sequence of modules or functions in ``segments`` parts; the last part is
    not checkpointed (its saved tensors are needed at once). As torch's
    ``checkpoint_sequential``.

    Args:
        functions: An ``nn.Sequential`` or a list of modules or functions.
        segments: The number of parts, between 1 and the number of functions.
        input: The input of the first function.
        use_reentrant: ``checkpoint``'s variant; left out, it warns and is True.
        **kwargs: ``preserve_rng_state`` only.

    Returns:
        The output of the last function.

    Raises:
        ValueError: A number of segments out of range, or another keyword.
    """
    if use_reentrant is None:
        warnings.warn(
            "ferry.checkpoint_sequential: the use_reentrant parameter should be passed "
            "explicitly; as in torch.utils.checkpoint it defaults to True. use_reentrant=False "
            "is recommended.",
            stacklevel=2,
        )
        use_reentrant = True
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError(
            "ferry.checkpoint_sequential: unexpected keyword arguments: " + ",".join(kwargs)
        )
    if isinstance(functions, torch.nn.Sequential):
        functions = list(functions.children())
    functions = list(functions)
    if not 1 <= segments <= max(len(functions), 1):
        raise ValueError(
            f"ferry.checkpoint_sequential: segments must be between 1 and the number of "
            f"functions ({len(functions)}), got {segments}"
        )

    def run(start, end):
        def forward(x):
            for f in functions[start:end]:
                x = f(x)
            return x

        return forward

    size = len(functions) // segments
    start = 0
    for _ in range(segments - 1):
        input = checkpoint(
            run(start, start + size),
            input,
            use_reentrant=use_reentrant,
            preserve_rng_state=preserve,
        )
        start += size
    return run(start, len(functions))(input)
