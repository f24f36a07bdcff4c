"""fp8_gemm against a float64 matmul of the decoded e4m3 operands."""
import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, assert_bf16_close, opcheck

BF16 = torch.bfloat16


def operands(m, n, k, device):
    a = ref.to_e4m3(torch.randn(m, k, device=device) * 40)
    b = ref.to_e4m3(torch.randn(n, k, device=device) * 40)
    return a, b, torch.tensor(0.03, device=device), torch.tensor([0.002], device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fast_accum", [False, True])
def test_matches_float64(device, fast_accum):
    sizes = [(48, 32, 64), (16, 80, 768)] + ([(7, 3, 5)] if device == "cpu" else [])
    for m, n, k in sizes:
        a, b, scale_a, scale_b = operands(m, n, k, device)
        alpha = torch.tensor(1.5, device=device)
        d = qkvfuse.fp8_gemm(a, b, scale_a, scale_b, alpha, fast_accum=fast_accum)
        assert d.dtype == BF16 and d.shape == (m, n) and d.is_contiguous()
        # Fast accumulation on the GPU may lose a few more bits than one bf16 rounding.
        assert_bf16_close(d, ref.fp8_gemm(a, b, scale_a, scale_b, alpha),
                          ulps=8 if fast_accum else 2)
        no_alpha = qkvfuse.fp8_gemm(a, b, scale_a, scale_b)
        assert_bf16_close(no_alpha, ref.fp8_gemm(a, b, scale_a, scale_b),
                          ulps=8 if fast_accum else 2)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    a, b, scale_a, scale_b = operands(32, 48, 64, device)
    opcheck(torch.ops.qkvfuse.fp8_gemm.default, (a, b, scale_a, scale_b))
    opcheck(torch.ops.qkvfuse.fp8_gemm.default,
                          (a, b, scale_a, scale_b, torch.tensor(2.0, device=device), True))
