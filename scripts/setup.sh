#!/usr/bin/env bash
# Installs the build dependencies that are missing; does nothing when all are present:
# Debian packages, then LibTorch for the real backend (the PyPI torch wheel, in the project's
# .venv). FERRY_TORCH=0 skips LibTorch: the simulator-only build needs none of it.
set -euo pipefail
cd "$(dirname "$0")/.."

# clang and libclang-rt-dev: the libFuzzer harnesses (scripts/fuzz.sh). pybind11-dev: the
# simulator's Python module (sim/python/).
packages=(cmake ninja-build g++ clang-format clang-tidy libfmt-dev nlohmann-json3-dev
          libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev librapidcheck-dev
          clang libclang-rt-dev pybind11-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  $sudo apt-get update -qq -o Acquire::Retries=5
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    -o Acquire::Retries=5 \
    "${missing[@]}" >&2
fi

if [[ ${FERRY_TORCH:-1} == 0 ]]; then
  exit 0
fi
# torch 2.11.0 (the version of the GPU hosts) without its declared dependencies: the CUDA 13
# runtime libraries come from the system CUDA toolkit, so only the three the toolkit lacks are
# added. About 760 MB to download, 1.6 GB installed (docs/real.md).
torch_version=2.11.0
python=${FERRY_SETUP_PYTHON:-python3}
# A slow or briefly failing index must not fail the set-up: more retries, a longer timeout.
pip_flags=(--quiet --disable-pip-version-check --no-warn-conflicts --retries 10 --timeout 60)
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" \
    >/dev/null 2>&1; then
  echo "setup: installing torch==$torch_version into .venv" >&2
  "$python" -m venv .venv
  .venv/bin/pip install "${pip_flags[@]}" --no-deps \
    "torch==$torch_version" typing_extensions nvidia-cufile==1.15.1.6 \
    nvidia-cusparselt-cu13==0.8.0 nvidia-nvshmem-cu13==3.4.5 >&2
fi
# Building and testing the Python extension (sympy: torch.utils.checkpoint, which the tests
# compare against, imports torch._dynamo; filelock, networkx, jinja2, fsspec: torch.compile,
# which the tests run under ferry's regions — torch's own declared dependencies, none of which
# pulls a CUDA wheel).
if ! .venv/bin/python -c "import pytest, wheel, sympy, filelock, networkx, jinja2, fsspec" \
    >/dev/null 2>&1; then
  .venv/bin/pip install "${pip_flags[@]}" pytest wheel ninja sympy==1.14.0 filelock networkx \
    jinja2 fsspec >&2
fi
# pytest's workers (scripts/test.sh runs the suite on both cores): pure Python, no torch.
if ! .venv/bin/python -c "import xdist" >/dev/null 2>&1; then
  .venv/bin/pip install "${pip_flags[@]}" pytest-xdist==3.8.0 execnet==2.1.2 >&2
fi
# The package's build backend (pyproject.toml), for scripts/package.sh: pure Python, no torch.
if ! .venv/bin/python -c "import scikit_build_core" >/dev/null 2>&1; then
  .venv/bin/pip install "${pip_flags[@]}" scikit-build-core==1.1.2 >&2
fi
# The Python linter and formatter (scripts/lint.sh), one static binary.
if ! [[ $(.venv/bin/ruff --version 2>/dev/null) == "ruff 0.17.6" ]]; then
  .venv/bin/pip install "${pip_flags[@]}" ruff==0.17.6 >&2
fi
# Test-only: small Hugging Face models built from configs (no downloads) with and without LoRA.
# peft and accelerate declare torch as a dependency, so they are installed without dependencies
# (pip must never replace the torch above or pull CUDA wheels); what they need besides torch
# comes with transformers and psutil.
if ! .venv/bin/python -c "import transformers, peft" >/dev/null 2>&1; then
  .venv/bin/pip install "${pip_flags[@]}" transformers==5.23.0 psutil >&2
  .venv/bin/pip install "${pip_flags[@]}" --no-deps peft==0.21.2 accelerate==1.15.0 >&2
fi
