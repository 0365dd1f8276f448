#!/usr/bin/env bash
# Builds the libFuzzer harnesses of tests/fuzz (clang, AddressSanitizer, UndefinedBehavior-
# Sanitizer) in build/fuzz and runs each for a bounded time on a fresh corpus seeded from
# tests/fuzz/corpus/<format>. A finding (crash, sanitizer report, leak, timeout) stops that
# harness, is written to build/fuzz/findings/<format>/ and fails the script.
# Usage: scripts/fuzz.sh [SECONDS per harness, default 60] [FORMAT...]   (model program device plan)
#        scripts/fuzz.sh --build [FORMAT...]   builds the harnesses and runs none (CI builds them
#        beside the set-up and the lint check, which leave a core idle)
# Replay one input: build/fuzz/tests/fuzz/fuzz_model FILE
set -euo pipefail
cd "$(dirname "$0")/.."
build_only=0
if [[ ${1:-} == --build ]]; then
  build_only=1
  shift
  set -- 0 "$@"
fi
seconds=${1:-60}
shift || true
formats=("$@")
if ((${#formats[@]} == 0)); then formats=(model program device plan); fi

build=build/fuzz
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="-O1 -gline-tables-only" -DFERRY_FUZZ=ON -DFERRY_WERROR=OFF -DFERRY_REAL=OFF \
  -DFERRY_BUILD_TESTS=OFF -DFERRY_BUILD_BENCH=OFF -DFERRY_UNITY_BUILD=ON >/dev/null
targets=()
for f in "${formats[@]}"; do targets+=("fuzz_$f"); done
cmake --build "$build" --target "${targets[@]}"
if ((build_only)); then exit 0; fi

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# One harness: runs FORMAT on a fresh corpus; non-zero on a finding.
fuzz_one() {
  local f=$1
  local corpus="$build/corpus/$f" findings="$build/findings/$f"
  rm -rf "$corpus"
  mkdir -p "$corpus" "$findings"
  echo "fuzz: $f for ${seconds} s" >&2
  # New inputs go to the fresh corpus; the checked-in seeds are read only.
  if ! "$build/tests/fuzz/fuzz_$f" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 \
      -max_len=16384 -print_final_stats=1 -dict="tests/fuzz/$f.dict" \
      -artifact_prefix="$findings/" "$corpus" "tests/fuzz/corpus/$f" 2>"$build/$f.log"; then
    echo "fuzz: $f found a problem (log $build/$f.log, input in $findings/)" >&2
    grep -E "^(==|SUMMARY|fuzz:|.*runtime error)" "$build/$f.log" | head -20 >&2 || true
    return 1
  fi
  grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$build/$f.log" >&2 || true
}

# Two harnesses at a time (each is one process on one core): half the wall time on two cores,
# the same fuzzing time per format.
status=0
for ((i = 0; i < ${#formats[@]}; i += 2)); do
  pids=()
  for f in "${formats[@]:i:2}"; do
    fuzz_one "$f" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
done
exit $status
