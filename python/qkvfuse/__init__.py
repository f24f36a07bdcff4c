"""qkvfuse: fused FP8 QKV projection, QK RMS-norm + rotary and fused FP8 backward, for PyTorch.

Importing the package loads the operator library (torch.ops.qkvfuse.*) and registers the fake
kernels (torch.compile) and autograd. Build and install against the torch already installed:
`pip install --no-build-isolation .`
"""
import torch  # noqa: F401  (loads libtorch before the op library)

from . import _library

_library.load()

from . import _fake  # noqa: E402,F401  (registers the fake kernels)
from .ops import (  # noqa: E402
    fp8_gemm,
    qk_norm_rope,
    qkv_backward_fp8,
    quantize_dual_layout,
    quantize_weight_bank,
)
from .packed import PackedFP8QKV, PackedFP8QKVFunction, packed_fp8_qkv  # noqa: E402
from .weights import PackedWeight, PackedWeightCache  # noqa: E402

__all__ = [
    "PackedFP8QKV",
    "PackedFP8QKVFunction",
    "PackedWeight",
    "PackedWeightCache",
    "fp8_gemm",
    "packed_fp8_qkv",
    "qk_norm_rope",
    "qkv_backward_fp8",
    "quantize_dual_layout",
    "quantize_weight_bank",
]
