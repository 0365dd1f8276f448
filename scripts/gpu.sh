#!/usr/bin/env bash
# One command for a visit to a GPU machine (docs/validate.md, "Where a GPU is lent").
#
#   scripts/gpu.sh pack
#     Here, with the registries: gathers what the GPU machine lacks into build/gpu-pack/ (the
#     Debian packages of the build's dependencies as .deb files, unpacked there with dpkg -x;
#     the wheels of wheels=() below, none today) and prints the device call: its command and
#     the paths to carry.
#   scripts/gpu.sh run [--out DIR] [--rehearse] [--reuse-build DIR] [--jobs N] [--budget S]
#     There (or here with --rehearse): unpacks the pack into a private prefix, configures with
#     the machine's own torch (CUDA on where its wheel has it) against that prefix alone,
#     builds what the visit runs, then runs each step under its own time limit, writing
#     DIR/results.json, DIR/results.md, DIR/visit.log and DIR/parts.tgz (every step's part and
#     whole log) after every step, so that a visit cut short still returns what it measured.
#     Steps: the gpu-labelled C++ and Python tests,
#     `ferry probe` and the kernel figures, `python -m ferry validate`'s comparison of
#     predicted and measured peak memory and step time for three models under five policies,
#     and the offload benchmark (scripts/gpu_visit.py).
#     --rehearse: the same sequence on the CPU loopback device, the models shrunk, with the
#     system's copies of the packed packages hidden from CMake, then checks that the build
#     used the private prefix alone and that every step ran, in order, with every field.
#     --reuse-build DIR: build only the targets that prove the packed packages suffice
#     (configure, the packages' headers and libraries) and take the LibTorch programs and
#     modules from DIR, a build that already has them (CI's own, build/ci).
#     --budget S: the seconds the whole command may take (default 540, under the device's
#     600 s a command); each step's limit is cut to what is left.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
pack_dir=build/gpu-pack

# The Debian packages the build finds with find_package (CMakeLists.txt, tests/, bench/,
# sim/python/) and the shared libraries two of them link; the GPU image has none of them.
# googletest (GoogleTest's sources, a dependency of libgtest-dev) is not needed to build.
debs=(libfmt-dev libfmt9 nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
      libbenchmark-dev libbenchmark1debian librapidcheck-dev pybind11-dev)
# Wheels the GPU image lacks (docs/validate.md lists what the visit imports; the image has
# torch, transformers, pytest and numpy): none today. A name==version added here is
# downloaded for the image's Python 3.12 and installed there into the visit's site folder.
wheels=()

usage() {
  sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

pack() {
  rm -rf "$pack_dir"
  mkdir -p "$pack_dir/debs" "$pack_dir/wheels"
  if ! (cd "$pack_dir/debs" && apt-get download "${debs[@]}" >/dev/null 2>../apt.log); then
    echo "gpu pack: apt-get download failed; running apt-get update once and again" >&2
    apt-get update -qq -o Acquire::Retries=5 >&2
    (cd "$pack_dir/debs" && apt-get download "${debs[@]}" >/dev/null 2>../apt.log) || {
      cat "$pack_dir/apt.log" >&2
      exit 1
    }
  fi
  rm -f "$pack_dir/apt.log"
  if ((${#wheels[@]} > 0)); then
    .venv/bin/python -m pip download --quiet --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$pack_dir/wheels" "${wheels[@]}" >&2
  fi
  # What was packed, one line a file (name, bytes, sha256), sorted: the run checks it.
  (cd "$pack_dir" && find debs wheels -type f | LC_ALL=C sort | while read -r f; do
    printf '%s %s %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
  done) >"$pack_dir/MANIFEST"
  local bytes
  bytes=$(du -sb "$pack_dir" | cut -f1)
  if ((bytes >= 64 * 1024 * 1024)); then
    echo "gpu pack: $pack_dir is $bytes bytes, over the 64 MiB a device call carries" >&2
    exit 1
  fi
  echo "gpu pack: $pack_dir: $(wc -l <"$pack_dir/MANIFEST") files, $bytes bytes" \
       "(the device call carries up to 67108864)"
  echo "device call:"
  echo "  command: scripts/gpu.sh run --out \"\$OUT\""
  echo "  carry:   [\"$pack_dir\"]"
  echo "  timeout_s: 600"
}

# --- run ---------------------------------------------------------------------------------

out=""
rehearse=0
reuse=""
jobs=$(nproc)
budget=540
parse_run() {
  while (($# > 0)); do
    case $1 in
      --out) out=$2; shift 2 ;;
      --rehearse) rehearse=1; shift ;;
      --reuse-build) reuse=$2; shift 2 ;;
      --jobs) jobs=$2; shift 2 ;;
      --budget) budget=$2; shift 2 ;;
      *) echo "gpu run: unknown option $1 (see scripts/gpu.sh --help)" >&2; exit 2 ;;
    esac
  done
  if [[ -z $out ]]; then
    if ((rehearse)); then
      out=build/gpu-rehearsal${reuse:+-reuse}-results
    else
      out=build/gpu-results
    fi
  fi
  if [[ -n $reuse && ! -f $reuse/CMakeCache.txt ]]; then
    echo "gpu run: --reuse-build $reuse: no CMakeCache.txt there (build it first)" >&2
    exit 2
  fi
  if [[ ! $jobs =~ ^[1-9][0-9]*$ || ! $budget =~ ^[1-9][0-9]*$ ]]; then
    echo "gpu run: --jobs and --budget take positive integers" >&2
    exit 2
  fi
}

run() {
  parse_run "$@"
  local start=$SECONDS
  if ((rehearse)); then
    # Its own folder with --reuse-build, so that a full rehearsal may run beside it.
    work=$root/build/gpu-rehearsal${reuse:+-reuse}
  else
    work=$root/build/gpu-visit
  fi
  prefix=$work/prefix
  build=$work/build
  mkdir -p "$out" "$work"
  out=$(realpath "$out")
  logs=$work/logs
  rm -rf "$logs" "$work/parts" "$prefix" "$work/site"
  mkdir -p "$logs" "$work/parts"
  : >"$work/steps.tsv"
  : >"$out/visit.log"
  python=$(command -v python3)
  if ((rehearse)); then python=$root/.venv/bin/python; fi
  export PYTHONUNBUFFERED=1
  echo "gpu run: $( ((rehearse)) && echo rehearsal on the CPU loopback device || echo visit)," \
       "results in $out, budget ${budget} s, $jobs jobs" | tee -a "$out/visit.log"

  # step NAME LIMIT CMD...: runs CMD under `timeout`, its output in the step's log; records
  # NAME, status (ok, failed, timeout, skipped), seconds and limit; prints the time; then
  # assembles the results so far. A step's limit is cut to the budget left (less 20 s for the
  # last assembly); with under 10 s left it is skipped.
  step() {
    local name=$1 limit=$2 left status t0
    shift 2
    left=$((budget - (SECONDS - start) - 20))
    if ((left < limit)); then limit=$left; fi
    if ((limit < 10)); then
      printf '%s\tskipped\t0\t0\n' "$name" >>"$work/steps.tsv"
      echo "gpu run: step $name skipped: the budget is spent" | tee -a "$out/visit.log"
      assemble
      return 0
    fi
    t0=$SECONDS
    status=ok
    # A step of this script's own runs it again (`timeout` runs programs, not functions).
    if declare -F "$1" >/dev/null; then
      set -- "$root/scripts/gpu.sh" _fn "$work/state.sh" "$@"
    fi
    timeout --kill-after=5 "$limit" "$@" >"$logs/$name.log" 2>&1 || {
      local rc=$?
      if ((rc == 124 || rc == 137)); then status=timeout; else status=failed; fi
    }
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t0)) "$limit" >>"$work/steps.tsv"
    {
      echo "===== step $name: $status in $((SECONDS - t0)) s (limit $limit s) ====="
      tail -c 20000 "$logs/$name.log"
    } >>"$out/visit.log"
    echo "time: gpu $name $((SECONDS - t0)) s ($status, limit $limit s)" >&2
    assemble
  }
  assemble() {
    "$python" scripts/gpu_visit.py assemble --work "$work" --out "$out" \
      $( ((rehearse)) && echo --rehearse) >>"$logs/assemble.log" 2>&1 ||
      echo "gpu run: assembling the results failed (build/.../logs/assemble.log)" >&2
    # Every step's whole log and part, beside visit.log's tails.
    tar czf "$out/parts.tgz" -C "$work" parts logs steps.tsv 2>>"$logs/assemble.log" ||
      echo "gpu run: packing the parts and logs failed" >&2
  }

  # What the steps run again by `scripts/gpu.sh _fn STATE STEP` read.
  declare -p work prefix build python rehearse reuse jobs out logs >"$work/state.sh"
  step unpack 60 unpack_pack
  step configure 180 configure
  # The visit's build gets 420 s of its 16 cores; a full rehearsal here, on a few cores, what
  # the budget leaves.
  local build_limit=420
  if ((rehearse)) && [[ -z $reuse ]]; then build_limit=$budget; fi
  step build "$build_limit" build_targets
  # The visit's Python site: the package's sources with the modules of this build (or of
  # --reuse-build's), the CLI named by FERRY_CLI.
  make_site
  export PYTHONPATH=$work/site${site_extra:+:$site_extra} FERRY_CLI=$bin_dir/sim/ferry
  # The probe's defaults on the GPU; on the loopback device the small sizes of its ctest.
  local device=cuda scale=full probe_sizes=()
  if ((rehearse)); then
    device=cpu scale=rehearse probe_sizes=(--repeats 2 --bytes 1MiB --matmul 64x64x64)
  fi
  step gpu-ctest 90 "$bin_dir/tests/real/gpu_real" --gtest_output="json:$work/parts/gpu-ctest.json"
  step gpu-pytest 120 "$python" -m pytest -q -p no:cacheprovider -m gpu \
    --junitxml="$work/parts/gpu-pytest.xml" tests/python/test_gpu.py
  step probe 90 "$FERRY_CLI" probe --device "$device" --out "$work/parts/profile.json" \
    --report "$work/parts/probe-report.json" --name "probed-$device" --quiet "${probe_sizes[@]}"
  step kernels 60 "$python" scripts/gpu_visit.py kernels --work "$work" --scale "$scale"
  step validate 240 "$python" scripts/gpu_visit.py validate --work "$work" --scale "$scale"
  step bench 150 "$python" scripts/gpu_visit.py bench --work "$work" --scale "$scale"
  if ((rehearse)); then
    # The checks of the rehearsal: the build saw the prefix alone, every step ran in order and
    # wrote every field.
    step check 60 check_rehearsal
  fi
  assemble
  echo "gpu run: done in $((SECONDS - start)) s; $out/results.md:" | tee -a "$out/visit.log"
  cat "$out/results.md"
  if ((rehearse)); then
    grep -E '^(private prefix|[A-Za-z0-9_]+_DIR=|hidden from)' "$logs/configure.log"
    cat "$logs/check.log"
    grep -q $'^check\tok' "$work/steps.tsv" || {
      echo "gpu run: the rehearsal's checks failed (above)" >&2
      exit 1
    }
  fi
}

unpack_pack() {
  if [[ ! -f $pack_dir/MANIFEST ]]; then
    echo "no $pack_dir/MANIFEST: run scripts/gpu.sh pack here and carry $pack_dir"
    return 1
  fi
  # Every packed file is there, as packed.
  local f bytes sum
  while read -r f bytes sum; do
    [[ $(sha256sum "$pack_dir/$f" | cut -d' ' -f1) == "$sum" ]] || {
      echo "$pack_dir/$f is missing or differs from the pack's MANIFEST"
      return 1
    }
  done <"$pack_dir/MANIFEST"
  mkdir -p "$prefix"
  for f in "$pack_dir"/debs/*.deb; do
    echo "dpkg -x $f $prefix"
    dpkg -x "$f" "$prefix"
  done
  if compgen -G "$pack_dir/wheels/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$work/wheels" "$pack_dir"/wheels/*.whl
  fi
  echo "private prefix: $prefix"
  find "$prefix" -name '*onfig.cmake' -o -name '*-config.cmake' | LC_ALL=C sort
}

# The system's copies of the packed packages (installed here, absent there): the folders of
# their CMake configs, which --rehearse hides from find_package, and every file, which the
# rehearsal's check looks for in the build's dependencies.
system_files() {
  local p
  for p in "${debs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || continue
    dpkg -L "$p"
  done | while read -r f; do [[ -f $f ]] && echo "$f"; done | LC_ALL=C sort -u
}

configure() {
  local hide=()
  if ((rehearse)); then
    system_files >"$work/system-files.txt"
    local ignore
    ignore=$(grep -E '(Config|-config)\.cmake$' "$work/system-files.txt" | xargs -r -n1 dirname |
             LC_ALL=C sort -u | paste -sd';')
    # Every include folder the packages add to /usr/include, and /usr itself as a prefix.
    hide=("-DCMAKE_IGNORE_PATH=$ignore" "-DCMAKE_IGNORE_PREFIX_PATH=/usr")
    echo "hidden from find_package: $ignore"
  fi
  # The rehearsal configures from nothing; a visit's rerun on the same machine keeps the build.
  if ((rehearse)); then rm -rf "$build"; fi
  echo "private prefix: $prefix/usr"
  # Release, each source compiled on its own (FERRY_UNITY_BUILD off): on many cores the longest
  # chain of compiles is what takes the time, and a batch of eight sources is one long compile.
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_REAL=ON \
    -DFERRY_UNITY_BUILD=OFF -DFERRY_PYTHON="$python" -DCMAKE_PREFIX_PATH="$prefix/usr" \
    -DCMAKE_FIND_PACKAGE_PREFER_CONFIG=ON "${hide[@]}" | tee "$work/configure.out"
  # The visit is for the CUDA backend: a torch without CUDA there is a failed configure.
  if ((!rehearse)) && ! grep -q 'ferry: real backend ON (CUDA: ON)' "$work/configure.out"; then
    echo "configure: the real backend without CUDA (does $python's torch have CUDA?)"
    return 1
  fi
  # Where each package was found: under the prefix, or the configure fails.
  local var dir bad=0
  for var in fmt_DIR nlohmann_json_DIR CLI11_DIR GTest_DIR rapidcheck_DIR benchmark_DIR \
             pybind11_DIR; do
    dir=$(sed -n "s/^$var:[A-Z]*=//p" "$build/CMakeCache.txt")
    echo "$var=$dir"
    if [[ $dir != "$prefix"/* ]]; then
      echo "configure: $var is not under the private prefix $prefix"
      bad=1
    fi
  done
  grep -E '^(Torch_DIR|FERRY_PYTHON|_Python_INCLUDE_DIR)' "$build/CMakeCache.txt" || true
  # Both Python modules, or the Python steps cannot run (Python's headers, Python.h, missing?).
  if grep 'ferry: no Python module' "$work/configure.out"; then
    echo "configure: the Python modules cannot be built with $python (above)"
    bad=1
  fi
  return $bad
}

# The targets the visit runs: the CLI and the probe, the Python modules, the gpu suite. With
# --reuse-build, those that link the packed packages without LibTorch instead (the core's and
# the simulator's libraries under the CLI, a GoogleTest + RapidCheck test, a benchmark, the
# simulator's module over pybind11), the LibTorch ones coming from that build.
build_targets() {
  local targets=(ferry ferry-probe ferry_python ferry_simulator gpu_real)
  if [[ -n $reuse ]]; then
    targets=(prop_offloader_state bench_core
             real/CMakeFiles/ferry_real_runtime.dir/src/probe_cli.cpp.o
             sim/python/CMakeFiles/ferry_simulator.dir/bind_sim.cpp.o)
  fi
  echo "cmake --build $build -j $jobs --target ${targets[*]}"
  cmake --build "$build" -j "$jobs" --target "${targets[@]}"
  # Where the packages came from, as the compiler and the linker were told.
  echo "a compile and a link of ${targets[0]}, with the private prefix $prefix:"
  ninja -C "$build" -t commands "${targets[0]}" | grep -F -- "$prefix" | tail -n 2 |
    cut -c1-2000
  printf '%s\n' "${targets[@]}" >"$work/built-targets.txt"
}

make_site() {
  bin_dir=$build
  if [[ -n $reuse ]]; then bin_dir=$(realpath "$reuse"); fi
  mkdir -p "$work/site"
  cp -r real/python/ferry "$work/site/ferry"
  cp "$bin_dir"/real/python/_C*.so "$bin_dir"/sim/python/_simulator*.so "$work/site/ferry/" \
    2>>"$logs/site.log" || echo "gpu run: the modules are missing from $bin_dir" >&2
  site_extra=""
  if [[ -d $work/wheels ]]; then site_extra=$work/wheels; fi
}

check_rehearsal() {
  "$python" scripts/gpu_visit.py check --work "$work" --out "$out" --prefix "$prefix" \
    --build "$build" --system-files "$work/system-files.txt"
}

case ${1:-} in
  pack) shift; (($# == 0)) || usage; pack ;;
  run) shift; run "$@" ;;
  _fn) shift; source "$1"; shift; "$@" ;;
  *) usage ;;
esac
