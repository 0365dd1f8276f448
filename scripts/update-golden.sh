#!/usr/bin/env bash
# Rewrites tests/golden/expected/ from the current build. Review the diff before committing.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release --target golden_programs
FERRY_UPDATE_GOLDEN=1 ./build/release/tests/golden_programs
rm -f tests/golden/expected/*.actual
git status --short tests/golden/expected
