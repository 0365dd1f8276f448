"""A ferry region: an entry on ferry's region stack and a pair of hooks on torch's stack of
saved-tensor hooks, entered and left together (Note [Regions on two stacks]). ``offload`` and
``no_offload`` are regions; ``no_offload`` is defined here, below the plan application that
uses it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from typing_extensions import Self

from . import _C

# Note [Regions on two stacks]
# A region is an entry on ferry's region stack (C++, per thread: what _C._pack does with a saved
# tensor) and a pair of hooks on torch's stack of saved-tensor hooks (per thread: who packs at
# all). Both must hold the same open regions in the same order, whatever the caller does, or a
# later pack goes to a region that was left (a selective checkpoint offloading into a closed
# session, say). So the open entries of this thread are listed here, each with the hook object
# it pushed on torch's stack (a partial made for it: its identity finds the entry again), and
# __exit__ removes its own entry from both stacks even when it is not the innermost one:
# torch's hooks above it are popped and pushed back, and ferry's entry is removed where it is
# (_C._remove, by its position among this thread's regions). Leaving out of order still raises
# "regions must nest", after the cleanup.
_open = threading.local()


class _Entry:
    """An open region on this thread: the region and the pack hook it pushed on torch's stack."""

    __slots__ = ("region", "pack")

    def __init__(self, region: Region, pack: Callable[[torch.Tensor], Any]) -> None:
        self.region = region
        self.pack = pack


def _entries() -> list[_Entry]:
    """This thread's open regions, innermost last."""
    entries = getattr(_open, "entries", None)
    if entries is None:
        entries = _open.entries = []
    return entries


def _remove_hooks(pack: Callable[[torch.Tensor], Any]) -> bool:
    """Removes the hooks whose pack is ``pack`` from torch's stack, keeping the ones above it.
    Returns whether they were the innermost."""
    autograd = torch._C._autograd
    above = []
    try:
        while True:
            top = autograd._top_saved_tensors_default_hooks(True)
            if top is None:
                return False  # someone else popped them
            autograd._pop_saved_tensors_default_hooks()
            if top[0] is pack:
                return not above
            above.append(top)
    finally:
        for hooks in reversed(above):
            autograd._push_saved_tensors_default_hooks(*hooks)


class Region(saved_tensors_hooks):
    """A ferry region: its entry on ferry's region stack and its hooks on torch's stack of
    saved-tensor hooks (whose pack and unpack are ferry's), entered and left together.

    Leaving a region that is not the innermost raises "regions must nest", and the region is
    gone from both stacks all the same; leaving one that is not open on this thread raises
    without touching either. Entered while torch's ``allow_mutation_on_saved_tensors`` is on, a
    region saves tensors through the hooks in effect when it is entered (that mode's), so that
    a mutated saved tensor is cloned first, as without ferry."""

    _kind: str | None = None

    def _push(self, nested: bool) -> None:
        """Opens the region on ferry's stack; ``nested``: it is open on this thread already."""
        raise NotImplementedError

    def _hooks(self) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
        """The pack and unpack hooks of an entry starting now."""
        if torch.autograd.graph._allow_mutation_on_saved_tensors_enabled:
            top = torch._C._autograd._top_saved_tensors_default_hooks(True)
            if top is not None:
                return top
        return self.pack_hook, self.unpack_hook

    def _open_count(self) -> int:
        """How many times the region is open on this thread (entered again while open, it
        nests, as torch's saved-tensor hooks do)."""
        return sum(1 for e in _entries() if e.region is self)

    def _open_entry(self) -> _Entry:
        """This region's innermost open entry on this thread; raises when there is none."""
        for entry in reversed(_entries()):
            if entry.region is self:
                return entry
        raise RuntimeError(
            "ferry: regions must nest: the region being closed is not open on this thread "
            "(left twice, or entered on another thread)"
        )

    def __enter__(self) -> Self:
        entries = _entries()
        nested = self._open_count() > 0
        pack, unpack = self._hooks()
        pack = functools.partial(pack)  # this entry's own object: see Note [Regions on two stacks]
        self._push(nested)
        try:
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
        except BaseException:
            _C._pop(self._kind)
            raise
        entries.append(_Entry(self, pack))
        return self

    def __exit__(self, *exc: object) -> None:
        entry = self._open_entry()
        entries = _entries()
        innermost = False
        try:
            innermost = _remove_hooks(entry.pack) and entries[-1] is entry
        finally:
            _C._remove(self._kind, entries.index(entry))
            entries.remove(entry)
        if not innermost:
            raise RuntimeError(
                "ferry: regions must nest: the region being closed is not the innermost one "
                "(it was closed all the same)"
            )


class no_offload(Region):
    """Inside an offload region: the saved tensors of ops run inside it are kept as they are."""

    _kind = "no_offload"

    def __init__(self) -> None:
        super().__init__(_C._pack, _C._unpack)

    def _push(self, nested: bool) -> None:
        _C._push_no_offload()
