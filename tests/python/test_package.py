"""real/python/setup.py packages the CMake build's ferry._C: a build that cannot give it is
refused with a message naming the build and the way out, before anything is copied."""

import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def build_ext(tmp_path, build_dir):
    env = dict(os.environ, FERRY_BUILD_DIR=str(build_dir))
    return subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "real", "python", "setup.py"),
            "build_ext",
            "--build-lib",
            str(tmp_path / "lib"),
            "--build-temp",
            str(tmp_path / "temp"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_a_build_without_the_module_target_is_refused_by_name(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "CMakeCache.txt").write_text("FERRY_PYTHON:FILEPATH=/nowhere/bin/python\n")
    out = build_ext(tmp_path, build)
    assert out.returncode != 0
    assert f"the CMake build {build} has no target ferry_python" in out.stderr
    assert "-DFERRY_REAL=ON" in out.stderr and "FERRY_BUILD_DIR" in out.stderr
    assert not (tmp_path / "lib").exists()


def test_the_package_is_copied_whole_and_afresh(tmp_path):
    """``build_py`` copies every package under ferry/ (ferry._plan among them) and leaves
    nothing an earlier build copied that the sources no longer have (ferry/_plan.py)."""
    lib = tmp_path / "lib"
    (lib / "ferry").mkdir(parents=True)
    (lib / "ferry" / "_plan.py").write_text("stale = True\n")
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "real", "python", "setup.py"), "build_py"]
        + ["--build-lib", str(lib)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    source = os.path.join(REPO, "real", "python", "ferry")
    packages = {
        os.path.relpath(root, source)
        for root, _, files in os.walk(source)
        if "__init__.py" in files and "__pycache__" not in root
    }
    assert {".", "_plan", "_trace", "_cli"} <= packages
    for package in packages:
        assert (lib / "ferry" / package / "__init__.py").exists(), package
    assert (lib / "ferry" / "_plan" / "_run.py").exists()
    assert not (lib / "ferry" / "_plan.py").exists()
