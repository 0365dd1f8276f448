"""ferry's version, ``ferry.__version__``: the installed distribution's (pyproject.toml takes
it from the top-level CMakeLists.txt, ferry's one version), or "unknown" in a source tree."""

import importlib.metadata as _metadata

try:
    __version__ = _metadata.version("ferry")
except _metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "unknown"
