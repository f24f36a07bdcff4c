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
    """Layers of one shape and device: their stacked bf16 weights in one bank
    [B, rows of all blocks, C]."""

    def __init__(self, layers, indices):
        blocks = layers[indices[0]]
        rows = [w.shape[0] for w in blocks]
        self.indices = indices
        self.bank = torch.empty((len(indices), sum(rows), blocks[0].shape[1]),
                                dtype=torch.bfloat16, device=blocks[0].device)
        self.sources = [w for i in indices for w in layers[i]]
        self.targets = [part for b in range(len(indices)) for part in self.bank[b].split(rows)]


class PackedWeightCache:
    """The cached e4m3 [Wq; Wk; Wv] of a list of layers, each given as the row blocks of its
    packed weight, in order: (qk_weight, v_weight) with qk_weight [(Hq+Hkv)*D, C] and v_weight
    [Hkv*Dv, C], or (Wq, Wk, Wv) as a model keeps them; usually the model's parameters, of any
    float dtype.

    refresh() (call it after every optimizer step; the constructor calls it once) copies every
    layer's current weights into a bf16 bank per group of equal shapes and re-quantizes each bank
    in one call: current scaling, scale = amax / 448 per layer, computed on the device. Layers of
    mixed shapes form one group per shape. cache[i] is layer i's PackedWeight.
    """

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]]):
        self._layers = [tuple(blocks) for blocks in layers]
        groups = {}
        for i, blocks in enumerate(self._layers):
            if not blocks or any(w.dim() != 2 or w.shape[1] != blocks[0].shape[1] or
                                 w.device != blocks[0].device for w in blocks):
                raise ValueError(
                    f"PackedWeightCache: layers[{i}]: expected row blocks [rows, C] of one C on "
                    f"one device, got {[(tuple(w.shape), str(w.device)) for w in blocks]}")
            key = (tuple(tuple(w.shape) for w in blocks), blocks[0].device)
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
