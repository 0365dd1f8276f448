"""``ferry.offload`` and ``ferry.offload_model``: the regions whose saved tensors go through
ferry's scheduler (docs/real.md, "Python API"); ``ferry.no_offload`` is re-exported from
``_regions``."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
from typing_extensions import Self

from . import _C, _plan
from ._modules import head_of
from ._regions import Region, no_offload

__all__ = ["PlanSource", "no_offload", "offload", "offload_model"]

#: A ``ferry.plan/1``: a path to the file ``ferry plan --out`` writes, or the loaded dict.
PlanSource = str | os.PathLike[str] | Mapping[str, Any]

#: The axes of a rank's cut whose plans a real run refuses, and why (docs/real.md, "Plans under
#: tensor parallelism"). A plan made under ``--tp`` applies to the modules ``parallelize_module``
#: parallelized (Note [A plan for a rank's cut] in ``_plan/_run.py``).
_UNAPPLIED_AXES = {
    "cp": (
        "the cut all-gathers each attention's keys and values (its ops `.../cp.all_gather`), "
        "where torch's context_parallel (torch.distributed.tensor.experimental) rotates them "
        "inside ring attention, which it runs for CUDA's flash, efficient and cuDNN kernels "
        "only: a rank runs no exchange the plan's could be matched to. Make the plan without "
        "--cp"
    ),
    "ep": (
        "torch has no expert-parallel API (no parallel style sends each rank's routed rows to "
        "the ranks holding their experts, the cut's `.../ep.dispatch` and `.../ep.combine` "
        "all-to-alls): a rank runs no exchange the plan's could be matched to. Make the plan "
        "without --ep"
    ),
}


class offload(Region):
    """Offloads the saved tensors of the ops run inside it.

    The object is meant to be reused step after step (``with ctx:`` around each forward); it
    keeps one scheduler session, whose state can be read with ``telemetry()``, ``tracked()``,
    ``live_device_buffers()`` and ``live_host_buffers()``.

    Entered while ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is on, the region
    offloads nothing: its saved tensors go through that mode's hooks, which keep them and clone
    one before it is mutated, so backward sees the values of the forward, as without ferry (the
    same holds for ``no_offload`` and the head region of ``offload_model``). Entered again while
    it is open on the same thread, the region nests in itself, as torch's saved-tensor hooks
    do: the inner ``with`` saves through the same session and leaves the step to the outermost
    one, which begins it on entry and ends it on exit. Leaving regions out of order raises
    "regions must nest"; the region left is closed all the same.

    With ``plan``, a ``ferry.plan/1`` is applied: each op's saved tensors are kept or
    offloaded, and the plan's checkpoint regions recompute what it says (docs/plan.md,
    "Applying a plan"). Run the whole traced step, loss included, inside the region. A plan
    made under ``--tp`` applies to the modules ``parallelize_module`` parallelized, on each
    rank (docs/real.md, "Plans under tensor parallelism").

    Args:
        policy: ``"ferry"`` (ferry's scheduler), ``"trl"`` (a faithful model of the reference
            hook-based offloader as TRL ships it; ``"trl-seed"``: as first released;
            ``"trl-1.7"``: as TRL 1.0 to 1.7.1 released it) or
            ``"none"`` (keep everything).
        min_bytes: Saved tensors under this many bytes stay (default 1024).
        max_fwd_stash_size: The reference's forward stash (``"trl"``).
        min_offload_size: The reference's name for ``min_bytes``; give one of the two.
        use_streams: False: the copies run on the compute stream, in order with the kernels.
        use_pin_memory: Host copies are always pinned: False is refused.
        window_bytes: Tunes the ferry policy.
        prefetch_bytes: Tunes the ferry policy.
        host_cap: Tunes the ferry policy: the most pinned host bytes it holds.
        host_reserve_bytes: Pinning is refused when it would leave less than this much of the
            host's available memory (default 1 GiB): ferry then keeps the tensor on the device
            (counted in ``host_fallbacks``), trl raises.
        dedup: Tunes the ferry policy.
        prefetch: Tunes the ferry policy.
        horizon_bytes: The bytes one forward may copy out before the rest of its saved tensors
            stay on the device, as ``ferry compare`` derives it from the link (Note [Offload
            horizon]).
        loopback: Treat CPU tensors as device tensors (no GPU needed).
        loopback_streams: How the loopback device runs its streams: ``"sync"`` (the default:
            each copy at once on the host) or ``"async"`` (copies on worker threads with seeded
            delays, where a missing wait shows as NaN or wrong gradients; docs/real.md, "The
            asynchronous loopback device"). Needs ``loopback=True``.
        loopback_seed: With ``loopback_streams="async"``: the seed of the delays (default 0).
        loopback_max_delay_us: With ``loopback_streams="async"``: the longest delay in
            microseconds (default 1000, at most 1 s).
        record: Record the stream program for ``ferry check`` (see ``write_program``).
        profile: The device profile the session's decisions assume.
        plan: A ``ferry.plan/1`` to apply (a path or a loaded dict, as ``ferry plan --out``
            writes for a traced model). Its knobs are the defaults of the options above.
        model: With ``plan``: the model the plan was traced from (else the first module called
            inside the region is taken).

    Raises:
        TypeError: ``min_bytes`` and ``min_offload_size`` disagree, or ``model`` is given
            without ``plan``.
        ValueError: ``use_pin_memory=False``, or a bad option value.
        PlanError: The plan cannot be read or is not a valid ``ferry.plan/1``, or was made
            under ``--cp`` or ``--ep`` or with the paged stash.
    """

    _kind = "offload"

    def __init__(
        self,
        *,
        policy: str = "ferry",
        min_bytes: int | None = None,
        max_fwd_stash_size: int = 5,
        min_offload_size: int | None = None,
        use_streams: bool = True,
        use_pin_memory: bool = True,
        window_bytes: int | None = None,
        prefetch_bytes: int | None = None,
        host_cap: int | None = None,
        host_reserve_bytes: int | None = None,
        dedup: bool = True,
        prefetch: bool = True,
        horizon_bytes: int | None = None,
        loopback: bool = False,
        loopback_streams: Literal["sync", "async"] | None = None,
        loopback_seed: int | None = None,
        loopback_max_delay_us: int | None = None,
        record: bool = False,
        profile: str | None = None,
        plan: PlanSource | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self._plan_run = None
        if plan is not None:
            # Looked up in the module at each call: tests replace its functions.
            plan = _plan.load_plan(plan)
            mesh = plan.get("parallelism") or {}
            for axis, missing in _UNAPPLIED_AXES.items():
                if mesh.get(axis, 1) > 1:
                    raise _plan.PlanError(
                        f"ferry.offload(plan=...): parallelism.{axis}: the plan was made for one "
                        f"GPU's cut of the model under --{axis} {mesh[axis]}: {missing}"
                    )
            if plan.get("paged_stash"):
                raise _plan.PlanError(
                    "ferry.offload(plan=...): paged_stash: the paged stash of static-capacity "
                    "expert buffers is the simulator's (docs/parallelism.md); a real run applies "
                    "plans made without --expert-capacity"
                )
            fixed = _plan.offload_options(plan)
            if policy == "ferry":
                policy = fixed["policy"]
            min_bytes = fixed.get("min_bytes") if min_bytes is None else min_bytes
            window_bytes = fixed.get("window_bytes") if window_bytes is None else window_bytes
            if prefetch_bytes is None:
                prefetch_bytes = fixed.get("prefetch_bytes")
            host_cap = fixed.get("host_cap") if host_cap is None else host_cap
            prefetch = fixed.get("prefetch", prefetch)
            if horizon_bytes is None:
                horizon_bytes = fixed.get("horizon_bytes")
        elif model is not None:
            raise TypeError("ferry.offload: model= goes with plan=")
        if min_bytes is not None and min_offload_size is not None and min_bytes != min_offload_size:
            raise TypeError(
                "ferry.offload: min_bytes and min_offload_size name the same threshold; give one"
            )
        if not use_pin_memory:
            raise ValueError(
                "ferry.offload: use_pin_memory=False is not supported: ferry copies to pinned "
                "host memory only (pageable copies cannot overlap compute)"
            )
        if min_bytes is None:
            min_bytes = 1024 if min_offload_size is None else min_offload_size
        options = dict(
            policy=policy,
            min_bytes=min_bytes,
            use_streams=use_streams,
            max_fwd_stash_size=max_fwd_stash_size,
            dedup=dedup,
            prefetch=prefetch,
            loopback=loopback,
            record=record,
        )
        for name, value in (
            ("window_bytes", window_bytes),
            ("prefetch_bytes", prefetch_bytes),
            ("host_cap", host_cap),
            ("host_reserve_bytes", host_reserve_bytes),
            ("horizon_bytes", horizon_bytes),
            ("profile", profile),
            # How the loopback device runs its streams (Note [The asynchronous loopback device]).
            ("loopback_streams", loopback_streams),
            ("loopback_seed", loopback_seed),
            ("loopback_max_delay_us", loopback_max_delay_us),
        ):
            if value is not None:
                options[name] = value
        self._session = self._make_session(options)
        if plan is None:
            super().__init__(_C._pack, _C._unpack)
            return
        self._plan_run = _plan.PlanRun(plan, self, model)
        super().__init__(self._plan_run.pack, self._plan_run.unpack)

    @staticmethod
    def _make_session(options: dict[str, Any]) -> _C.Session:
        return _C.Session(**options)

    def _push(self, nested: bool) -> None:
        _C._push_offload(self._session, begin_step=not nested)

    def __enter__(self) -> Self:
        nested = self._open_count() > 0
        super().__enter__()
        if self._plan_run is not None and not nested:
            try:
                self._plan_run.enter()
            except BaseException:
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._open_entry()  # raises when it is not open, leaving the session alone
        if self._open_count() > 1:  # an inner entry: the outermost one ends the step
            super().__exit__(*exc)
            return
        try:
            if self._plan_run is not None and self._plan_run.active():
                self._plan_run.exit(failed=exc[0] is not None)
        finally:
            try:
                super().__exit__(*exc)
            finally:
                self._session._exit()

    def plan_counts(self) -> dict[str, int]:
        """What the last forward under ``plan=`` did, by the plan's decision.

        Returns:
            ``kept``, ``offloaded``: distinct tensors saved outside regions;
            ``saved_outputs``, ``offloaded_outputs``: region ops whose outputs were kept or
            offloaded; ``recomputed``: region ops re-run in backward so far; for a plan made
            under ``--tp``, ``collectives``: the cut's collectives the rank issued, each
            matched to the plan's (docs/real.md, "Plans under tensor parallelism").

        Raises:
            ValueError: The region was made without ``plan=``.
        """
        if self._plan_run is None:
            raise ValueError("ferry.offload: plan_counts() needs plan=")
        return self._plan_run.counts()

    def telemetry(self) -> dict[str, int]:
        """The scheduler's counters.

        Returns:
            The counters by name (bytes as ints).
        """
        return self._session.telemetry()

    def tracked(self) -> int:
        """Saved tensors the scheduler still tracks.

        Returns:
            Their number.
        """
        return self._session.tracked()

    def live_device_buffers(self) -> int:
        """Device storages the scheduler holds a reference to.

        Returns:
            Their number.
        """
        return self._session.live_device_buffers()

    def live_host_buffers(self) -> int:
        """Host buffers the scheduler holds (ferry's pool keeps them across steps).

        Returns:
            Their number.
        """
        return self._session.live_host_buffers()

    def program_json(self) -> str:
        """The recorded stream program.

        Returns:
            The ``ferry.program/1`` text; empty unless ``record=True``.
        """
        return self._session.program_json()

    def write_program(self, path: str | os.PathLike[str]) -> None:
        """Writes the recorded program to ``path``, for ``ferry check``.

        Args:
            path: The file to write.

        Raises:
            ValueError: Nothing was recorded (the region was made without ``record=True``).
        """
        text = self.program_json()
        if not text:
            raise ValueError("ferry.offload: nothing recorded; create it with record=True")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def update_model_params(self, model: torch.nn.Module) -> None:
        """Never offload ``model``'s parameters and buffers (frozen ones included).

        Args:
            model: The model whose tensors stay.
        """
        for p in model.parameters():
            self._session.exclude(p)
        for b in model.buffers():
            self._session.exclude(b)


def offload_model(
    model: torch.nn.Module, *, warn_if_no_head: bool = True, **options: Any
) -> offload:
    """An ``offload`` set up for ``model`` the way the reference offloader is used.

    Like TRL's ``get_act_offloading_ctx_manager``: parameters and buffers are excluded, and the
    output head (``output``, ``lm_head``, ``decoder.output``/``decoder.lm_head``,
    ``final_layer_norm``/``ln_f``, ``head``) runs in a no-offload region, since its activations
    are needed again right away. Use the result as ``with ctx: loss = model(x)``.

    Args:
        model: The model (a DDP, FSDP or PEFT wrapper is looked through for the head).
        warn_if_no_head: Warn when no output head is found.
        **options: ``offload``'s options.

    Returns:
        The ``offload`` region to enter around each forward.
    """
    ctx = offload(**options)
    ctx.update_model_params(model)
    head = head_of(model)
    if head is None:
        if warn_if_no_head:
            warnings.warn(
                "ferry.offload_model: no output head was detected; every saved tensor of the "
                "model is a candidate for offload, the last ones included",
                stacklevel=2,
            )
        return ctx
    region = no_offload()

    def enter(module: torch.nn.Module, args: object) -> None:
        region.__enter__()  # returns nothing: a pre-hook's result would replace the inputs

    def leave(module: torch.nn.Module, args: object, output: object) -> None:
        region.__exit__(None, None, None)  # returns nothing: the output stays

    head.register_forward_pre_hook(enter)
    head.register_forward_hook(leave, always_call=True)
    return ctx
