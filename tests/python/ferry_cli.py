"""The one way the tests find the `ferry` CLI binary: as `python -m ferry` finds it (FERRY_CLI,
then the package's own copy, then PATH; CI sets FERRY_CLI)."""

import os

import pytest

import ferry._sim as sim

#: The repository's root (scenarios, scripts).
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def cli_or_none():
    """The CLI's path, or None where there is none."""
    try:
        return sim.find_cli()
    except sim.CliNotFound:
        return None


def cli():
    """The CLI's path; the calling test is skipped, naming every place searched, where there is
    none."""
    try:
        return sim.find_cli()
    except sim.CliNotFound as e:
        pytest.skip(f"no ferry CLI: {e}")
