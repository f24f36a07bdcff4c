"""Loads the qkvfuse_torch operator library, which registers torch.ops.qkvfuse.*."""
import os
from pathlib import Path

import torch

# Set to the path of a libqkvfuse_torch.so built outside pip (a CMake build tree with
# -DQKVFUSE_BUILD_TORCH=ON) to use it with the package sources on PYTHONPATH.
LIBRARY_ENV = "QKVFUSE_TORCH_LIBRARY"


def library_path() -> Path:
    override = os.environ.get(LIBRARY_ENV)
    if override:
        return Path(override)
    here = Path(__file__).resolve().parent
    found = sorted(here.glob("*qkvfuse_torch*.so"))
    if not found:
        raise ImportError(
            f"qkvfuse: no libqkvfuse_torch.so in {here}. Install the package with "
            f"`pip install --no-build-isolation .`, or set {LIBRARY_ENV} to a built library."
        )
    return found[0]


def load() -> None:
    # torch is imported first (above), so libtorch, c10_cuda and cuBLASLt are already in the
    # process when the op library's dependencies are resolved.
    torch.ops.load_library(str(library_path()))
