"""Applies a ``ferry.plan/1`` to a real forward (``ferry.offload(plan=...)``, docs/plan.md).

A plan names the ops of a traced model (``ferry.trace``): ``<module path>/<aten op>#k``. The real
forward is named the same way while it runs (Note [Naming the real ops]), and each op is matched
to the plan's op of that name in forward order; the first op that differs is an error naming
both. Outside the plan's checkpoint regions, the tensors an op saves are kept or handed to the
offload session (Note [Which op is saving]); each region is the call of one module, checkpointed
by ``ferry.checkpoint`` with a selective policy per op (keep: saved, offload: offloaded through
the session, recompute: re-run in backward).

``_format`` reads and checks a plan (``load_plan``, ``CheckedPlan``, ``PlanError``), free of
torch; ``_layout`` finds the module whose call each region is; ``_run`` is ``PlanRun``, the
application itself; ``_cache`` copies a Hugging Face key/value cache for a region's replays.
The package's other modules import these names from here, except ``ferry._sim``, which needs
only ``_format``.
"""

from ._format import CheckedPlan, PlanError, load_plan, offload_options
from ._run import PlanRun

__all__ = ["CheckedPlan", "PlanError", "PlanRun", "load_plan", "offload_options"]
