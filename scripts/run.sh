#!/usr/bin/env bash
# Installs what is missing, builds, and runs the main job on a model that does not fit its device
# without ferry (Llama-3-8B-like at sequence 16384 on an H100 with PCIe Gen5, 125 GiB of
# activations and weights against 79 GiB): `ferry compare` (step time and peak memory of no
# offload, the reference offloader (trl), ferry with knob variants, checkpointing), then
# `ferry plan` at the device's memory: the fastest keep / offload / recompute plan that fits.
# Arguments are passed on to ferry (e.g. `scripts/run.sh simulate --policy trl`,
# `scripts/run.sh check scenarios/programs/reload_without_wait.json`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build --preset release --target ferry
if [[ $# -eq 0 ]]; then
  ./build/release/sim/ferry compare --model llama3-8b-s16384
  echo
  exec ./build/release/sim/ferry plan --model llama3-8b-s16384
fi
exec ./build/release/sim/ferry "$@"
