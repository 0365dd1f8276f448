"""The reference offloader's names (TRL's ``activation_offloading`` module), for existing
scripts: ``OffloadActivations``, ``NoOpManager`` and ``get_act_offloading_ctx_manager``."""

from __future__ import annotations

from typing import Any

import torch

from .._offload import no_offload, offload, offload_model


class OffloadActivations(offload):
    """``offload`` under the reference's name and signature.

    The scheduler is ferry's unless ``policy="trl"`` asks for the reference's own.

    Args:
        use_pin_memory: Host copies are always pinned: False is refused.
        use_streams: False: the copies run on the compute stream.
        min_offload_size: Saved tensors under this many bytes stay.
        max_fwd_stash_size: The reference's forward stash (``policy="trl"``).
        **options: Other ``offload`` options.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_size: int = 1024,
        max_fwd_stash_size: int = 5,
        **options: Any,
    ) -> None:
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
    model: torch.nn.Module,
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_size: int = 1024,
    max_fwd_stash_size: int = 5,
    warn_if_no_head: bool = True,
    **options: Any,
) -> offload:
    """``offload_model`` under the reference's name and signature.

    Args:
        model: The model whose activations are offloaded.
        use_pin_memory: Host copies are always pinned: False is refused.
        use_streams: False: the copies run on the compute stream.
        min_offload_size: Saved tensors under this many bytes stay.
        max_fwd_stash_size: The reference's forward stash (``policy="trl"``).
        warn_if_no_head: Warn when no output head is found.
        **options: Other ``offload`` options.

    Returns:
        The ``offload`` region to enter around each forward.
    """
    return offload_model(
        model,
        warn_if_no_head=warn_if_no_head,
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_size=min_offload_size,
        max_fwd_stash_size=max_fwd_stash_size,
        **options,
    )
