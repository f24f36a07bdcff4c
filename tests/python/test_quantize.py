"""quantize_dual_layout (plain, amax, batched) and quantize_weight_bank, bit for bit against the
plain PyTorch quantization (reference.quantize: fp32 division, saturating RNE cast)."""
import pytest
import torch

import qkvfuse
import reference as ref
from conftest import DEVICES, poison_allocator

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn


def bits(t):
    return t.view(torch.uint8)


def shapes_on(device):
    # CUDA needs rows of 16-byte multiples; the CPU takes any size.
    return [(32, 48), (64, 16)] + ([(7, 17), (1, 3)] if device == "cpu" else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_dual_layout_is_bit_exact(device, scale_shape):
    for rows, cols in shapes_on(device):
        wide = torch.randn(rows, cols + 16, device=device).to(BF16) * 3
        x = wide[:, :cols]  # a row stride wider than the row
        x[0, 0] = 1e4  # saturates to +448
        x[-1, -1] = -1e4
        scale = torch.full(scale_shape, 0.02, device=device)
        poison_allocator(device, x.numel(), x.numel())
        row, t = qkvfuse.quantize_dual_layout(x, scale)
        assert row.dtype == t.dtype == E4M3 and row.shape == (rows, cols) and t.shape == (cols, rows)
        assert torch.equal(bits(row), bits(ref.quantize(x, scale)))
        assert torch.equal(bits(t), bits(row).T)
        assert row[0, 0].float() == 448 and row[-1, -1].float() == -448


@pytest.mark.parametrize("device", DEVICES)
def test_amax(device):
    x = torch.randn(32, 48, device=device).to(BF16)
    x[3, 5] = -9.5
    scale = torch.tensor(0.05, device=device)
    row, t, amax = qkvfuse.quantize_dual_layout(x, scale, amax=True)
    assert amax.dtype == torch.float32 and amax.shape == scale.shape
    assert amax.item() == 9.5
    assert torch.equal(bits(row), bits(ref.quantize(x, scale)))


@pytest.mark.parametrize("device", DEVICES)
def test_batched(device):
    x = torch.randn(3, 32, 64, device=device).to(BF16)
    scale = torch.tensor([0.01, 0.02, 0.5], device=device)
    row, t, amax = qkvfuse.quantize_dual_layout(x, scale, amax=True)
    assert row.shape == (3, 32, 64) and t.shape == (3, 64, 32) and amax.shape == (3,)
    for b in range(3):
        assert torch.equal(bits(row[b]), bits(ref.quantize(x[b], scale[b])))
        assert amax[b] == x[b].float().abs().max()
    assert torch.equal(bits(t), bits(row).transpose(1, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_weight_bank_current_scaling(device):
    weights = torch.randn(3, 48, 32, device=device).to(BF16) * 0.02
    weights[1].zero_()  # scale 1, so that it quantizes to zeros rather than NaN
    row, t, scale = qkvfuse.quantize_weight_bank(weights)
    assert scale.dtype == torch.float32 and scale.shape == (3,)
    expected_scale = weights.float().abs().amax(dim=(1, 2)) / 448
    expected_scale[1] = 1.0
    assert torch.equal(scale, expected_scale)
    for b in range(3):
        assert torch.equal(bits(row[b]), bits(ref.quantize(weights[b], scale[b])))
    assert torch.equal(bits(t), bits(row).transpose(1, 2))
    # Deterministic: a rerun gives the same bits.
    again = qkvfuse.quantize_weight_bank(weights)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(again[:2], (row, t)))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_sources_give_defined_amax_and_scales(device):
    """The library writes nothing for an empty source; the binding returns what an all-zero source
    gives (amax 0, bank scale 1), never uninitialized memory."""
    for shape, scale in (((0, 16), torch.tensor(0.5)), ((16, 0), torch.tensor(0.5)),
                         ((2, 0, 16), torch.tensor([0.5, 2.0]))):
        poison_allocator(device, 4 * scale.numel(), 512)
        row, t, amax = qkvfuse.quantize_dual_layout(torch.empty(shape, dtype=BF16, device=device),
                                                    scale.to(device), amax=True)
        assert row.shape == shape and row.numel() == 0 and t.numel() == 0
        assert amax.shape == scale.shape and torch.equal(amax.cpu(), torch.zeros(scale.shape))
    for shape in ((3, 0, 16), (3, 16, 0)):
        poison_allocator(device, 12, 512)
        row, t, scale = qkvfuse.quantize_weight_bank(torch.empty(shape, dtype=BF16, device=device))
        assert row.shape == shape and t.shape == (3, shape[2], shape[1])
        assert torch.equal(scale.cpu(), torch.ones(3))


@pytest.mark.parametrize("device", DEVICES)
def test_no_gradient_flows(device):
    x = torch.randn(32, 16, device=device).to(BF16).requires_grad_()
    row, t = qkvfuse.quantize_dual_layout(x, torch.tensor(0.1, device=device))
    assert not row.requires_grad and not t.requires_grad


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = torch.randn(32, 48, device=device).to(BF16)
    scale = torch.tensor(0.05, device=device)
    batch = torch.randn(2, 32, 48, device=device).to(BF16)
    torch.library.opcheck(torch.ops.qkvfuse.quantize_dual_layout.default, (x, scale))
    torch.library.opcheck(torch.ops.qkvfuse.quantize_dual_layout_amax.default, (x, scale))
    torch.library.opcheck(torch.ops.qkvfuse.quantize_dual_layout_amax.default,
                          (batch, torch.tensor([0.1, 0.2], device=device)))
    torch.library.opcheck(torch.ops.qkvfuse.quantize_weight_bank.default, (batch,))
    # With an input that requires grad: the ops declare that they have no gradient.
    torch.library.opcheck(torch.ops.qkvfuse.quantize_weight_bank.default,
                          (batch.clone().requires_grad_(),))
