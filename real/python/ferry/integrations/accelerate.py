"""accelerate's FSDP2 activation checkpointing (``FullyShardedDataParallelPlugin(
activation_checkpointing=True)``) and its offload flag (``activation_checkpointing_offload``)
run by ferry: ``install()``, ``uninstall()``, ``installed()``, ``checkpoint_offload()``.

``Accelerator.prepare`` checkpoints the layers of an FSDP2 model through the function
``fsdp2_apply_ac`` that ``accelerate.accelerator`` imported; ``install()`` sets that one name
to ferry's, which wraps the same layers (the plugin's auto-wrap policy) in torch's
``checkpoint_wrapper`` with ``ferry.checkpoint`` as its checkpoint function, and with the
offload flag runs each checkpointed call inside a ferry offload session that offloads the
layer's inputs (Note [Checkpoint inputs offloaded]) where accelerate puts torch's
``save_on_cpu`` around it (``offload_wrapper``). ``uninstall()`` puts accelerate's back.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._checkpoint import checkpoint, checkpoint_in
from .._offload import offload
from . import _patch

_WHERE = "ferry.integrations.accelerate"
_MODULES = ("accelerate.accelerator",)
_NAME = "fsdp2_apply_ac"
# Where the wrapped model keeps the offload session of its checkpointed layers.
_SESSION = "_ferry_checkpoint_offload"


def install(**options: Any) -> None:
    """Makes ``Accelerator.prepare`` checkpoint FSDP2 models with ``ferry.checkpoint``.

    With the plugin's ``activation_checkpointing`` on, each layer its auto-wrap policy picks is
    wrapped in torch's ``checkpoint_wrapper`` calling ``ferry.checkpoint`` (non-reentrant,
    without the random-state replay, as accelerate's). With ``activation_checkpointing_offload``
    also on, the checkpointed calls run inside one ``ferry.offload`` session per model, made
    with ``options`` (parameters excluded), which offloads each layer's inputs
    (``checkpoint_offload(model)`` returns it). Models prepared before keep their wrappers.

    Args:
        **options: ``ferry.offload``'s options for the session (``loopback=True`` without a
            GPU, ``window_bytes``, ...).

    Raises:
        ImportError: accelerate cannot be imported, or is not a version ferry knows.
    """

    def make(theirs: Any) -> Any:
        @functools.wraps(theirs)
        def fsdp2_apply_ac(accelerator: Any, model: torch.nn.Module) -> torch.nn.Module:
            return _apply(accelerator, model, options)

        return fsdp2_apply_ac

    _patch.install(_WHERE, _MODULES, _NAME, make)


def _apply(accelerator: Any, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
    from accelerate.utils.fsdp_utils import (
        fsdp2_prepare_auto_wrap_policy,
        get_module_children_bottom_up,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plugin = accelerator.state.fsdp_plugin
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    if policy is None:
        raise ValueError(
            "ferry.integrations.accelerate: activation_checkpointing needs the plugin's "
            "auto_wrap_policy (transformer_based_wrap or size_based_wrap) to pick the layers"
        )
    func: Any = checkpoint
    if plugin.activation_checkpointing_offload:
        session = offload(**options)
        session.update_model_params(model)
        setattr(model, _SESSION, session)
        func = functools.partial(checkpoint_in, session)
    # The model itself is the last of its modules, bottom up: it is not wrapped.
    for name, layer in get_module_children_bottom_up(model, return_fqns=True)[:-1]:
        if policy(layer):
            wrapped = checkpoint_wrapper(
                layer, checkpoint_fn=func, use_reentrant=False, preserve_rng_state=False
            )
            model.set_submodule(name, wrapped)
    return model


def checkpoint_offload(model: torch.nn.Module) -> offload | None:
    """The offload session of ``model``'s checkpointed layers.

    Args:
        model: A model prepared after ``install()``.

    Returns:
        The session, or None when the model was prepared without the offload flag.
    """
    return getattr(model, _SESSION, None)


def uninstall() -> None:
    """Puts accelerate's own ``fsdp2_apply_ac`` back for models prepared afterwards (a name
    replaced since by anyone else is left as it is)."""
    _patch.uninstall(_WHERE, _MODULES, _NAME)


def installed() -> bool:
    """Whether ``install()`` is in force.

    Returns:
        True when ``accelerate.accelerator`` looks up ferry's ``fsdp2_apply_ac``.
    """
    return _patch.installed(_WHERE, _MODULES, _NAME)
