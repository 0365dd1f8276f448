#!/usr/bin/env bash
# Checks that every tracked C++ file is clang-formatted (.clang-format), that the scheduler core
# passes clang-tidy (.clang-tidy), that the Python (package, tests, scripts) passes ruff's
# lint and format check (ruff.toml), and that README.md and docs/ hold their word limits and
# resolve every relative link and anchor (scripts/docs_check.py). Exits non-zero on any finding; `--fix` reformats instead
# of checking the format. Needs clang-format, clang-tidy and .venv's ruff (scripts/setup.sh
# installs them).
set -euo pipefail
cd "$(dirname "$0")/.."
fix=0
if [[ ${1:-} == --fix ]]; then fix=1; fi
mapfile -t files < <(git ls-files '*.cpp' '*.hpp')
if ((fix)); then
  clang-format -i "${files[@]}"
  .venv/bin/ruff format --no-cache .
  .venv/bin/ruff check --no-cache --fix .
else
  # Two processes (the machine's cores), each checking a share of the files.
  # shellcheck disable=SC2016  # expanded by the inner shell
  mapfile -t unformatted < <(printf '%s\0' "${files[@]}" | xargs -0 -P2 -n 40 sh -c \
    'for f; do clang-format "$f" | cmp -s - "$f" || echo "$f"; done' sh | sort)
  if ((${#unformatted[@]} > 0)); then
    echo "lint: not clang-formatted (run scripts/lint.sh --fix): ${unformatted[*]}" >&2
    exit 1
  fi
fi
# The core's headers are templates mostly: one generated translation unit includes them all,
# so clang-tidy sees each header even where no .cpp of the core includes it.
lint_dir=$(mktemp -d)
trap 'rm -rf "$lint_dir"' EXIT
for h in $(git ls-files 'shared/include/*.hpp'); do
  echo "#include \"${h#shared/include/}\""
done > "$lint_dir/all_headers.cpp"
# One clang-tidy per translation unit, two at a time (the machine's cores); each one's output is
# kept in its own file and printed in the order of the files, whatever order they finish in.
units=("$lint_dir/all_headers.cpp")
mapfile -t -O 1 units < <(git ls-files 'shared/src/*.cpp')
status=0
for i in "${!units[@]}"; do printf '%s\0%s\0' "$i" "${units[$i]}"; done |
  xargs -0 -P2 -n 2 sh -c \
    'clang-tidy --quiet "$2" -- -std=c++20 -Ishared/include >"$0/tidy-$1.log" 2>&1' "$lint_dir" ||
  status=$?
for i in "${!units[@]}"; do grep -v "warnings generated" "$lint_dir/tidy-$i.log" >&2 || true; done
if ((status != 0)); then
  echo "lint: clang-tidy found problems in the core (above)" >&2
  exit 1
fi
if ! .venv/bin/ruff format --no-cache --check --quiet . || ! .venv/bin/ruff check --no-cache --quiet .; then
  echo "lint: ruff found problems in the Python (above; scripts/lint.sh --fix formats)" >&2
  exit 1
fi
if ! python3 scripts/docs_check.py; then
  echo "lint: the docs are over their word limits or have links that do not resolve (above)" >&2
  exit 1
fi
echo "lint: clang-format, clang-tidy, ruff and the docs check clean" >&2
