"""PackedWeightCache: one quantize_weight_bank call per group of equal layer shapes, entries equal
to quantizing each layer's [Wq; Wk; Wv] alone, and refresh() picking up optimizer updates."""
import pytest
import torch

import qkvfuse
import qkvfuse.weights
import reference as ref
from conftest import raw_bytes

BF16 = torch.bfloat16


def layer(heads, qk_dim, v_dim, channels=64):
    qk_weight = torch.nn.Parameter((torch.randn(2 * heads * qk_dim, channels) * 0.05).to(BF16))
    v_weight = torch.nn.Parameter((torch.randn(heads * v_dim, channels) * 0.05).to(BF16))
    return qk_weight, v_weight


def test_groups_by_shape_and_matches_per_layer_quantize(monkeypatch):
    calls = []

    def counting(weights):
        calls.append(tuple(weights.shape))
        return qkvfuse.quantize_weight_bank(weights)

    monkeypatch.setattr(qkvfuse.weights, "quantize_weight_bank", counting)
    # Mixed head widths, as in the speedrun: two groups, one call each.
    layers = [layer(2, 32, 32), layer(2, 16, 32), layer(2, 32, 32)]
    cache = qkvfuse.PackedWeightCache(layers)
    assert sorted(calls) == [(1, 128, 64), (2, 192, 64)]
    assert len(cache) == 3
    for (qk_weight, v_weight), entry in zip(layers, cache):
        packed = torch.cat((qk_weight, v_weight)).detach()
        scale = packed.float().abs().max() / 448
        assert entry.weight_scale.shape == () and entry.weight_scale == scale
        assert torch.equal(raw_bytes(entry.weight_f8), raw_bytes(ref.quantize(packed, scale)))
        assert torch.equal(raw_bytes(entry.weight_f8_t), raw_bytes(entry.weight_f8.T))


def test_refresh_after_an_optimizer_step():
    layers = [layer(2, 32, 32), layer(2, 32, 32)]
    cache = qkvfuse.PackedWeightCache(layers)
    before = [raw_bytes(entry.weight_f8).clone() for entry in cache]
    with torch.no_grad():
        layers[1][1].mul_(3)  # v_weight of layer 1 only
    cache.refresh()
    assert torch.equal(raw_bytes(cache[0].weight_f8), before[0])
    assert not torch.equal(raw_bytes(cache[1].weight_f8), before[1])
    packed = torch.cat(layers[1]).detach()
    assert cache[1].weight_scale == packed.float().abs().max() / 448


def test_three_float32_blocks_equal_the_packed_pair():
    """(Wq, Wk, Wv) float32 master weights, as a model keeps them, cache the same bits as the
    bf16 (qk_weight, v_weight) pair of the same values."""
    wq, wk, wv = (torch.randn(rows, 64) * 0.05 for rows in (128, 64, 96))
    three = qkvfuse.PackedWeightCache([(wq, wk, wv)])[0]
    pair = qkvfuse.PackedWeightCache([(torch.cat((wq, wk)).to(BF16), wv.to(BF16))])[0]
    for a, b in zip(three, pair):
        assert torch.equal(raw_bytes(a), raw_bytes(b))


def test_refuses_blocks_of_different_widths():
    with pytest.raises(ValueError, match=r"layers\[1\]: expected row blocks \[rows, C\] of one C"):
        qkvfuse.PackedWeightCache([layer(2, 32, 32), (torch.zeros(64, 64), torch.zeros(32, 48))])
