"""Hugging Face models' gradient checkpointing, done by ``ferry.checkpoint``:
``enable_gradient_checkpointing``."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._checkpoint import checkpoint

# ferry.checkpoint's own keywords: they mean nothing to the model's enable.
_FERRY_CHECKPOINT_KEYWORDS = ("offload", "early_stop")


class _CheckpointingEnable:
    """A model's ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` in older
    transformers) as ``enable_gradient_checkpointing`` leaves it on the instance: each call
    enables checkpointing the model's own way, then makes it ``ferry.checkpoint``'s, with the
    keywords of the call over ferry's."""

    def __init__(self, owner: torch.nn.Module, name: str) -> None:
        self.owner = owner  # the model whose class defines the method
        self.name = name
        self.kwargs: dict[
            str, Any
        ] = {}  # ferry.checkpoint's, as enable_gradient_checkpointing got them

    def __call__(
        self, checkpointing_kwargs: dict[str, Any] | None = None, *args: Any, **options: Any
    ) -> None:
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


def enable_gradient_checkpointing(
    model: torch.nn.Module, use_reentrant: bool = False, **checkpoint_kwargs: Any
) -> torch.nn.Module:
    """A Hugging Face model's gradient checkpointing, done by ``ferry.checkpoint``.

    Enables it the model's own way (``activation_checkpointing_enable``, or
    ``gradient_checkpointing_enable`` in older versions; PEFT models forward it to their base
    model), then makes every module that checkpoints call ``ferry.checkpoint`` with
    ``use_reentrant`` and ``checkpoint_kwargs`` (torch's, such as ``context_fn`` for selective
    checkpointing, and ferry's ``offload``: the session of the ops a selective policy
    offloads).

    It stays ferry's: that enable method is replaced on the model instance by one that enables
    checkpointing the model's way again and then installs ``ferry.checkpoint``, with the
    keywords it is given (``use_reentrant``, ...) over the ones given here. So a
    ``transformers.Trainer`` with ``TrainingArguments(gradient_checkpointing=True)`` (or
    ``activation_checkpointing=True``), which enables the model's checkpointing again when
    ``train()`` starts, with its ``gradient_checkpointing_kwargs``, trains with ferry's
    checkpoint (its ``every_n_layers`` is honoured; its ``offload=True``, torch's
    ``save_on_cpu`` around torch's checkpoint, is refused). Disabling it the model's way and
    enabling it again gives ferry's again; call this again to change ferry's keywords.

    Args:
        model: A Hugging Face model (or a PEFT model around one).
        use_reentrant: ``ferry.checkpoint``'s variant.
        **checkpoint_kwargs: Further ``ferry.checkpoint`` keywords.

    Returns:
        ``model``.

    Raises:
        ValueError: The model has no gradient checkpointing of its own, or no module of it
            supports it; or the enable is later called with ``offload=True``.
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
