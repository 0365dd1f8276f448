"""Packaging of the `ferry` Python package from the CMake build: nothing is compiled here.

    .venv/bin/pip install --no-build-isolation ./real/python

The package has two extensions, both CMake targets: `ferry._C`, the target `ferry_python`
(real/python/CMakeLists.txt), built over the same runtime objects as the C++ library and linked
to torch, and `ferry._simulator`, the target `ferry_simulator` (sim/python/CMakeLists.txt), the
simulator and planner, which links no torch. setup.py builds both targets in the CMake build
directory FERRY_BUILD_DIR (a relative path is taken from the repository root); unset, in
build/release when that is configured, else in build/python. A directory without a
CMakeCache.txt is configured first, for the package only (Release, no tests or benchmarks).
The modules are then copied into the package; when that build has the `ferry` CLI, it is
brought up to date and shipped too, as ferry/bin/ferry, which `python -m ferry` runs. The
copies are stripped of debug information (the build keeps it).
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
# Package paths below are relative to this directory, wherever setup.py is run from.
os.chdir(HERE)


def _version():
    # The one version number is the top-level CMakeLists.txt's project(ferry VERSION x.y.z): the
    # C++ package config, `ferry --version` and this package all read it.
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(ferry\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if match is None:
        raise RuntimeError("no project(ferry VERSION x.y.z) in the top-level CMakeLists.txt")
    return match.group(1)


def _build_dir():
    """FERRY_BUILD_DIR; else build/release once configured; else build/python."""
    named = os.environ.get("FERRY_BUILD_DIR")
    if named:
        return os.path.normpath(os.path.join(ROOT, named))
    release = os.path.join(ROOT, "build", "release")
    if os.path.exists(os.path.join(release, "CMakeCache.txt")):
        return release
    return os.path.join(ROOT, "build", "python")


def _run(cmd):
    print("ferry setup: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _cache_value(build_dir, name):
    """A variable of the build directory's CMakeCache.txt, or None."""
    with open(os.path.join(build_dir, "CMakeCache.txt"), encoding="utf-8") as f:
        for line in f:
            if line.startswith(name + ":"):
                return line.split("=", 1)[1].strip()
    return None


def _configure(build_dir):
    """Configures a new build directory for the package: this Python's torch, an optimized build
    without debug information, tests or benchmarks (the build's own preset folders keep those)."""
    try:
        import torch  # noqa: F401  (the configure step asks this Python for LibTorch)
    except ImportError:
        raise RuntimeError(
            f"ferry setup: configuring {build_dir} needs torch in {sys.executable}, the Python "
            "running setup.py, which has none (under pip's build isolation: install with "
            "--no-build-isolation), or a build of the CMake targets ferry_python and "
            "ferry_simulator named by FERRY_BUILD_DIR"
        ) from None
    cmd = [
        "cmake",
        "-S",
        ROOT,
        "-B",
        build_dir,
        "-DCMAKE_BUILD_TYPE=Release",
        "-DFERRY_REAL=ON",
        f"-DFERRY_PYTHON={sys.executable}",
        "-DFERRY_BUILD_TESTS=OFF",
        "-DFERRY_BUILD_BENCH=OFF",
    ]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    _run(cmd)


def _strip_copy(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(src, dst)
    strip = shutil.which("strip")
    if strip and sys.platform.startswith("linux"):
        subprocess.run([strip, "--strip-debug", dst], check=True)


# The package's extensions: (module name, CMake target, the target's folder in the build).
_EXTENSIONS = {
    "ferry._C": ("ferry_python", os.path.join("real", "python")),
    "ferry._simulator": ("ferry_simulator", os.path.join("sim", "python")),
}


class FreshBuildPy(build_py):
    """Copies the package into setuptools' build folder afresh: a module that an earlier build
    copied there and the sources no longer have (ferry/_plan.py, now the package ferry/_plan/)
    would otherwise ship beside what replaced it. The extensions are copied in after this."""

    def run(self):
        shutil.rmtree(os.path.join(self.build_lib, "ferry"), ignore_errors=True)
        super().run()


class CMakeBuild(build_ext):
    """Builds ferry._C and ferry._simulator with CMake, in one build of both targets (and of the
    CLI), and copies each (and the CLI) where setuptools expects it."""

    def build_extensions(self):
        if shutil.which("cmake") is None:
            raise RuntimeError("ferry setup: cmake is not on PATH (scripts/setup.sh installs it)")
        build_dir = _build_dir()
        if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            _configure(build_dir)
        # CMake makes a folder for each target it generates; none means no module in this build.
        for target, folder in _EXTENSIONS.values():
            if not os.path.isdir(os.path.join(build_dir, folder, "CMakeFiles", target + ".dir")):
                raise RuntimeError(
                    f"ferry setup: the CMake build {build_dir} has no target {target}: configure "
                    "it with -DFERRY_REAL=ON, without sanitizers, for a Python with headers and "
                    "with pybind11 (its configure output names what is missing), or point "
                    "FERRY_BUILD_DIR at another build (a new folder is configured for the "
                    "package)"
                )
        cli = os.path.join(build_dir, "sim", "ferry")
        targets = [target for target, _ in _EXTENSIONS.values()]
        targets += ["ferry"] if os.path.exists(cli) else []
        jobs = os.environ.get("MAX_JOBS", "2")  # two cores are the norm on small build machines
        _run(["cmake", "--build", build_dir, "--target", *targets, "--parallel", jobs])

        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        for ext in self.extensions:
            _, folder = _EXTENSIONS[ext.name]
            module = os.path.join(build_dir, folder, ext.name.rpartition(".")[2] + suffix)
            if not os.path.exists(module):
                raise RuntimeError(
                    f"ferry setup: no {os.path.basename(module)} in {os.path.dirname(module)}: "
                    f"the build {build_dir} is for the Python "
                    f"{_cache_value(build_dir, 'FERRY_PYTHON')}, not {sys.executable}; set "
                    "FERRY_BUILD_DIR to a build for this one"
                )
            _strip_copy(module, self.get_ext_fullpath(ext.name))
        package = os.path.dirname(self.get_ext_fullpath("ferry._C"))
        shipped_cli = os.path.join(package, "bin", "ferry")
        if os.path.exists(cli):
            _strip_copy(cli, shipped_cli)
        elif os.path.exists(shipped_cli):  # left by an earlier build in setuptools' build folder
            os.remove(shipped_cli)


setup(
    name="ferry",
    version=_version(),
    description="ferry: activation offload and checkpointing for PyTorch autograd",
    # Every package under ferry/, found as the top-level pyproject.toml's wheel.packages does.
    packages=find_packages(include=["ferry", "ferry.*"]),
    # The model configs `python -m ferry trace` names, and the marker of an annotated package.
    package_data={"ferry": ["configs/*.json", "py.typed"]},
    ext_modules=[Extension(name, sources=[]) for name in _EXTENSIONS],
    cmdclass={"build_py": FreshBuildPy, "build_ext": CMakeBuild},
    python_requires=">=3.10",
    zip_safe=False,
)
