#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test (labels unit, prop, golden,
# bench-smoke). Usage: scripts/test.sh [PRESET]   (release by default; ci adds -Werror;
# asan builds with AddressSanitizer + UndefinedBehaviorSanitizer and skips bench-smoke).
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
scripts/setup.sh
cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset"
# More random cases than RapidCheck's default 100 per property.
export RC_PARAMS=${RC_PARAMS:-max_success=500}
ctest --preset "$preset" -j2
