#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job: `ferry compare` on the built-in
# default (Llama-3-8B-like at sequence 8192 on an H100 with PCIe Gen5): step time and peak
# memory of no offload, the reference offloader (trl) and ferry, with knob variants.
# Arguments are passed on to ferry (e.g. `scripts/run.sh simulate --policy trl`,
# `scripts/run.sh check scenarios/programs/reload_without_wait.json`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target ferry
if [[ $# -eq 0 ]]; then
  set -- compare
fi
exec ./build/release/sim/ferry "$@"
