#!/usr/bin/env bash
# Installs what is missing, builds everything and runs every test: the C++ suites (labels unit,
# prop, golden, exhaustive, sanitizer-covered, bench-smoke, gpu), then the Python extension's
# pytest suite (the suites that train on the asynchronous loopback device again with two more
# seeds).
# Usage: scripts/test.sh [PRESET]   (release by default; ci adds -Werror; asan builds with clang,
# AddressSanitizer + UndefinedBehaviorSanitizer, including leak checks, and skips bench-smoke,
# exhaustive, sanitizer-covered (Note [Runs the sanitizers cover] in tests/CMakeLists.txt) and
# the Python suite). FERRY_TORCH=0 builds and tests the simulator only.
# Tests labelled gpu skip (and are reported as skipped) where no CUDA device is present.
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
# timed PART CMD...: runs CMD and prints its wall time on stderr (CI's time limit is shared by
# every part, so each part's share is printed).
timed() {
  local part=$1 start=$SECONDS
  shift
  "$@"
  echo "time: $preset $part $((SECONDS - start)) s" >&2
}
timed setup scripts/setup.sh
real=ON
if [[ ${FERRY_TORCH:-1} == 0 ]]; then real=OFF; fi
timed configure cmake --preset "$preset" -DFERRY_REAL=$real >/dev/null
timed build cmake --build --preset "$preset"
# More random cases than RapidCheck's default 100 per property; under the sanitizers, which are
# there for memory errors rather than coverage (the ci preset ran 500 cases of each property
# already), the default 100: the plan property alone takes 11 min of CPU at 500 under ASan.
if [[ $preset == asan ]]; then
  export RC_PARAMS=${RC_PARAMS:-max_success=100}
else
  export RC_PARAMS=${RC_PARAMS:-max_success=500}
fi
timed ctest ctest --preset "$preset" -j2
if [[ $preset == ci ]]; then
  # The installed package, used as another CMake project would: install to a prefix under build/,
  # then configure, build and run tests/consumer against it.
  consumer() {
    local prefix=build/ci-install
    rm -rf "$prefix" build/ci-consumer
    cmake --install build/ci --prefix "$prefix" >/dev/null
    cmake -S tests/consumer -B build/ci-consumer -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$PWD/$prefix" >/dev/null
    cmake --build build/ci-consumer
    build/ci-consumer/ferry_consumer scenarios/programs/offload_step.json scenarios/devices
  }
  timed consumer consumer
fi
if [[ $real == ON && $preset != asan ]]; then
  # The package, through its one install route (pyproject.toml), takes ferry._C,
  # ferry._simulator and the CLI from this preset's build (built above; nothing is compiled).
  echo "test: installing the Python package from build/$preset (scripts/package.sh)" >&2
  timed python-build scripts/package.sh "build/$preset"
  # Loopback sessions run on the asynchronous device (tests/python/conftest.py: FERRY_LOOPBACK
  # async:1 unless set); the suites that train on it run again with two more seeds.
  # Two workers (pytest-xdist), each with one intra-op thread (as the async runs below, for the
  # same reason: two processes with torch's default of a thread per core oversubscribe them).
  # Every test makes its own files under tmp_path and its own process group, so the workers
  # share nothing. Each module's tests go to one worker (--dist loadscope), so that a module's
  # fixtures (the traces of published set-ups, of each family) are made once: with tests dealt
  # one by one, both workers traced them (the published-row modules: 111 s and 141 s of CPU
  # against 80 s and 96 s). The 20 slowest tests are listed, where the suite's time goes.
  OMP_NUM_THREADS=1 FERRY_CLI="$PWD/build/$preset/sim/ferry" \
    timed pytest .venv/bin/python -m pytest -q -n 2 --dist loadscope --durations=20 tests/python
  real_suites=(offload checkpoint checkpoint_api hf_models distributed saved_contract
               current_stream async_loopback regions selective_offload trl_names threads autocast
               tensor_parallel pipeline_parallel
               compile auto_apply validate_layers unusual_uses)
  real_files=()
  for suite in "${real_suites[@]}"; do real_files+=("tests/python/test_$suite.py"); done
  # test_auto_apply plans each family at several budgets (the simulator's work, the same at
  # every seed) and applies each plan. At the extra seeds the applying is what is tested again:
  # one family of each kind keeps the whole test (a decoder, an encoder-decoder, a vision
  # model, MoE with grouped and with looped experts, MLA), and every family still runs its
  # random plans. (Test ids are relative to tests/python, where pytest.ini puts the root.)
  for family in llama-no-cache qwen2 mistral phi3 gemma2 gpt2 bert mixtral mixtral-bf16 \
      qwen3_moe qwen3_moe-bf16 deepseek_v3; do
    real_files+=(--deselect "test_auto_apply.py::test_auto_applies_every_plan_it_returns[$family]")
  done
  # The two seeds run side by side, each with one intra-op thread. With torch's default (one
  # OpenMP thread per core) two processes oversubscribe the cores: on two cores both took 319 s
  # side by side against 182 s one after the other; with one thread each, 99 s for both. These
  # runs test the asynchronous device's ordering, which does not depend on intra-op threads.
  # Each run's output is kept in its own log and printed when both have finished; either failing
  # fails the script.
  async_run() {
    local seed=$1 start=$SECONDS status=0
    OMP_NUM_THREADS=1 FERRY_LOOPBACK=async:$seed FERRY_CLI="$PWD/build/$preset/sim/ferry" \
      .venv/bin/python -m pytest -q -p no:cacheprovider "${real_files[@]}" \
      >"build/$preset/pytest-async-$seed.log" 2>&1 || status=$?
    echo "time: $preset pytest-async-$seed $((SECONDS - start)) s" \
      >>"build/$preset/pytest-async-$seed.log"
    return $status
  }
  start=$SECONDS
  pids=()
  for seed in 2 3; do
    async_run "$seed" &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for seed in 2 3; do
    echo "test: the asynchronous device at seed $seed" >&2
    cat "build/$preset/pytest-async-$seed.log" >&2
  done
  echo "time: $preset pytest-async $((SECONDS - start)) s" >&2
  if ((status != 0)); then exit "$status"; fi
fi
