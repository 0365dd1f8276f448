#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: `ferry check` on the bundled
# simulated training step (forward with offload, backward with reload), writing its trace.
# Extra arguments go to `ferry check` (e.g. a program path, --json).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target ferry
if [[ $# -eq 0 ]]; then
  set -- scenarios/programs/offload_step.json --trace build/offload_step.trace.json
fi
exec ./build/release/sim/ferry check "$@"
