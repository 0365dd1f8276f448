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
ruff_version=0.17.6
python=${FERRY_SETUP_PYTHON:-python3}
# A slow or briefly failing index must not fail the set-up: more retries, a longer timeout.
pip_flags=(--quiet --disable-pip-version-check --no-warn-conflicts --retries 10 --timeout 60)
# Which of the groups installed below are missing, read from the installed distributions'
# metadata in one interpreter (importing torch, transformers and peft to find out took 12 s of
# the 15 s a set-up with nothing to do took, and CI runs the set-up three times). Without a
# .venv, every group is missing.
missing=$(.venv/bin/python - "$torch_version" "$ruff_version" 2>/dev/null <<'PY' ||
import sys
from importlib.metadata import PackageNotFoundError, version

torch_version, ruff_version = sys.argv[1:]
groups = {
    "torch": {"torch": torch_version},
    "tools": dict.fromkeys(["pytest", "wheel", "sympy", "filelock", "networkx", "jinja2",
                            "fsspec"]),
    "xdist": {"pytest-xdist": None},
    "build": {"scikit-build-core": None},
    "ruff": {"ruff": ruff_version},
    "hf": dict.fromkeys(["transformers", "peft", "accelerate"]),
    "trainers": {"trl": "1.16.0", "datasets": None, "torchtune": "0.6.1"},
    "trainer-configs": {"torchtitan": "0.3.0", "megatron-core": "0.19.2", "tyro": "1.0.16",
                        "docstring-parser": "0.18.0", "typeguard": "4.6.0", "spmd-types": "0.3.1",
                        "triton": "3.6.0"},
}


def present(dist, wanted):
    try:
        found = version(dist)
    except PackageNotFoundError:
        return False
    return wanted is None or found.split("+")[0] == wanted


print(" ".join(g for g, dists in groups.items()
               if not all(present(d, w) for d, w in dists.items())))
PY
  echo "torch tools xdist build ruff hf trainers trainer-configs")
needs() { [[ " $missing " == *" $1 "* ]]; }
if needs torch; then
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
if needs tools; then
  .venv/bin/pip install "${pip_flags[@]}" pytest wheel ninja sympy==1.14.0 filelock networkx \
    jinja2 fsspec >&2
fi
# pytest's workers (scripts/test.sh runs the suite on both cores): pure Python, no torch.
if needs xdist; then
  .venv/bin/pip install "${pip_flags[@]}" pytest-xdist==3.8.0 execnet==2.1.2 >&2
fi
# The package's build backend (pyproject.toml), for scripts/package.sh: pure Python, no torch.
if needs build; then
  .venv/bin/pip install "${pip_flags[@]}" scikit-build-core==1.1.2 >&2
fi
# The Python linter and formatter (scripts/lint.sh), one static binary.
if needs ruff; then
  .venv/bin/pip install "${pip_flags[@]}" "ruff==$ruff_version" >&2
fi
# Test-only: small Hugging Face models built from configs (no downloads) with and without LoRA.
# peft and accelerate declare torch as a dependency, so they are installed without dependencies
# (pip must never replace the torch above or pull CUDA wheels); what they need besides torch
# comes with transformers and psutil.
if needs hf; then
  .venv/bin/pip install "${pip_flags[@]}" transformers==5.23.0 psutil >&2
  .venv/bin/pip install "${pip_flags[@]}" --no-deps peft==0.21.2 accelerate==1.15.0 >&2
fi
# Test-only: the trainers whose offload flags ferry.integrations switches (tests/python/
# test_integrations.py), without dependencies for the same reason, with what they import:
# TRL's SFTTrainer imports datasets (pyarrow, pandas, dill, xxhash, multiprocess); torchtune's
# training module imports torchdata, omegaconf and its tokenizers' sentencepiece, tiktoken and
# regex, and torchao: 0.14.1, the last with the names torchtune 0.6.1 imports (its C++ kernels
# are skipped on torch 2.11; torchtune's offloading does not use them). peft 0.21.2 refuses a
# torchao older than 0.16 wherever it finds one, so torchao goes to a folder of its own that
# only the torchtune checks put on their path.
if needs trainers; then
  .venv/bin/pip install "${pip_flags[@]}" --no-deps trl==1.16.0 datasets==5.2.0 \
    pyarrow==26.0.1 pandas==3.0.3 python-dateutil==2.9.0.post0 six==1.17.0 dill==0.4.1 \
    xxhash==4.1.0 multiprocess==0.70.19 torchtune==0.6.1 torchdata==0.11.0 omegaconf==2.3.0 \
    antlr4-python3-runtime==4.9.3 sentencepiece==0.2.3 tiktoken==0.14.0 regex==2026.11.15 >&2
fi
if [[ ! -d .venv/torchtune-torchao/torchao ]]; then
  .venv/bin/pip install "${pip_flags[@]}" --no-deps --target .venv/torchtune-torchao \
    torchao==0.14.1 >&2
fi
# Test-only: the trainers whose configuration code checks `ferry plan --for`'s output
# (tests/python/test_plan_for_trainers.py): torchtitan's activation checkpointing config and
# apply (tyro, docstring-parser, typeguard and spmd-types are what its config modules import),
# Megatron-Core's TransformerConfig (its package imports triton, torch 2.11's own pinned
# dependency; megatron-core declares Python 3.12, and its megatron.core modules import on 3.11).
# All without dependencies, so pip never replaces torch.
if needs trainer-configs; then
  .venv/bin/pip install "${pip_flags[@]}" --no-deps torchtitan==0.3.0 tyro==1.0.16 \
    docstring-parser==0.18.0 typeguard==4.6.0 spmd-types==0.3.1 triton==3.6.0 >&2
  .venv/bin/pip install "${pip_flags[@]}" --no-deps --ignore-requires-python \
    megatron-core==0.19.2 >&2
fi
