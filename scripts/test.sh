#!/usr/bin/env bash
# The project's test command: builds every target (the CUDA backend too, when nvcc is on PATH)
# and runs the whole C++ suite, then the Python suite against PyPI's PyTorch. GPU tests are
# compiled everywhere and skip, printing why, on a machine without an NVIDIA GPU.
#
#   scripts/test.sh            fresh Debian machine with the CUDA toolkit: installs what it needs
#   QKVFUSE_SKIP_PYTHON=1 scripts/test.sh   the C++ part alone
set -euo pipefail
cd "$(dirname "$0")/.."
build=${QKVFUSE_BUILD_DIR:-build}
jobs=${QKVFUSE_JOBS:-$(nproc)}

need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
[ -e /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] || [ -e /usr/lib/cmake/GTest/GTestConfig.cmake ] || need_apt+=(libgtest-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "== installing ${need_apt[*]}"
  apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"
fi
# nvcc usually lives outside PATH in a fresh shell.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi

echo "== configure + build (all targets)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build" -j "$jobs"

echo "== C++ tests"
ctest --test-dir "$build" --output-on-failure -j "$jobs"

if [ "${QKVFUSE_SKIP_PYTHON:-0}" != 1 ]; then
  echo "== Python package + tests"
  python3 -c 'import torch' 2>/dev/null || python3 -m pip install -q torch
  python3 -m pip install -q pytest scikit-build-core numpy
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs python3 -m pip install -q --no-build-isolation --no-deps .
  # Run from outside the source tree so the installed package (with its compiled library) is used.
  (cd tests/python && python3 -m pytest -q -ra .)
fi
