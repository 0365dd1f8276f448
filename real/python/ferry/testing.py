"""Test-only helpers: offload regions with faults planted on purpose (a dropped synchronization,
a breach of the saved-tensor contract), so that a test can show that `ferry check` or a
property catches each one. Not for training."""

import contextlib

from . import _C
from ._offload import offload

__all__ = ["FAULTS", "PLAN_FAULTS", "planted_offload", "current_stream"]

#: The synchronizations a fault can drop (see ferry/offload/faults.hpp).
FAULTS = (
    "skip_offload_wait",
    "skip_reload_wait",
    "skip_forward_guard",
    "skip_backward_guard",
    "skip_record_stream",
    "skip_host_guard",
    "skip_exit_sync",
    # Breaches of the saved-tensor contract (Note [Saved-tensor contract]).
    "dedup_across_versions",
    "skip_version_check",
    "drop_view_bits",
    # The compute stream fixed when the session was made (Note [The compute stream is the
    # current one]).
    "stale_compute_stream",
    # ferry's host pool reuses a pinned buffer before the reload that read it is done.
    "reuse_pinned_early",
    # A backward prefetches the tensors of every forward its session holds, later micro-batches'
    # first, not those of its own forward (Note [Nodes and backward passes] in
    # real/src/session.cpp).
    "prefetch_later_forwards",
)


#: The faults of ``offload(plan=...)`` itself: a region of a plan made under ``--tp`` offloads
#: a collective's output as the plan says, copied before the collective's wait (Note [A plan
#: for a rank's cut] in ``_plan/_run.py``).
PLAN_FAULTS = ("offload_collectives_early",)


class planted_offload(offload):
    """``ferry.offload(**options)`` whose scheduler drops the synchronizations named in
    ``faults`` (an iterable of names from ``FAULTS`` and ``PLAN_FAULTS``)."""

    def __init__(self, *, faults, **options):
        faults = tuple(faults)
        unknown = [f for f in faults if f not in FAULTS + PLAN_FAULTS]
        if unknown:
            raise ValueError(
                f"ferry.testing: unknown fault {unknown[0]!r}; known: {FAULTS + PLAN_FAULTS}"
            )
        self._faults = _C._Faults(**{f: True for f in faults if f in FAULTS})
        self._plan_faults = tuple(f for f in faults if f in PLAN_FAULTS)
        super().__init__(**options)

    def _make_session(self, options):
        return _C.Session(**options, faults=self._faults)


@contextlib.contextmanager
def current_stream(ctx, name):
    """Within the block, the loopback session of ``ctx`` (a ``ferry.offload`` with
    ``loopback=True``) has the compute stream ``name`` current, as ``with torch.cuda.stream(s)``
    has on a GPU: the packs and unpacks made meanwhile order the scheduler's copies after it and
    the recorded program writes the compute on it (Note [The compute stream is the current
    one]). The stream before is current again after the block. ``"compute"`` is the first."""
    previous = getattr(ctx, "_current_stream", "compute")
    ctx._session.set_current_stream(name)
    ctx._current_stream = name
    try:
        yield
    finally:
        ctx._session.set_current_stream(previous)
        ctx._current_stream = previous
