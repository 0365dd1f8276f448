"""ferry: activation offload and checkpointing for PyTorch autograd.

Saved tensors of the ops run under a ferry region go through ferry's runtime (``ferry._C``):

    ctx = ferry.offload_model(model)          # or ferry.offload(), then update_model_params
    for batch in data:
        with ctx:
            loss = model(batch)
        loss.backward()

``offload`` moves saved activations to host memory and brings them back for backward (on a
CPU-only machine, ``loopback=True`` runs the same protocol between CPU buffers).
``no_offload`` keeps the saved tensors of a sub-region as they are, and ``checkpoint`` keeps
none: backward recomputes them, as ``torch.utils.checkpoint`` does (``checkpoint_sequential``
too).
"""

import functools
import importlib.metadata as _metadata
import os
import threading
import warnings

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import _C
from ._checkpoint import checkpoint, checkpoint_sequential

__all__ = [
    "offload",
    "no_offload",
    "checkpoint",
    "checkpoint_sequential",
    "offload_model",
    "OffloadActivations",
    "NoOpManager",
    "get_act_offloading_ctx_manager",
    "enable_gradient_checkpointing",
    "trace",
    "auto",
    "probe",
]
try:
    # setup.py takes the version from the top-level CMakeLists.txt, ferry's one version number.
    __version__ = _metadata.version("ferry")
except _metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "unknown"


def trace(model, *example_inputs, **options):
    """Traces one training step of ``model`` into a ``ferry.model/1`` scenario without running
    it for real (see ``ferry._trace.trace`` and docs/trace.md)."""
    from ._trace import trace as _trace

    return _trace(model, *example_inputs, **options)


def auto(model, *example_inputs, **options):
    """Traces ``model``, plans it under a memory budget with ``ferry plan`` and returns an
    ``offload`` that applies the plan (see ``ferry._auto.auto`` and docs/plan.md)."""
    from ._auto import auto as _auto

    return _auto(model, *example_inputs, **options)


def probe(device=None, **options):
    """Measures this device (a GPU, or the CPU loopback device) and returns the
    ``ferry.probe/1`` report, the device profile under ``"profile"`` (see
    ``ferry._probe_cli.probe`` and docs/devices.md, "Measuring a device: ferry probe")."""
    from ._probe_cli import probe as _probe

    return _probe(device, **options)


# Note [Regions on two stacks]
# A region is an entry on ferry's region stack (C++, per thread: what _C._pack does with a saved
# tensor) and a pair of hooks on torch's stack of saved-tensor hooks (per thread: who packs at
# all). Both must hold the same open regions in the same order, whatever the caller does, or a
# later pack goes to a region that was left (a selective checkpoint offloading into a closed
# session, say). So the open entries of this thread are listed here, each with the hook object
# it pushed on torch's stack (a partial made for it: its identity finds the entry again), and
# __exit__ removes its own entry from both stacks even when it is not the innermost one:
# torch's hooks above it are popped and pushed back, and ferry's entry is removed where it is
# (_C._remove, by its position among this thread's regions). Leaving out of order still raises
# "regions must nest", after the cleanup.
_open = threading.local()


class _Entry:
    """An open region on this thread: the region and the pack hook it pushed on torch's stack."""

    __slots__ = ("region", "pack")

    def __init__(self, region, pack):
        self.region = region
        self.pack = pack


def _entries():
    """This thread's open regions, innermost last."""
    entries = getattr(_open, "entries", None)
    if entries is None:
        entries = _open.entries = []
    return entries


def _remove_hooks(pack):
    """Removes the hooks whose pack is ``pack`` from torch's stack, keeping the ones above it.
    Returns whether they were the innermost."""
    autograd = torch._C._autograd
    above = []
    try:
        while True:
            top = autograd._top_saved_tensors_default_hooks(True)
            if top is None:
                return False  # someone else popped them
            autograd._pop_saved_tensors_default_hooks()
            if top[0] is pack:
                return not above
            above.append(top)
    finally:
        for hooks in reversed(above):
            autograd._push_saved_tensors_default_hooks(*hooks)


class _Region(saved_tensors_hooks):
    """A ferry region: its entry on ferry's region stack and its hooks on torch's stack of
    saved-tensor hooks (whose pack and unpack are ferry's), entered and left together.

    Leaving a region that is not the innermost raises "regions must nest", and the region is
    gone from both stacks all the same; leaving one that is not open on this thread raises
    without touching either. Entered while torch's ``allow_mutation_on_saved_tensors`` is on, a
    region saves tensors through the hooks in effect when it is entered (that mode's), so that
    a mutated saved tensor is cloned first, as without ferry."""

    _kind = None
    # Whether the region may be entered again while it is open on the same thread (an offload
    # may not: its session follows one forward at a time).
    _reentrant = True

    def _push(self):
        raise NotImplementedError

    def _hooks(self):
        """The pack and unpack hooks of an entry starting now."""
        if torch.autograd.graph._allow_mutation_on_saved_tensors_enabled:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is not None:
                return top
        return self.pack_hook, self.unpack_hook

    def _is_open(self):
        return any(e.region is self for e in _entries())

    def _open_entry(self):
        """This region's innermost open entry on this thread; raises when there is none."""
        for entry in reversed(_entries()):
            if entry.region is self:
                return entry
        raise RuntimeError(
            "ferry: regions must nest: the region being closed is not open on this thread "
            "(left twice, or entered on another thread)"
        )

    def __enter__(self):
        entries = _entries()
        if not self._reentrant and self._is_open():
            name = type(self).__name__
            raise RuntimeError(
                f"ferry: this {name} region is already open on this thread: it cannot be entered "
                f"again before it is left; use another {name}"
            )
        pack, unpack = self._hooks()
        pack = functools.partial(pack)  # this entry's own object: see Note [Regions on two stacks]
        self._push()
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        except BaseException:
            _C._pop(self._kind)
            raise
        entries.append(_Entry(self, pack))
        return self

    def __exit__(self, *exc):
        entry = self._open_entry()
        entries = _entries()
        innermost = False
        try:
            innermost = _remove_hooks(entry.pack) and entries[-1] is entry
        finally:
            _C._remove(self._kind, entries.index(entry))
            entries.remove(entry)
        if not innermost:
            raise RuntimeError(
                "ferry: regions must nest: the region being closed is not the innermost one "
                "(it was closed all the same)"
            )


class offload(_Region):
    """Offloads the saved tensors of the ops run inside it.

    The object is meant to be reused step after step (``with ctx:`` around each forward); it
    keeps one scheduler session, whose state can be read with ``telemetry()``, ``tracked()``,
    ``live_device_buffers()`` and ``live_host_buffers()``.

    Options: ``policy`` is ``"ferry"`` (ferry's scheduler), ``"trl"`` (a faithful model of the
    reference hook-based offloader as TRL ships it; ``"trl-seed"``: as first released) or
    ``"none"`` (keep everything); tensors under
    ``min_bytes`` stay; ``max_fwd_stash_size`` is the reference's forward stash (trl);
    ``window_bytes``, ``prefetch_bytes``, ``host_cap``, ``dedup``, ``prefetch`` and
    ``horizon_bytes`` tune the ferry policy (``horizon_bytes``: the bytes one forward may copy
    out before the rest of its saved tensors stay on the device, as ``ferry compare`` derives it
    from the link; Note [Offload horizon]). Pinning is refused when it would leave less than
    ``host_reserve_bytes`` (1 GiB) of the host's available memory: ferry then keeps the tensor
    on the device (counted in ``host_fallbacks``), trl raises. ``loopback=True`` treats CPU
    tensors as device tensors (no GPU needed);
    its streams run synchronously, or with ``FERRY_LOOPBACK=async[:SEED[:MAX_DELAY_US]]`` in the
    environment on worker threads with seeded delays, where a missing wait shows as NaN
    gradients (docs/real.md, "The asynchronous loopback device");
    ``record=True`` records the stream program for ``ferry check`` (see ``write_program``).
    The reference offloader's names are accepted too: ``min_offload_size`` (``min_bytes``),
    ``use_streams`` (False: copies on the compute stream, in order with the kernels) and
    ``use_pin_memory`` (host copies are always pinned: False is refused).

    Entered while ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is on, the region
    offloads nothing: its saved tensors go through that mode's hooks, which keep them and clone
    one before it is mutated, so backward sees the values of the forward, as without ferry (the
    same holds for ``no_offload`` and the head region of ``offload_model``). The region is open
    once at a time on a thread: entering it again before it is left raises (``no_offload`` may
    nest in itself). Leaving regions out of order raises "regions must nest"; the region left
    is closed all the same.

    ``plan`` applies a ``ferry.plan/1`` (a path or a loaded dict, as ``ferry plan --out``
    writes for a traced model): each op's saved tensors are kept or offloaded, and the plan's
    checkpoint regions recompute what it says (docs/plan.md, "Applying a plan"). Its knobs are
    the defaults of the options above. ``model`` names the model the plan was traced from (else
    the first module called inside the region is taken); run the whole traced step, loss
    included, inside it.
    """

    _kind = "offload"
    _reentrant = False

    def __init__(
        self,
        *,
        policy="ferry",
        min_bytes=None,
        max_fwd_stash_size=5,
        min_offload_size=None,
        use_streams=True,
        use_pin_memory=True,
        window_bytes=None,
        prefetch_bytes=None,
        host_cap=None,
        host_reserve_bytes=None,
        dedup=True,
        prefetch=True,
        horizon_bytes=None,
        loopback=False,
        record=False,
        profile=None,
        plan=None,
        model=None,
    ):
        self._plan_run = None
        if plan is not None:
            from ._plan_apply import load_plan, offload_options

            plan = load_plan(plan)
            fixed = offload_options(plan)
            if policy == "ferry":
                policy = fixed["policy"]
            min_bytes = fixed.get("min_bytes") if min_bytes is None else min_bytes
            window_bytes = fixed.get("window_bytes") if window_bytes is None else window_bytes
            if prefetch_bytes is None:
                prefetch_bytes = fixed.get("prefetch_bytes")
            host_cap = fixed.get("host_cap") if host_cap is None else host_cap
            prefetch = fixed.get("prefetch", prefetch)
            if horizon_bytes is None:
                horizon_bytes = fixed.get("horizon_bytes")
        elif model is not None:
            raise TypeError("ferry.offload: model= goes with plan=")
        if min_bytes is not None and min_offload_size is not None and min_bytes != min_offload_size:
            raise TypeError(
                "ferry.offload: min_bytes and min_offload_size name the same threshold; give one"
            )
        if not use_pin_memory:
            raise ValueError(
                "ferry.offload: use_pin_memory=False is not supported: ferry copies to pinned "
                "host memory only (pageable copies cannot overlap compute)"
            )
        if min_bytes is None:
            min_bytes = 1024 if min_offload_size is None else min_offload_size
        options = dict(
            policy=policy,
            min_bytes=min_bytes,
            use_streams=use_streams,
            max_fwd_stash_size=max_fwd_stash_size,
            dedup=dedup,
            prefetch=prefetch,
            loopback=loopback,
            # How the loopback device runs its streams: "sync" (default) or "async[:SEED[:US]]",
            # copies on worker threads with seeded delays (Note [The asynchronous loopback
            # device]).
            loopback_streams=os.environ.get("FERRY_LOOPBACK", "sync") if loopback else "sync",
            record=record,
        )
        for name, value in (
            ("window_bytes", window_bytes),
            ("prefetch_bytes", prefetch_bytes),
            ("host_cap", host_cap),
            ("host_reserve_bytes", host_reserve_bytes),
            ("horizon_bytes", horizon_bytes),
            ("profile", profile),
        ):
            if value is not None:
                options[name] = value
        self._session = self._make_session(options)
        if plan is None:
            super().__init__(_C._pack, _C._unpack)
            return
        from ._plan_apply import PlanRun

        self._plan_run = PlanRun(plan, self, model)
        super().__init__(self._plan_run.pack, self._plan_run.unpack)

    @staticmethod
    def _make_session(options):
        return _C.Session(**options)

    def _push(self):
        _C._push_offload(self._session)

    def __enter__(self):
        super().__enter__()
        if self._plan_run is not None:
            try:
                self._plan_run.enter()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        self._open_entry()  # raises when it is not open, leaving the session alone
        try:
            if self._plan_run is not None and self._plan_run.active():
                self._plan_run.exit(failed=exc[0] is not None)
        finally:
            try:
                super().__exit__(*exc)
            finally:
                self._session._exit()

    def plan_counts(self):
        """With ``plan=``: what the last forward under it did, by the plan's decision
        (``kept``, ``offloaded``: distinct tensors saved outside regions; ``saved_outputs``,
        ``offloaded_outputs``: region ops whose outputs were kept or offloaded;
        ``recomputed``: region ops re-run in backward so far)."""
        if self._plan_run is None:
            raise ValueError("ferry.offload: plan_counts() needs plan=")
        return self._plan_run.counts()

    def telemetry(self):
        """The scheduler's counters, as a dict (bytes as ints)."""
        return self._session.telemetry()

    def tracked(self):
        """Saved tensors the scheduler still tracks."""
        return self._session.tracked()

    def live_device_buffers(self):
        """Device storages the scheduler holds a reference to."""
        return self._session.live_device_buffers()

    def live_host_buffers(self):
        """Host buffers the scheduler holds (ferry's pool keeps them across steps)."""
        return self._session.live_host_buffers()

    def program_json(self):
        """The recorded stream program (empty unless ``record=True``)."""
        return self._session.program_json()

    def write_program(self, path):
        """Writes the recorded program to ``path``, for ``ferry check``."""
        text = self.program_json()
        if not text:
            raise ValueError("ferry.offload: nothing recorded; create it with record=True")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def update_model_params(self, model):
        """Never offload ``model``'s parameters and buffers (frozen ones included)."""
        for p in model.parameters():
            self._session.exclude(p)
        for b in model.buffers():
            self._session.exclude(b)


class no_offload(_Region):
    """Inside an offload region: the saved tensors of ops run inside it are kept as they are."""

    _kind = "no_offload"

    def __init__(self):
        super().__init__(_C._pack, _C._unpack)

    def _push(self):
        _C._push_no_offload()


def _output_head(model):
    """The module whose saved tensors are not worth offloading (the reference's search)."""
    nn = torch.nn
    if hasattr(model, "output"):
        if isinstance(model.output, nn.Module):
            return model.output
        linear = getattr(model.output, "linear", None)
        return linear if isinstance(linear, nn.Module) else None
    if hasattr(model, "lm_head"):
        return model.lm_head if isinstance(model.lm_head, nn.Module) else None
    if hasattr(model, "decoder"):
        decoder = model.decoder
        for name in ("output", "lm_head"):
            head = getattr(decoder, name, None)
            if isinstance(head, nn.Module):
                return head
        return None
    if hasattr(model, "final_layer_norm") or hasattr(model, "ln_f"):
        head = getattr(model, "final_layer_norm", None) or getattr(model, "ln_f", None)
        return head if isinstance(head, nn.Module) else None
    head = getattr(model, "head", None)
    return head if isinstance(head, nn.Module) else None


def offload_model(model, *, warn_if_no_head=True, **options):
    """An ``offload`` set up for ``model`` the way the reference offloader is used.

    Like TRL's ``get_act_offloading_ctx_manager``: parameters and buffers are excluded, and the
    output head (``output``, ``lm_head``, ``decoder.output``/``decoder.lm_head``,
    ``final_layer_norm``/``ln_f``, ``head``) runs in a no-offload region, since its activations
    are needed again right away. ``options`` are ``offload``'s. Use the result as
    ``with ctx: loss = model(x)``.
    """
    ctx = offload(**options)
    ctx.update_model_params(model)
    unwrapped = getattr(model, "module", model)  # DDP / FSDP wrappers
    if hasattr(unwrapped, "base_model") and hasattr(unwrapped, "peft_config"):
        unwrapped = unwrapped.base_model  # PEFT
    head = _output_head(unwrapped)
    if head is None:
        if warn_if_no_head:
            warnings.warn(
                "ferry.offload_model: no output head was detected; every saved tensor of the "
                "model is a candidate for offload, the last ones included",
                stacklevel=2,
            )
        return ctx
    region = no_offload()

    def enter(module, args):
        region.__enter__()  # returns nothing: a pre-hook's result would replace the inputs

    def leave(module, args, output):
        region.__exit__(None, None, None)  # returns nothing: the output stays

    head.register_forward_pre_hook(enter)
    head.register_forward_hook(leave, always_call=True)
    return ctx


# The reference offloader's names (TRL's activation_offloading module), for existing scripts.


class OffloadActivations(offload):
    """``offload`` under the reference's name and signature. The scheduler is ferry's unless
    ``policy="trl"`` asks for the reference's own; other ``offload`` options pass through."""

    def __init__(
        self,
        use_pin_memory=True,
        use_streams=True,
        min_offload_size=1024,
        max_fwd_stash_size=5,
        **options,
    ):
        super().__init__(
            use_pin_memory=use_pin_memory,
            use_streams=use_streams,
            min_offload_size=min_offload_size,
            max_fwd_stash_size=max_fwd_stash_size,
            **options,
        )


class NoOpManager(no_offload):
    """``no_offload`` under the reference's name: saved tensors inside it stay as they are."""


def get_act_offloading_ctx_manager(
    model,
    use_pin_memory=True,
    use_streams=True,
    min_offload_size=1024,
    max_fwd_stash_size=5,
    warn_if_no_head=True,
    **options,
):
    """``offload_model`` under the reference's name and signature."""
    return offload_model(
        model,
        warn_if_no_head=warn_if_no_head,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        **options,
    )


# ferry.checkpoint's own keywords: they mean nothing to the model's enable.
_FERRY_CHECKPOINT_KEYWORDS = ("offload", "early_stop")


class _CheckpointingEnable:
    """A model's ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` in older
    transformers) as ``enable_gradient_checkpointing`` leaves it on the instance: each call
    enables checkpointing the model's own way, then makes it ``ferry.checkpoint``'s, with the
    keywords of the call over ferry's."""

    def __init__(self, owner, name):
        self.owner = owner  # the model whose class defines the method
        self.name = name
        self.kwargs = {}  # ferry.checkpoint's, as enable_gradient_checkpointing got them

    def __call__(self, checkpointing_kwargs=None, *args, **options):
        keyword = self.name.replace("_enable", "_kwargs")
        if checkpointing_kwargs is None:
            checkpointing_kwargs = options.pop(keyword, None)
        if options.get("offload"):
            raise ValueError(
                f"ferry.enable_gradient_checkpointing: {self.name}(offload=True) (the Trainer's "
                "activation_checkpointing_kwargs={'offload': True}) puts torch's save_on_cpu "
                "around torch's checkpoint, which ferry's checkpoint replaces; offload with "
                "ferry.offload_model, or give ferry.enable_gradient_checkpointing an offload "
                "session for selective checkpointing"
            )
        kwargs = {**self.kwargs, **(checkpointing_kwargs or {})}
        theirs = {k: v for k, v in kwargs.items() if k not in _FERRY_CHECKPOINT_KEYWORDS}
        # The class's method: the instance attribute is this object.
        getattr(type(self.owner), self.name)(self.owner, theirs, *args, **options)
        func = functools.partial(checkpoint, **kwargs)
        found = False
        for module in self.owner.modules():
            if hasattr(module, "gradient_checkpointing"):
                module._gradient_checkpointing_func = func
                found = True
        if not found:
            raise ValueError(
                f"ferry.enable_gradient_checkpointing: {type(self.owner).__name__} has no module "
                "that supports gradient checkpointing"
            )


def enable_gradient_checkpointing(model, use_reentrant=False, **checkpoint_kwargs):
    """A Hugging Face model's gradient checkpointing, done by ``ferry.checkpoint``.

    Enables it the model's own way (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` in older versions; PEFT models forward it to their base
    model), then makes every module that checkpoints call ``ferry.checkpoint`` with
    ``use_reentrant`` and ``checkpoint_kwargs`` (torch's, such as ``context_fn`` for selective
    checkpointing, and ferry's ``offload``: the session of the ops a selective policy
    offloads). Returns the model.

    It stays ferry's: that enable method is replaced on the model instance by one that enables
    checkpointing the model's way again and then installs ``ferry.checkpoint``, with the
    keywords it is given (``use_reentrant``, ...) over the ones given here. So a
    ``transformers.Trainer`` with ``TrainingArguments(gradient_checkpointing=True)`` (or
    ``activation_checkpointing=True``), which enables the model's checkpointing again when
    ``train()`` starts, with its ``gradient_checkpointing_kwargs``, trains with ferry's
    checkpoint (its ``every_n_layers`` is honoured; its ``offload=True``, torch's
    ``save_on_cpu`` around torch's checkpoint, is refused). Disabling it the model's way and
    enabling it again gives ferry's again; call this again to change ferry's keywords.
    """
    name = "activation_checkpointing_enable"
    if not hasattr(model, name):
        name = "gradient_checkpointing_enable"
    enable = getattr(model, name, None)
    if enable is None:
        raise ValueError(
            f"ferry.enable_gradient_checkpointing: {type(model).__name__} has no "
            "gradient_checkpointing_enable (not a Hugging Face model); wrap its blocks with "
            "ferry.checkpoint"
        )
    if not isinstance(enable, _CheckpointingEnable):
        enable = _CheckpointingEnable(enable.__self__, name)
        setattr(enable.owner, name, enable)
    enable.kwargs = {"use_reentrant": use_reentrant, **checkpoint_kwargs}
    enable()
    return model
