"""torchtune's ``enable_activation_offloading`` recipe flag run by ferry's offloader:
``install()``, ``uninstall()``, ``installed()``.

torchtune's recipes build their offload context with
``training.get_act_offloading_ctx_manager(model, cfg.enable_activation_offloading)``, looked up
in ``torchtune.training`` when the recipe is set up; ``install()`` sets that one name to
ferry's and ``uninstall()`` puts torchtune's back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .._offload import offload_model
from . import _patch

_WHERE = "ferry.integrations.torchtune"
_MODULES = ("torchtune.training",)
_NAME = "get_act_offloading_ctx_manager"


def install(**options: Any) -> None:
    """Makes torchtune's recipes offload with ferry's offloader when
    ``enable_activation_offloading`` is on.

    A recipe set up afterwards wraps each forward in a ``ferry.offload`` set up as
    ``ferry.offload_model`` does (parameters excluded, the output head ``output``, or a tied
    head's ``output.linear``, in a no-offload region), with torchtune's defaults (pinned host
    copies on a stream of their own, 1024-byte minimum, a forward stash of 5 for
    ``policy="trl"``) and ``options`` over them; with the flag off, the recipe's context stays
    torchtune's ``contextlib.nullcontext()``.

    Args:
        **options: ``ferry.offload``'s options (``loopback=True`` without a GPU, ``policy``,
            ``window_bytes``, ...).

    Raises:
        ImportError: torchtune cannot be imported (it needs torchao and its other
            dependencies), or is not a version ferry knows.
    """

    def make(theirs: Any) -> Any:
        @functools.wraps(theirs)
        def get_act_offloading_ctx_manager(
            model: torch.nn.Module, enable_activation_offloading: bool
        ) -> Any:
            if not enable_activation_offloading:
                return contextlib.nullcontext()
            return offload_model(
                model,
                **_patch.merged(
                    dict(
                        use_pin_memory=True,
                        use_streams=True,
                        max_fwd_stash_size=5,
                        min_offload_size=1024,
                    ),
                    options,
                ),
            )

        return get_act_offloading_ctx_manager

    _patch.install(_WHERE, _MODULES, _NAME, make)


def uninstall() -> None:
    """Puts torchtune's own offloader back for recipes set up afterwards (a name replaced since
    by anyone else is left as it is)."""
    _patch.uninstall(_WHERE, _MODULES, _NAME)


def installed() -> bool:
    """Whether ``install()`` is in force.

    Returns:
        True when ``torchtune.training`` looks up ferry's offloader.
    """
    return _patch.installed(_WHERE, _MODULES, _NAME)
