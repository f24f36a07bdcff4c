"""PackedWeightCache: the e4m3 packed [Wq; Wk; Wv] weight of every attention layer, refreshed after
each optimizer step with as few quantize_weight_bank calls as there are distinct layer shapes."""
from typing import NamedTuple, Sequence, Tuple

import torch

from .ops import quantize_weight_bank


class PackedWeight(NamedTuple):
    """One layer's cached weight, as packed_fp8_qkv takes it."""
    weight_f8: torch.Tensor    # e4m3 [qkv_dim, C]
    weight_f8_t: torch.Tensor  # e4m3 [C, qkv_dim]
    weight_scale: torch.Tensor  # float32 [], max|[Wq; Wk; Wv]| / 448


class _Group:
    """Layers of one shape and device: their stacked bf16 weights in one bank [B, qkv_dim, C]."""

    def __init__(self, layers, indices):
        qk_weight, v_weight = layers[indices[0]]
        self.indices = indices
        self.bank = torch.empty((len(indices), qk_weight.shape[0] + v_weight.shape[0],
                                 qk_weight.shape[1]), dtype=torch.bfloat16,
                                device=qk_weight.device)
        qk_rows = qk_weight.shape[0]
        self.sources = [w for i in indices for w in layers[i]]
        self.targets = [part for b in range(len(indices))
                        for part in (self.bank[b, :qk_rows], self.bank[b, qk_rows:])]


class PackedWeightCache:
    """The cached e4m3 [Wq; Wk; Wv] of a list of layers, given as (qk_weight, v_weight) pairs:
    qk_weight [2*H*D, C] and v_weight [H*Dv, C], usually the model's parameters.

    refresh() (call it after every optimizer step; the constructor calls it once) copies every
    layer's current weights into a bf16 bank per group of equal shape and re-quantizes each bank
    in one call: current scaling, scale = amax / 448 per layer, computed on the device. Layers of
    mixed head widths form one group per width. cache[i] is layer i's PackedWeight.
    """

    def __init__(self, layers: Sequence[Tuple[torch.Tensor, torch.Tensor]]):
        self._layers = [tuple(pair) for pair in layers]
        groups = {}
        for i, (qk_weight, v_weight) in enumerate(self._layers):
            key = (tuple(qk_weight.shape), tuple(v_weight.shape), qk_weight.device)
            groups.setdefault(key, []).append(i)
        self._groups = [_Group(self._layers, indices) for indices in groups.values()]
        self._entries = [None] * len(self._layers)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        for group in self._groups:
            # One multi-tensor copy per group stacks the layers' current weights into the bank.
            torch._foreach_copy_(group.targets, group.sources)
            row, t, scale = quantize_weight_bank(group.bank)
            for b, i in enumerate(group.indices):
                self._entries[i] = PackedWeight(row[b], t[b], scale[b])

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, layer: int) -> PackedWeight:
        return self._entries[layer]
