#!/usr/bin/env bash
# Installs the `ferry` Python package from a CMake build that already exists, through the one
# install route, the top-level pyproject.toml (scikit-build-core), without compiling anything
# again: the build's own folder is scikit-build-core's build directory, configured again with
# the type and the test and benchmark switches it already has, so no compile flag changes.
# Usage: scripts/package.sh BUILD_DIR [PIP_INSTALL_OPTIONS...]
#   e.g. scripts/package.sh build/ci
#        scripts/package.sh build/dev --target /tmp/site --upgrade   (a private install)
# The build must have the real backend (-DFERRY_REAL=ON) and no sanitizer; a plain
# `pip install --no-build-isolation --no-deps .` configures a Release build of its own instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if (($# < 1)); then
  echo "usage: scripts/package.sh BUILD_DIR [PIP_INSTALL_OPTIONS...]" >&2
  exit 2
fi
build=$1
shift
cache=$build/CMakeCache.txt
if [[ ! -f $cache ]]; then
  echo "package: $build has no CMakeCache.txt: configure and build it first (README.md)" >&2
  exit 2
fi
# cache_value NAME DEFAULT: the build's value of a cache variable.
cache_value() {
  local value
  value=$(sed -n "s/^$1:[A-Z]*=//p" "$cache" | head -n 1)
  echo "${value:-$2}"
}
python=${FERRY_PYTHON:-$(cache_value FERRY_PYTHON .venv/bin/python)}
if ! "$python" -c "import scikit_build_core" >/dev/null 2>&1; then
  echo "package: $python has no scikit-build-core (scripts/setup.sh installs it)" >&2
  exit 2
fi
# The build's own ninja: another one (scikit-build-core prefers the newest it finds, such as the
# `ninja` wheel's) keeps its logs in another format and would compile everything again.
make_program=$(cache_value CMAKE_MAKE_PROGRAM ninja)
ninja_version=$("$make_program" --version 2>/dev/null | cut -d. -f1-3 || true)
ninja_pin=()
if [[ $ninja_version =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  ninja_pin=(-C "ninja.version===$ninja_version")  # the value: ==VERSION
fi
exec "$python" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
  --no-build-isolation --no-deps \
  -C "build-dir=$(realpath "$build")" \
  -C "cmake.build-type=$(cache_value CMAKE_BUILD_TYPE Release)" \
  -C "cmake.define.FERRY_BUILD_TESTS=$(cache_value FERRY_BUILD_TESTS ON)" \
  -C "cmake.define.FERRY_BUILD_BENCH=$(cache_value FERRY_BUILD_BENCH ON)" \
  -C "build.verbose=false" "${ninja_pin[@]}" \
  "$@" .
