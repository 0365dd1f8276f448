"""The package has one install route, the top-level pyproject.toml (scikit-build-core over the
CMake project); scripts/package.sh takes it from an existing build. The installed package is
whole (every subpackage, both extensions, the CLI and the scenarios, nothing the sources no
longer have), and a configuration that cannot give it is refused by name."""

import os
import shutil
import subprocess
import sys

import pytest

import ferry

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SOURCE = os.path.join(REPO, "real", "python", "ferry")
INSTALLED = os.path.dirname(os.path.abspath(ferry.__file__))


def packages_under(root):
    return {
        os.path.relpath(folder, root)
        for folder, _, files in os.walk(root)
        if "__init__.py" in files and "__pycache__" not in folder
    }


def modules_under(root):
    return {
        os.path.relpath(os.path.join(folder, name), root)
        for folder, _, files in os.walk(root)
        if "__pycache__" not in folder
        for name in files
        if name.endswith(".py")
    }


def test_the_installed_package_is_the_sources_whole_and_no_more():
    assert INSTALLED != SOURCE, "ferry is imported from its sources, not from an install"
    assert {".", "_plan", "_trace", "_cli"} <= packages_under(SOURCE)
    assert modules_under(INSTALLED) == modules_under(SOURCE)
    assert not os.path.exists(os.path.join(INSTALLED, "_plan.py"))


def test_the_installed_package_holds_both_extensions_the_cli_and_the_scenarios():
    names = os.listdir(INSTALLED)
    assert any(n.startswith("_C.") and n.endswith(".so") for n in names), names
    assert any(n.startswith("_simulator.") and n.endswith(".so") for n in names), names
    cli = os.path.join(INSTALLED, "bin", "ferry")
    assert os.access(cli, os.X_OK)
    assert os.path.isdir(os.path.join(INSTALLED, "scenarios", "devices"))
    out = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


def test_a_configuration_without_the_modules_is_refused_by_name(tmp_path):
    """What scikit-build-core configures (SKBUILD set) without the real backend cannot give the
    package: CMake stops and says so, before anything is built."""
    if shutil.which("cmake") is None:
        pytest.fail("cmake is not on PATH (scripts/setup.sh installs it)")
    out = subprocess.run(
        ["cmake", "-S", REPO, "-B", str(tmp_path / "build"), "-DSKBUILD=2", "-DFERRY_REAL=OFF"]
        + ["-DFERRY_BUILD_TESTS=OFF", "-DFERRY_BUILD_BENCH=OFF"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "the Python package needs the modules ferry._C and ferry._simulator" in out.stderr


@pytest.mark.parametrize("build", ["missing", "empty"])
def test_package_script_refuses_a_folder_that_is_not_a_build(tmp_path, build):
    folder = tmp_path / "build"
    if build == "empty":
        folder.mkdir()
    out = subprocess.run(
        [os.path.join(REPO, "scripts", "package.sh"), str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, FERRY_PYTHON=sys.executable),
    )
    assert out.returncode == 2
    assert f"package: {folder} has no CMakeCache.txt" in out.stderr
