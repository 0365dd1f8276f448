"""One name in other packages' modules replaced by ferry's and put back: what each
integration's ``install()`` and ``uninstall()`` do.

ferry keeps no state of its own for it: the value it sets carries the value it replaced
(``__wrapped__``) and the integration that set it (``_ferry_integration``), so the patched
module itself tells what to restore.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any


def theirs(value: Any, where: str) -> Any:
    """``value`` when it is not ``where``'s, else the value ``where``'s install replaced."""
    while getattr(value, "_ferry_integration", None) == where:
        value = value.__wrapped__
    return value


def install(
    where: str, modules: Sequence[str], name: str, make: Callable[[Any], Callable[..., Any]]
) -> None:
    """Sets ``name`` in each of ``modules`` (importing them) to ``make(their value)``; an earlier
    install of ``where`` is replaced, its module's own value kept.

    Raises:
        ImportError: A module cannot be imported or has no ``name``; nothing is changed.
    """
    found = []
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ImportError(
                f"{where}.install(): {module_name} cannot be imported: {error}"
            ) from error
        if not hasattr(module, name):
            raise ImportError(
                f"{where}.install(): {module_name} has no {name}: not a version ferry knows "
                '(docs/real.md, "Migrating" names the versions)'
            )
        found.append(module)
    for module in found:
        own = theirs(getattr(module, name), where)
        ours = make(own)
        ours.__wrapped__ = own
        ours._ferry_integration = where
        setattr(module, name, ours)


def uninstall(where: str, modules: Sequence[str], name: str) -> None:
    """Puts back the value ``where``'s install replaced in each of ``modules`` where the name
    still holds ``where``'s (a value set since by anyone else stays)."""
    for module_name in modules:
        module = sys.modules.get(module_name)  # not imported: nothing was installed
        if module is not None and hasattr(module, name):
            setattr(module, name, theirs(getattr(module, name), where))


def installed(where: str, modules: Sequence[str], name: str) -> bool:
    """Whether ``name`` holds ``where``'s value in every one of ``modules``."""
    for module_name in modules:
        module = sys.modules.get(module_name)
        value = getattr(module, name, None) if module is not None else None
        if getattr(value, "_ferry_integration", None) != where:
            return False
    return True


def merged(theirs: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The trainer's arguments with ``install()``'s options over them (``min_bytes``, ferry's
    name for ``min_offload_size``, given as the latter)."""
    options = dict(options)
    if "min_bytes" in options:
        options["min_offload_size"] = options.pop("min_bytes")
    return {**theirs, **options}
