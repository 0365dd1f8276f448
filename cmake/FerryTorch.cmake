# Finds LibTorch from the `torch` wheel of a Python environment (the project's .venv, made by
# scripts/setup.sh, or the Python building the package; FERRY_PYTHON names another), through
# torch.utils.cmake_prefix_path. Sets Torch_FOUND and FERRY_TORCH_CUDA.

# A package build (scikit-build-core, pyproject.toml) takes the Python that runs it.
if(SKBUILD AND Python_EXECUTABLE)
  set(_ferry_default_python "${Python_EXECUTABLE}")
else()
  set(_ferry_default_python "${PROJECT_SOURCE_DIR}/.venv/bin/python")
endif()
set(FERRY_PYTHON "${_ferry_default_python}" CACHE FILEPATH
    "Python interpreter whose torch wheel provides LibTorch")

if(EXISTS "${FERRY_PYTHON}")
  execute_process(
    COMMAND "${FERRY_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _ferry_torch_prefix
    RESULT_VARIABLE _ferry_torch_rc
    OUTPUT_STRIP_TRAILING_WHITESPACE
    ERROR_QUIET)
  if(_ferry_torch_rc EQUAL 0)
    list(APPEND CMAKE_PREFIX_PATH "${_ferry_torch_prefix}")
  endif()
endif()

# ferry compiles no CUDA kernels: name an architecture so that Caffe2's config does not try to
# detect the installed GPUs (it cannot on a machine without one).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
find_package(Torch QUIET)

set(FERRY_TORCH_CUDA OFF)
if(Torch_FOUND AND TARGET torch_cuda)
  set(FERRY_TORCH_CUDA ON)
endif()
