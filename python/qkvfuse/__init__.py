"""qkvfuse: fused FP8 QKV projection, QK RMS-norm + rotary and fused FP8 backward, for PyTorch;
and builders of the rotary tables the ops read (qkvfuse.rotary).

Importing the package loads the operator library (torch.ops.qkvfuse.*) and registers the fake
kernels (torch.compile) and autograd. Build and install against the torch already installed:
`pip install --no-build-isolation .`
"""
import torch  # noqa: F401  (loads libtorch before the op library)

from . import _library

_library.load()

from . import _fake  # noqa: E402,F401  (registers the fake kernels)
from .ops import (  # noqa: E402
    check_positions,
    fp8_gemm,
    qk_norm_rope,
    qkv_backward_fp8,
    quantize_dual_layout,
    quantize_weight_bank,
)
from .packed import (  # noqa: E402
    PackedFP8QKV,
    PackedFP8QKVFunction,
    PackedFP8QKVCurrentScalingFunction,
    PackedFP8QKVLayoutFunction,
    packed_fp8_qkv,
    packed_fp8_qkv_current_scaling,
)
from .rotary import (  # noqa: E402
    factor_tables_from_cos_sin,
    rotary_cos_sin,
    rotary_inv_freq,
    speedrun_factor_tables,
)
from .weights import PackedWeight, PackedWeightCache  # noqa: E402

__all__ = [
    "PackedFP8QKV",
    "PackedFP8QKVCurrentScalingFunction",
    "PackedFP8QKVFunction",
    "PackedFP8QKVLayoutFunction",
    "PackedWeight",
    "PackedWeightCache",
    "check_positions",
    "factor_tables_from_cos_sin",
    "fp8_gemm",
    "packed_fp8_qkv",
    "packed_fp8_qkv_current_scaling",
    "qk_norm_rope",
    "qkv_backward_fp8",
    "quantize_dual_layout",
    "quantize_weight_bank",
    "rotary_cos_sin",
    "rotary_inv_freq",
    "speedrun_factor_tables",
]
