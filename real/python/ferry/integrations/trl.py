"""TRL's ``activation_offloading`` flag (``SFTConfig``, ``DPOConfig``, ``KTOConfig``,
``RewardConfig``) run by ferry's offloader: ``install()``, ``uninstall()``, ``installed()``.

TRL's trainers build their offload context when they are constructed, from the name
``get_act_offloading_ctx_manager`` that each trainer's module imported from
``trl.models``; ``install()`` sets that one name, in each of those modules, to ferry's
``get_act_offloading_ctx_manager`` (``ferry.offload_model`` under TRL's signature), and
``uninstall()`` puts TRL's back. Nothing else of TRL is touched.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..compat import trl as _names
from . import _patch

_WHERE = "ferry.integrations.trl"
#: The modules of TRL 1.16's trainers whose config has ``activation_offloading``.
TRAINER_MODULES = (
    "trl.trainer.sft_trainer",
    "trl.trainer.dpo_trainer",
    "trl.trainer.kto_trainer",
    "trl.trainer.reward_trainer",
)
_NAME = "get_act_offloading_ctx_manager"


def install(**options: Any) -> None:
    """Makes TRL's trainers offload with ferry's offloader when ``activation_offloading=True``.

    A trainer constructed afterwards (``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``,
    ``RewardTrainer``, and their subclasses) wraps each training step in a ``ferry.offload``
    set up as ``ferry.offload_model`` does (parameters excluded, the output head in a
    no-offload region), with TRL's own arguments (``min_offload_size``, ``use_streams``, ...)
    and ``options`` over them. The trainer's context (``trainer.maybe_activation_offload_context``)
    is that region: its ``telemetry()`` tells what it did. Calling it again replaces the
    options; trainers constructed before keep the context they have.

    Args:
        **options: ``ferry.offload``'s options (``loopback=True`` without a GPU, ``policy``,
            ``window_bytes``, ...).

    Raises:
        ImportError: TRL cannot be imported, or is not a version with these trainers.
    """

    def make(theirs: Any) -> Any:
        @functools.wraps(theirs)
        def get_act_offloading_ctx_manager(
            model: torch.nn.Module,
            use_pin_memory: bool = True,
            use_streams: bool = True,
            min_offload_size: int = 1024,
            max_fwd_stash_size: int = 5,
            warn_if_no_head: bool = True,
        ) -> Any:
            return _names.get_act_offloading_ctx_manager(
                model,
                **_patch.merged(
                    dict(
                        use_pin_memory=use_pin_memory,
                        use_streams=use_streams,
                        min_offload_size=min_offload_size,
                        max_fwd_stash_size=max_fwd_stash_size,
                        warn_if_no_head=warn_if_no_head,
                    ),
                    options,
                ),
            )

        return get_act_offloading_ctx_manager

    _patch.install(_WHERE, TRAINER_MODULES, _NAME, make)


def uninstall() -> None:
    """Puts TRL's own offloader back for trainers constructed afterwards (a name replaced
    since by anyone else is left as it is)."""
    _patch.uninstall(_WHERE, TRAINER_MODULES, _NAME)


def installed() -> bool:
    """Whether ``install()`` is in force.

    Returns:
        True when every trainer module looks up ferry's offloader.
    """
    return _patch.installed(_WHERE, TRAINER_MODULES, _NAME)
