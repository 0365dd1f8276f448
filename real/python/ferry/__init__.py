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
too). ``trace`` turns a training step into a ``ferry.model/1`` scenario; ``simulate``,
``compare`` and ``plan`` run the simulator and planner on it in this process; ``auto`` plans it
under a memory budget and applies the plan, ``validate`` checks the simulator's predictions
against real runs and ``probe`` measures the device. ``ferry.integrations`` switches trainers'
own offload flags to ferry (``ferry.integrations.trl.install()``).

This module only re-exports; each name lives in the module of its feature.
"""

# First: ferry._C carries no run path; the libraries it names are loaded with torch.
import torch as _torch  # noqa: F401

from . import (
    _C,  # noqa: F401
    integrations,  # noqa: F401
)
from ._auto import AutoOffload, auto
from ._checkpoint import checkpoint, checkpoint_sequential
from ._offload import no_offload, offload, offload_model
from ._plan import PlanError, load_plan
from ._probe import probe
from ._sim import Mesh, compare, plan, simulate
from ._trace import TracedModel, trace
from ._validate import ModelSpecError, validate
from ._version import __version__ as __version__
from .compat.hf import enable_gradient_checkpointing, gradient_checkpointing_offload
from .compat.trl import NoOpManager, OffloadActivations, get_act_offloading_ctx_manager

__all__ = [
    # Regions and checkpointing.
    "offload",
    "no_offload",
    "offload_model",
    "checkpoint",
    "checkpoint_sequential",
    # Trace, simulate, plan, validate, measure.
    "trace",
    "TracedModel",
    "simulate",
    "compare",
    "plan",
    "Mesh",
    "auto",
    "AutoOffload",
    "load_plan",
    "PlanError",
    "validate",
    "ModelSpecError",
    "probe",
    # Other libraries' names (ferry.compat).
    "OffloadActivations",
    "NoOpManager",
    "get_act_offloading_ctx_manager",
    "enable_gradient_checkpointing",
    "gradient_checkpointing_offload",
]
