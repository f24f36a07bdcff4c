#!/usr/bin/env bash
# Builds the library and runs the demo: one GPT attention layer's packed FP8 QKV forward +
# backward (GPU when present, checked against the CPU backend; CPU otherwise).
set -euo pipefail
source "$(dirname "$0")/common.sh"
need_build_tools
build=${QKVFUSE_BUILD_DIR:-build-demo}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DQKVFUSE_BUILD_TESTS=OFF -DQKVFUSE_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" --target qkvfuse_demo
"$build/examples/qkvfuse_demo" "$@"
