"""Where the simulator is: the ``ferry`` CLI binary, which ``ferry.auto``, ``ferry validate``
and ``python -m ferry`` run."""

from __future__ import annotations

import os
import shutil

#: The CLI binary the package ships (copied from the CMake build at install).
PACKAGED_CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "ferry")


def _is_script(path: str) -> bool:
    """Whether the file at ``path`` is an interpreted script (``#!``), not the CLI binary."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


class CliNotFound(Exception):
    """The ``ferry`` CLI binary is not where FERRY_CLI, the package or PATH say."""


def find_cli() -> str:
    """The path of the ``ferry`` CLI binary.

    Returns:
        ``$FERRY_CLI`` when set, else the package's ``ferry/bin/ferry``, else ``ferry`` on
        ``PATH``.

    Raises:
        CliNotFound: None is there; the message names every place searched.
    """
    named = os.environ.get("FERRY_CLI")
    if named:
        if os.path.isfile(named) and os.access(named, os.X_OK):
            return named
        raise CliNotFound(f"FERRY_CLI={named} is not an executable file")
    if os.path.isfile(PACKAGED_CLI) and os.access(PACKAGED_CLI, os.X_OK):
        return PACKAGED_CLI
    on_path = shutil.which("ferry")
    # The package's own console script is named ferry too; it runs this function again.
    if on_path and not _is_script(on_path):
        return on_path
    raise CliNotFound(
        "the ferry CLI binary was not found: FERRY_CLI is not set, the package has no "
        f"{PACKAGED_CLI} (it ships one when installed from a CMake build that has the ferry "
        "target), and no `ferry` binary is on PATH"
    )
