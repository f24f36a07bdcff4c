"""The inputs of one packed_fp8_qkv layer, shared by the packed-op, compile and CUDA-graph tests."""
import torch

import qkvfuse
import reference as ref

BF16 = torch.bfloat16

# (tokens, channels, num_heads, qk_dim, v_dim, rotary_dim, paired, key_offset): GEMM sizes are
# multiples of 16 so that every case also runs on CUDA.
LAYOUTS = {
    "plain": (32, 64, 2, 32, 32, 32, False, False),
    "paired": (32, 64, 2, 32, 48, 32, True, False),
    "key_offset": (48, 64, 2, 64, 32, 32, False, True),
    "wide_v": (16, 128, 4, 32, 64, 32, False, False),
}


class Problem:
    """One layer's inputs, built the way a model builds them: x quantized once with a static
    scale, the packed weight from a PackedWeightCache."""

    def __init__(self, layout, device):
        (self.tokens, channels, self.heads, self.qk_dim, self.v_dim, self.rotary_dim, self.paired,
         self.key_offset) = layout
        self.x = (torch.randn(self.tokens, channels, device=device) * 2).to(BF16).requires_grad_()
        std = channels ** -0.5
        self.qk_weight = (torch.randn(2 * self.heads * self.qk_dim, channels, device=device) * std
                          ).to(BF16).requires_grad_()
        self.v_weight = (torch.randn(self.heads * self.v_dim, channels, device=device) * std
                         ).to(BF16).requires_grad_()
        self.qkv_scale = torch.tensor(1.25, device=device, requires_grad=True)
        self.x_scale = torch.tensor(8 / 448, device=device)
        self.x_f8, self.x_f8_t = qkvfuse.quantize_dual_layout(self.x.detach(), self.x_scale)
        self.cache = qkvfuse.PackedWeightCache([(self.qk_weight, self.v_weight)])
        width = 2 * self.qk_dim if self.paired else self.qk_dim
        self.factor1, self.factor2 = ref.rotary_factors(self.tokens, width, self.rotary_dim, BF16,
                                                        device)
        self.grad_scale = torch.tensor(1 / 448, device=device)

    def arguments(self):
        """packed_fp8_qkv's arguments in the reference's order."""
        w = self.cache[0]
        return (self.x, self.qk_weight, self.v_weight, w.weight_f8, w.weight_f8_t, w.weight_scale,
                self.qkv_scale, self.x_scale, self.grad_scale, self.factor1, self.factor2,
                self.heads, self.paired, self.key_offset, self.rotary_dim, self.x_f8, self.x_f8_t)

    def model_forward(self):
        w = self.cache[0]
        return ref.packed_forward(self.x_f8, w.weight_f8, self.x_scale, w.weight_scale,
                                  self.qkv_scale.detach(), self.factor1, self.factor2, self.heads,
                                  self.qk_dim, self.v_dim, self.rotary_dim, self.paired,
                                  self.key_offset)

    def model_backward(self, grad_q, grad_k, grad_v, qk):
        w = self.cache[0]
        return ref.packed_backward(grad_q, grad_k, grad_v, qk, self.factor1, self.factor2,
                                   self.x_f8, w.weight_f8, self.qk_weight.detach(),
                                   self.v_weight.detach(), self.x_scale, w.weight_scale,
                                   self.qkv_scale.detach(), self.grad_scale, self.heads,
                                   self.rotary_dim, self.paired, self.key_offset)
