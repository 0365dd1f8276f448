"""`python -m ferry COMMAND [ARGS...]`: the `ferry` command line and the package's own commands.

The simulator's commands (check, simulate, compare, ...) are the `ferry` CLI binary's: this
process becomes that binary (exec), so their output and exit code are the binary's own. The
binary is $FERRY_CLI when set, else the one the package ships (ferry/bin/ferry, copied from the
CMake build at install), else `ferry` on PATH. Commands written in Python are named in
PYTHON_COMMANDS and offered only when their module is installed.

Exit codes: a command's own; 2 for a missing or unknown command; 127 when the CLI binary is
needed and not found.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from .._sim import CliNotFound, find_cli

# name -> "module:function"; function(argv: list[str]) -> int, argv without the command's name.
# Imported only to run the command; listed only when the module can be found. A name here comes
# before a CLI command of the same name.
PYTHON_COMMANDS = {
    "trace": "ferry._cli.trace:main",
    "probe": "ferry._cli.probe:main",
    "validate": "ferry._cli.validate:main",
    "auto": "ferry._cli.auto:main",
}

EXIT_USAGE = 2
EXIT_NO_CLI = 127  # what a shell answers for a command it cannot find


def cli_commands(cli: str) -> list[tuple[str, str]]:
    """The CLI's subcommands as (name, summary) pairs, from `ferry --commands` (JSON)."""
    out = subprocess.run([cli, "--commands"], capture_output=True, text=True, check=False)
    try:
        listed = json.loads(out.stdout)
        return [(c["name"], c["summary"]) for c in listed["commands"]]
    except (ValueError, KeyError, TypeError):
        raise RuntimeError(
            f"python -m ferry: {cli} --commands gave no command list (exit {out.returncode}): "
            f"{out.stderr.strip()[-500:]}"
        ) from None


def _module_of(spec: str) -> str:
    return spec.partition(":")[0]


def python_commands() -> list[tuple[str, str]]:
    """The commands of PYTHON_COMMANDS whose module is installed, as (name, summary) pairs; the
    summary is the first line of the module's docstring, read without importing it."""
    commands = []
    for name, spec in PYTHON_COMMANDS.items():
        try:
            found = importlib.util.find_spec(_module_of(spec))
        except ImportError:  # a parent package that is missing
            found = None
        if found is None:
            continue
        summary = ""
        if found.origin and found.origin.endswith(".py"):
            with open(found.origin, encoding="utf-8") as f:
                doc = ast.get_docstring(ast.parse(f.read())) or ""
            summary = doc.strip().splitlines()[0] if doc.strip() else ""
            # "`python -m ferry NAME`: what it does" says the name twice in a listing.
            summary = re.sub(r"^`*python -m ferry \S+?`*:\s*", "", summary)
        commands.append((name, summary))
    return commands


def _table(commands: list[tuple[str, str]], width: int) -> str:
    return "".join(f"  {name:<{width}}{summary}".rstrip() + "\n" for name, summary in commands)


def usage() -> str:
    """The text of `python -m ferry --help`."""
    try:
        cli = find_cli()
        theirs, heading = cli_commands(cli), f"Commands of the ferry CLI ({cli}):"
    except CliNotFound as e:
        theirs, heading = [], f"Commands of the ferry CLI: none, {e}"
    ours = python_commands()
    width = max((len(name) for name, _ in theirs + ours), default=0) + 2
    text = f"usage: python -m ferry COMMAND [ARGS...]\n\n{heading}\n" + _table(theirs, width)
    if ours:
        text += "\nCommands of the Python package:\n" + _table(ours, width)
    return text + "\n`python -m ferry COMMAND --help` describes one command.\n"


def _run_python(spec: str, argv: list[str]) -> int:
    module, _, function = spec.partition(":")
    code = getattr(importlib.import_module(module), function)(argv)
    return 0 if code is None else code


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit code (a CLI command replaces this process)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        sys.stderr.write(usage())
        return EXIT_USAGE
    name, rest = argv[0], argv[1:]
    if name in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0
    if name == "--version":
        from .._version import __version__

        print(f"ferry {__version__}")
        return 0
    ours = dict(python_commands())
    if name in ours:
        return _run_python(PYTHON_COMMANDS[name], rest)
    try:
        cli = find_cli()
    except CliNotFound as e:
        print(
            f"python -m ferry: '{name}' is no command of the Python package, and {e}",
            file=sys.stderr,
        )
        return EXIT_NO_CLI
    known = [n for n, _ in cli_commands(cli)]
    if name not in known:
        print(
            f"python -m ferry: unknown command '{name}' (commands: "
            f"{', '.join(known + sorted(ours))}; see python -m ferry --help)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(cli, [cli, name, *rest])
