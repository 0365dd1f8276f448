"""Trainers' own activation-offloading flags switched to ferry: ``trl`` (TRL's trainers'
``activation_offloading``), ``torchtune`` (its recipes' ``enable_activation_offloading``) and
``accelerate`` (FSDP2's ``activation_checkpointing`` and ``activation_checkpointing_offload``),
each with ``install()``, ``uninstall()`` and ``installed()``. The trainer packages are imported
by ``install()`` only: ferry does not depend on them. (transformers' own offload flag needs no
install: ``ferry.enable_gradient_checkpointing``.)"""

from . import accelerate, torchtune, trl

__all__ = ["trl", "torchtune", "accelerate"]
