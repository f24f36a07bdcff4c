"""Shared fixtures: devices, seeded generators, tolerance helpers."""
import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # `import reference` from the test modules

import qkvfuse  # noqa: E402,F401  (loads the op library once for the session)

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# The CUDA backend's switch for SPEC.md section 9's untested kernels, read once per process by the
# library: set in the environment before pytest starts (scripts/device_run.sh's section9 stage).
CUDA_SECTION9 = os.environ.get("QKVFUSE_CUDA_SECTION9") == "1"
requires_section9 = pytest.mark.skipif(
    not CUDA_SECTION9, reason="QKVFUSE_CUDA_SECTION9=1 is not set: CUDA refuses section 9's "
    "options (their refusal is tested instead)")
without_section9 = pytest.mark.skipif(
    CUDA_SECTION9, reason="QKVFUSE_CUDA_SECTION9=1: CUDA runs section 9's options (tested instead)")
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh but reproducible inputs per test: the seed derives from the test's name.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_error(out, ref):
    """||out - ref|| / ||ref|| in float64 (METHOD: the error measure for rounded results)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def assert_bf16_close(out, ref, ulps=2.0, outliers=0.0):
    """Elementwise |out - ref| <= ulps * bf16 half-ulp of |ref| + a floor at 2^-10 of max|ref|:
    out went through one bf16 rounding (ulps covers the fp32-vs-fp64 difference before it).
    `outliers`: the fraction of elements allowed beyond that bound, for
    results of the GPU's fast-accumulation FP8 GEMM, whose reduced-precision partial sums move a
    few cancelling elements further than one rounding (never beyond 32 times the bound)."""
    out, ref = out.double(), ref.double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not out.isnan().any(), "NaN in output"
    floor = ref.abs().max().item() * 2**-10 if ref.numel() else 0.0
    tolerance = ulps * 2**-9 * ref.abs() + floor
    diff = (out - ref).abs()
    bad = diff > tolerance
    report = (f"{int(bad.sum())} of {bad.numel()} elements off; worst |diff| "
              f"{diff.max().item():.3g}, rel error {rel_error(out, ref):.3g}")
    assert (diff <= 32 * tolerance).all(), report
    assert bad.double().mean().item() <= outliers, report


def assert_e4m3_close(out, ref, max_mismatch=0.01):
    """e4m3 results whose inputs may differ by a rounding: every element within one e4m3 step of
    the reference, and at most `max_mismatch` of them not bit-identical."""
    assert out.dtype == ref.dtype == torch.float8_e4m3fn and out.shape == ref.shape
    a, b = out.double(), ref.double()
    assert not a.isnan().any(), "NaN in e4m3 output"
    step = (b.abs() * 2**-3).clamp_min(2**-9)
    assert ((a - b).abs() <= step * 1.0001).all(), f"worst |diff| {(a - b).abs().max().item()}"
    mismatch = (out.view(torch.uint8) != ref.view(torch.uint8)).double().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of e4m3 elements differ"


def poison_allocator(device, *nbytes):
    """Leave blocks of these byte sizes filled with 0xff free in the allocator, so that outputs an
    op allocates next start out poisoned: 0xff.. is NaN in bf16, float32 and e4m3, so an element
    the op fails to write shows up as NaN. Effective on CUDA, whose caching allocator hands the
    freed blocks back; on the CPU it is best effort only (torch's CPU allocator returns memory to
    the C library, which seldom gives the same block back), so the CUDA runs of a test are the
    ones that catch unwritten outputs."""
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in nbytes]
    del blocks


def raw_bytes(tensor):
    """The tensor's elements as bytes, for bitwise comparisons of any dtype."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def opcheck(op, args):
    """torch.library.opcheck, with one gap filled: its test_schema compares inputs before and
    after the call with allclose, which torch does not implement for float8 tensors. For ops with
    e4m3 inputs that test is replaced by the same two checks done bitwise: no input is modified,
    and no output shares storage with an input."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.dtype == torch.float8_e4m3fn for t in tensors):
        torch.library.opcheck(op, args)
        return
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if not any(t.requires_grad for t in tensors):
        utils = utils[1:]
    torch.library.opcheck(op, args, test_utils=utils)
    before = [raw_bytes(t).clone() for t in tensors]
    outputs = op(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for old, tensor in zip(before, tensors):
        assert torch.equal(old, raw_bytes(tensor)), f"{op} modified an input"
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    for out in outputs:
        assert out.untyped_storage().data_ptr() not in storages, f"{op} returned an input alias"
