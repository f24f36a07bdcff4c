#!/usr/bin/env bash
# Builds the library and runs the demo: one GPT attention layer's packed FP8 QKV forward +
# backward (GPU when present, checked against the CPU backend; CPU otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
need_apt=()
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
if [ ${#need_apt[@]} -gt 0 ]; then apt-get update -qq && apt-get install -y -qq "${need_apt[@]}"; fi
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH=/usr/local/cuda/bin:$PATH; fi
build=${QKVFUSE_BUILD_DIR:-build-demo}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DQKVFUSE_BUILD_TESTS=OFF -DQKVFUSE_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target qkvfuse_demo
"$build/examples/qkvfuse_demo" "$@"
