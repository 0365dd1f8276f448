"""Build of the `ferry` Python package: the real backend's runtime as the extension `ferry._C`.

Install from the repository root (the venv's torch must be the one compiled against):

    .venv/bin/pip install --no-build-isolation ./real/python
"""

import os
import re

from setuptools import setup

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
REAL = os.path.normpath(os.path.join(HERE, ".."))
SHARED = os.path.normpath(os.path.join(HERE, "..", "..", "shared"))
# Package paths below are relative to this directory, wherever setup.py is run from.
os.chdir(HERE)


def _version():
    # The one version number is the top-level CMakeLists.txt's project(ferry VERSION x.y.z): the
    # C++ package config, `ferry --version` and this package all read it.
    with open(os.path.join(HERE, "..", "..", "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(ferry\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if match is None:
        raise RuntimeError("no project(ferry VERSION x.y.z) in the top-level CMakeLists.txt")
    return match.group(1)


def _src(*parts):
    # Absolute paths from this file's directory: pip may run setup.py from elsewhere, and object
    # files of absolute sources stay under build/ (relative "../" ones would not).
    return os.path.normpath(os.path.join(*parts))


# The C++ engine install (real/src/api.cpp) stays out: Python's saved_tensors_hooks do its job.
sources = [
    _src(HERE, "src", "ferry_ext.cpp"),
    _src(REAL, "src", "device.cpp"),
    _src(REAL, "src", "runtime.cpp"),
    _src(SHARED, "src", "check.cpp"),
    _src(SHARED, "src", "failure.cpp"),
    _src(SHARED, "src", "offload", "options.cpp"),
    _src(SHARED, "src", "offload", "record.cpp"),
    _src(SHARED, "src", "units.cpp"),
    _src(SHARED, "src", "program", "program.cpp"),
    _src(SHARED, "src", "program", "program_json.cpp"),
    _src(SHARED, "src", "program", "recorder.cpp"),
]

# torch's bundled fmt (its include dir comes first, before /usr/include), used header-only so
# that it never meets the system library of another version.
define_macros = [("FMT_HEADER_ONLY", "1")]
extra_compile_args = ["-std=c++20", "-O2", "-g0"]  # -g0: no debug info, a faster build

use_cuda = bool(torch.version.cuda) and cpp_extension.CUDA_HOME is not None
if use_cuda:
    # ferry compiles no CUDA kernels; naming an architecture keeps torch from probing GPUs.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    sources.append(_src(REAL, "src", "cuda_device.cpp"))
    define_macros.append(("FERRY_HAVE_CUDA", "1"))
    Extension = cpp_extension.CUDAExtension
else:
    Extension = cpp_extension.CppExtension

# Two cores are the norm on small build machines: let the user raise it with MAX_JOBS.
os.environ.setdefault("MAX_JOBS", "2")

ext = Extension(
    name="ferry._C",
    sources=sources,
    include_dirs=[os.path.join(REAL, "include"), os.path.join(SHARED, "include")],
    define_macros=define_macros,
    extra_compile_args={"cxx": extra_compile_args, "nvcc": ["-std=c++20", "-O2"]}
    if use_cuda
    else extra_compile_args,
)

setup(
    name="ferry",
    version=_version(),
    description="ferry: activation offload and checkpointing for PyTorch autograd",
    packages=["ferry"],
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    python_requires=">=3.9",
    zip_safe=False,
)
