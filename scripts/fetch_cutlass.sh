#!/usr/bin/env bash
# Puts the CUTLASS 4.2.0 C++ headers (cute/, cutlass/) at .deps/cutlass-4.2.0/include, where CMake
# looks for them (cmake/cutlass.cmake) unless QKVFUSE_CUTLASS_INCLUDE_DIR names another folder;
# with them there, QKVFUSE_ENABLE_CUTLASS=AUTO builds the fused QKV GEMM. Prints that folder.
#
# Source: PyPI's nvidia-cutlass==4.2.0.0 wheel, which ships the unmodified v4.2.0 headers under
# cutlass_library/source/include. Only the headers are used: the wheel is downloaded with
# --no-deps and unpacked, never installed, and pip checks it against the pinned sha256
# (--require-hashes). A wheel already in .deps/ (carried to a machine without network, e.g. the
# GPU machine) is checked against the same hash and used as is.
#
#   scripts/fetch_cutlass.sh      # idempotent; about 6.4 MB downloaded, 27 MB unpacked
set -euo pipefail
cd "$(dirname "$0")/.."

version=4.2.0.0
sha256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
deps=.deps
wheel=$deps/nvidia_cutlass-$version-py3-none-any.whl
dest=$deps/cutlass-4.2.0

if [ -f "$dest/include/cutlass/version.h" ] && [ -f "$dest/include/cute/tensor.hpp" ]; then
  echo "$PWD/$dest/include"
  exit 0
fi
mkdir -p "$deps"
if [ ! -f "$wheel" ]; then
  echo "nvidia-cutlass==$version --hash=sha256:$sha256" >"$deps/cutlass-requirements.txt"
  python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes \
    -r "$deps/cutlass-requirements.txt" -d "$deps" >&2
fi
echo "$sha256  $wheel" | sha256sum --quiet -c - >&2 || {
  echo "fetch_cutlass.sh: $wheel does not have the pinned sha256 $sha256" >&2
  exit 1
}
# Unpack the headers only (python's zipfile: no unzip on a bare machine).
rm -rf "$dest.tmp"
python3 - "$wheel" "$dest.tmp/include" <<'PY'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
prefix = "cutlass_library/source/include/"
count = 0
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = os.path.join(out, name[len(prefix):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with z.open(name) as src, open(target, "wb") as dst:
                dst.write(src.read())
            count += 1
if count == 0:
    sys.exit(f"fetch_cutlass.sh: no {prefix} in {wheel}")
PY
mv "$dest.tmp" "$dest"
echo "$PWD/$dest/include"
