"""Hugging Face models' gradient checkpointing, done by ``ferry.checkpoint``:
``enable_gradient_checkpointing``."""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch

from .._checkpoint import checkpoint, checkpoint_in
from .._offload import offload

# ferry.checkpoint's own keywords: they mean nothing to the model's enable.
_FERRY_CHECKPOINT_KEYWORDS = ("offload", "early_stop")


class _CheckpointingEnable:
    """A model's ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` in older
    transformers) as ``enable_gradient_checkpointing`` leaves it on the instance: each call
    enables checkpointing the model's own way, then makes it ``ferry.checkpoint``'s, with the
    keywords of the call over ferry's. The model's ``offload`` flag runs each checkpointed call
    inside the offload session the model owns (``self.session``), which offloads its inputs."""

    def __init__(self, owner: torch.nn.Module, name: str) -> None:
        self.owner = owner  # the model whose class defines the method
        self.name = name
        self.kwargs: dict[
            str, Any
        ] = {}  # ferry.checkpoint's, as enable_gradient_checkpointing got them
        self.session: offload | None = None  # made at the first call with the offload flag

    def __call__(
        self, checkpointing_kwargs: dict[str, Any] | None = None, *args: Any, **options: Any
    ) -> None:
        keyword = self.name.replace("_enable", "_kwargs")
        if checkpointing_kwargs is None:
            checkpointing_kwargs = options.pop(keyword, None)
        if self.name == "activation_checkpointing_enable" and len(args) > 1:
            # activation_checkpointing_enable(kwargs, every_n_layers, offload)
            options["offload"] = args[1]
            args = args[:1]
        flag = options.pop("offload", False)
        call_kwargs = dict(checkpointing_kwargs or {})
        if isinstance(call_kwargs.get("offload"), bool):
            # The flag inside the kwargs, as gradient_checkpointing_kwargs={"offload": True}
            # gives it; a ferry.offload there is ferry.checkpoint's own keyword.
            flag = call_kwargs.pop("offload") or flag
        if not isinstance(flag, bool):
            raise TypeError(
                f"ferry.enable_gradient_checkpointing: {self.name}(offload=...) is the model's "
                f"flag, True or False, got {type(flag).__name__}; give a ferry.offload session "
                "in the checkpointing kwargs or to ferry.enable_gradient_checkpointing"
            )
        kwargs = {**self.kwargs, **call_kwargs}
        theirs = {k: v for k, v in kwargs.items() if k not in _FERRY_CHECKPOINT_KEYWORDS}
        # The class's method: the instance attribute is this object. Its own offload (torch's
        # save_on_cpu around torch's checkpoint) stays off: ferry's session does it.
        getattr(type(self.owner), self.name)(self.owner, theirs, *args, **options)
        func: Any
        if flag:
            func = _OffloadedCheckpoint(self, kwargs)
        else:
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

    def owned_session(self) -> offload:
        """The model's session, made on first use."""
        if self.session is None:
            # On a machine without CUDA the model's tensors are on the host: the loopback device
            # runs the same protocol between host buffers.
            self.session = offload(loopback=not torch.cuda.is_available())
            self.session.update_model_params(self.owner)
        return self.session

    def __deepcopy__(self, memo: dict[int, Any]) -> _CheckpointingEnable:
        # A copy of the model (copy.deepcopy) makes a session of its own when it first needs
        # one; a session the caller gave is shared, as the caller's object.
        twin = _CheckpointingEnable.__new__(_CheckpointingEnable)
        memo[id(self)] = twin
        twin.owner = copy.deepcopy(self.owner, memo)
        twin.name = self.name
        twin.kwargs = _copied(self.kwargs, memo)
        twin.session = None
        return twin


class _OffloadedCheckpoint:
    """A checkpointed layer's call with the offload flag on: ``ferry.checkpoint`` with
    ``kwargs`` inside the offload session given as ``offload=``, else the model's."""

    def __init__(self, enable: _CheckpointingEnable, kwargs: dict[str, Any]) -> None:
        self.enable = enable
        self.kwargs = kwargs

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        session = self.kwargs.get("offload")
        if session is None:
            session = self.enable.owned_session()
        return checkpoint_in(session, function, *args, **{**self.kwargs, **kwargs})

    def __deepcopy__(self, memo: dict[int, Any]) -> _OffloadedCheckpoint:
        return _OffloadedCheckpoint(copy.deepcopy(self.enable, memo), _copied(self.kwargs, memo))


def _copied(kwargs: dict[str, Any], memo: dict[int, Any]) -> dict[str, Any]:
    """``kwargs`` deep-copied but for offload sessions, which are shared."""
    return {k: v if isinstance(v, offload) else copy.deepcopy(v, memo) for k, v in kwargs.items()}


def gradient_checkpointing_offload(model: torch.nn.Module) -> offload | None:
    """The offload session through which ``model``'s checkpointed layers offload their inputs.

    The model owns it once a checkpointed layer ran with the model's ``offload`` flag on after
    ``ferry.enable_gradient_checkpointing`` (without a session of the caller's given as
    ``offload=``); a copy of the model (``copy.deepcopy``) makes its own. Its counters and
    state (``telemetry()``, ``tracked()``, ``live_device_buffers()``) are those of these
    inputs.

    Args:
        model: A model given to ``ferry.enable_gradient_checkpointing`` (or a PEFT model around
            one).

    Returns:
        The session, or None while the model has made none.

    Raises:
        ValueError: ``model``'s checkpointing is not ferry's.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if not isinstance(enable, _CheckpointingEnable):
        enable = getattr(model, "gradient_checkpointing_enable", None)
    if not isinstance(enable, _CheckpointingEnable):
        raise ValueError(
            f"ferry.gradient_checkpointing_offload: {type(model).__name__}'s checkpointing is not "
            "ferry's; call ferry.enable_gradient_checkpointing(model) first"
        )
    return enable.session


def enable_gradient_checkpointing(
    model: torch.nn.Module, use_reentrant: bool = False, **checkpoint_kwargs: Any
) -> torch.nn.Module:
    """A Hugging Face model's gradient checkpointing, done by ``ferry.checkpoint``.

    Enables it the model's own way (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` in older versions; PEFT models forward it to their base
    model), then makes every module that checkpoints call ``ferry.checkpoint`` with
    ``use_reentrant`` and ``checkpoint_kwargs`` (torch's, such as ``context_fn`` for selective
    checkpointing, and ferry's ``offload``: a ``ferry.offload`` session, for the ops a
    selective policy offloads and for the inputs the offload flag offloads).

    It stays ferry's: that enable method is replaced on the model instance by one that enables
    checkpointing the model's way again and then installs ``ferry.checkpoint``, with the
    keywords it is given (``use_reentrant``, ...) over the ones given here. So a
    ``transformers.Trainer`` with ``TrainingArguments(gradient_checkpointing=True)`` (or
    ``activation_checkpointing=True``), which enables the model's checkpointing again when
    ``train()`` starts, with its ``gradient_checkpointing_kwargs``, trains with ferry's
    checkpoint, its ``every_n_layers`` honoured. Its ``offload=True`` (the enable's ``offload``
    flag, or ``"offload": True`` in the checkpointing kwargs), which in transformers puts
    torch's ``save_on_cpu`` around torch's checkpoint, runs each checkpointed call inside a
    ferry offload session instead: the inputs the checkpoint keeps for its recomputation are
    copied to the host on the session's stream, overlapped with the layers that follow, and
    prefetched for backward. The session is ``offload=`` when given, else one the model owns
    (``ferry.offload`` with its defaults, on the loopback device when torch sees no CUDA;
    ``ferry.gradient_checkpointing_offload(model)`` returns it). Disabling it the model's way
    and enabling it again gives ferry's again; call this again to change ferry's keywords.

    Args:
        model: A Hugging Face model (or a PEFT model around one).
        use_reentrant: ``ferry.checkpoint``'s variant.
        **checkpoint_kwargs: Further ``ferry.checkpoint`` keywords; ``offload=True`` turns
            the model's offload flag on for this enable.

    Returns:
        ``model``.

    Raises:
        ValueError: The model has no gradient checkpointing of its own, or no module of it
            supports it.
        TypeError: The enable is later called with an ``offload`` flag that is not a bool.
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
    flag = False
    if isinstance(checkpoint_kwargs.get("offload"), bool):
        flag = checkpoint_kwargs.pop("offload")
    enable.kwargs = {"use_reentrant": use_reentrant, **checkpoint_kwargs}
    enable(offload=flag)
    return model
