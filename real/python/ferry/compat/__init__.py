"""Other libraries' names and entry points, done by ferry: TRL's activation offloading names
(``trl``) and Hugging Face models' gradient checkpointing (``hf``). ``ferry`` re-exports them."""

from .hf import enable_gradient_checkpointing, gradient_checkpointing_offload
from .trl import NoOpManager, OffloadActivations, get_act_offloading_ctx_manager

__all__ = [
    "OffloadActivations",
    "NoOpManager",
    "get_act_offloading_ctx_manager",
    "enable_gradient_checkpointing",
    "gradient_checkpointing_offload",
]
