#!/usr/bin/env bash
# Checks Note [Runs the sanitizers cover] (tests/CMakeLists.txt): the tests labelled
# sanitizer-covered, which the asan preset leaves out, run no line of the project that the tests
# it runs do not run too. Builds the C++ suites with clang's source coverage in build/coverage
# (without LibTorch: its tests could only add lines to the rest), runs the tests labelled
# sanitizer-covered, then the asan preset's selection without them (the same random cases:
# RC_PARAMS=max_success=100), and lists each line of the project that only the labelled tests
# reach. Exits 1 when there is one. Not part of CI: 4 min 38 s on two cores from an empty
# build/coverage, 75 s once it is built.
# Usage: scripts/sanitizer_coverage.sh
set -euo pipefail
cd "$(dirname "$0")/.."
build=build/coverage
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=None \
  -DCMAKE_CXX_FLAGS="-O1 -fprofile-instr-generate -fcoverage-mapping" \
  -DCMAKE_EXE_LINKER_FLAGS=-fprofile-instr-generate -DFERRY_REAL=OFF -DFERRY_BUILD_BENCH=OFF \
  -DFERRY_WERROR=OFF -DFERRY_UNITY_BUILD=ON >/dev/null
cmake --build "$build"
profiles="$PWD/$build/profiles"
rm -rf "$profiles"
mkdir -p "$profiles/covered" "$profiles/rest"
export RC_PARAMS=max_success=100
LLVM_PROFILE_FILE="$profiles/covered/%p.profraw" \
  ctest --test-dir "$build" -j2 --output-on-failure -L sanitizer-covered
LLVM_PROFILE_FILE="$profiles/rest/%p.profraw" \
  ctest --test-dir "$build" -j2 --output-on-failure -LE "bench-smoke|exhaustive|sanitizer-covered"
# Every program the tests ran, as llvm-cov's objects.
objects=()
while IFS= read -r program; do
  objects+=(-object "$program")
done < <({ find "$build/tests" -maxdepth 2 -type f -perm -u+x \
             \( -name "unit_*" -o -name "prop_*" -o -name "golden_*" -o -name "fuzz_*" \)
           echo "$build/sim/ferry"; } | sort)
for part in covered rest; do
  llvm-profdata merge -sparse "$profiles/$part"/*.profraw -o "$profiles/$part.profdata"
  llvm-cov export -format=lcov -instr-profile="$profiles/$part.profdata" "${objects[@]:1}" \
    -ignore-filename-regex='(^/usr/|/tests/|/build/)' >"$profiles/$part.lcov" 2>/dev/null
done
python3 - "$profiles/covered.lcov" "$profiles/rest.lcov" <<'EOF'
import sys


def reached(path):
    """The lines with a count above zero, by source file."""
    lines, source = {}, None
    for line in open(path):
        if line.startswith("SF:"):
            source = line[3:].strip()
        elif line.startswith("DA:"):
            number, count = line[3:].split(",")[:2]
            if int(count) > 0:
                lines.setdefault(source, set()).add(int(number))
    return lines


covered, rest = reached(sys.argv[1]), reached(sys.argv[2])
only = {f: sorted(ls - rest.get(f, set())) for f, ls in covered.items()}
only = {f: ls for f, ls in only.items() if ls}
print(f"sanitizer-covered tests reach {sum(map(len, covered.values()))} lines; the rest of the "
      f"asan selection reaches {sum(map(len, rest.values()))}")
for f, ls in sorted(only.items()):
    print(f"only the sanitizer-covered tests reach {f}: lines {ls}")
sys.exit(1 if only else 0)
EOF
