"""The inputs of one packed_fp8_qkv layer, shared by the packed-op, compile and CUDA-graph tests."""
import torch

import qkvfuse
import reference as ref

BF16, F32 = torch.bfloat16, torch.float32

# (tokens, channels, num_heads, qk_dim, v_dim, rotary_dim, paired, key_offset): GEMM sizes are
# multiples of 16 so that every case also runs on CUDA.
LAYOUTS = {
    "plain": (32, 64, 2, 32, 32, 32, False, False),
    "paired": (32, 64, 2, 32, 48, 32, True, False),
    "key_offset": (48, 64, 2, 64, 32, 32, False, True),
    "wide_v": (16, 128, 4, 32, 64, 32, False, False),
}

# General layouts (SPEC.md section 8): a LAYOUTS-style tuple (rotary_dim None: the default) and the
# keyword-only options. "angles": "cache" for a random cos/sin cache [T + 5, r] read at random
# positions ("cache_dtype", "position_dtype"), else factor tables. "weights": the norm weights'
# dtype (both weights), around 1 (around 0 with a weight offset). qkv_dim and the Q/K features are
# multiples of 16 (CUDA GEMMs).
LAYOUT_CASES = {
    "qwen3_gqa": ((32, 64, 4, 32, 32, None, False, False),
                  dict(num_kv_heads=2, rotary_style="neox", angles="cache", weights=F32,
                       eps=1e-6)),
    "gemma3_mqa": ((16, 64, 2, 32, 48, None, False, False),
                   dict(num_kv_heads=1, rotary_style="neox", angles="cache", weights=BF16,
                        weight_offset=1.0, eps=1e-6)),
    "rotary_only_partial": ((16, 64, 2, 32, 32, 16, False, False),
                            dict(normalize=False, rotary_style="interleaved", angles="cache",
                                 cache_dtype=BF16, position_dtype=torch.int32)),
    "paired_weights": ((32, 64, 2, 32, 48, 32, True, False), dict(weights=F32)),
    "key_offset_neox_weights": ((48, 64, 2, 64, 32, 32, False, True),
                                dict(rotary_style="neox", weights=BF16)),
}


class Problem:
    """One layer's inputs, built the way a model builds them: x quantized once with a static
    scale, the packed weight from a PackedWeightCache. `options` (a LAYOUT_CASES entry's second
    part) selects a general layout; self.options then holds packed_fp8_qkv's keyword arguments."""

    def __init__(self, layout, device, options=None):
        (self.tokens, channels, self.heads, self.qk_dim, self.v_dim, self.rotary_dim, self.paired,
         self.key_offset) = layout
        options = dict(options or {})
        self.kv_heads = options.get("num_kv_heads", self.heads)
        self.x = (torch.randn(self.tokens, channels, device=device) * 2).to(BF16).requires_grad_()
        std = channels ** -0.5
        qk_rows = (self.heads + self.kv_heads) * self.qk_dim
        self.qk_weight = (torch.randn(qk_rows, channels, device=device) * std
                          ).to(BF16).requires_grad_()
        self.v_weight = (torch.randn(self.kv_heads * self.v_dim, channels, device=device) * std
                         ).to(BF16).requires_grad_()
        self.qkv_scale = torch.tensor(1.25, device=device, requires_grad=True)
        self.x_scale = torch.tensor(8 / 448, device=device)
        self.x_f8, self.x_f8_t = qkvfuse.quantize_dual_layout(self.x.detach(), self.x_scale)
        self.cache = qkvfuse.PackedWeightCache([(self.qk_weight, self.v_weight)])
        self.grad_scale = torch.tensor(1 / 448, device=device)
        self.options = {name: options[name] for name in
                        ("num_kv_heads", "rotary_style", "normalize", "weight_offset", "eps")
                        if name in options}
        self.factor1 = self.factor2 = None
        if options.get("angles") == "cache":
            width = self.qk_dim if self.rotary_dim is None else self.rotary_dim
            rows = self.tokens + 5
            self.options["cos_sin"] = torch.randn(rows, width, device=device).to(
                options.get("cache_dtype", F32))
            self.options["positions"] = torch.randint(
                0, rows, (self.tokens,), device=device,
                dtype=options.get("position_dtype", torch.int64))
        else:
            width = 2 * self.qk_dim if self.paired else self.qk_dim
            self.factor1, self.factor2 = ref.rotary_factors(self.tokens, width, self.rotary_dim,
                                                            BF16, device)
        if "weights" in options:
            center = 0.0 if options.get("weight_offset") else 1.0
            for name in ("q_weight", "k_weight"):
                weight = center + 0.5 * torch.randn(self.qk_dim, device=device)
                self.options[name] = weight.to(options["weights"]).requires_grad_()

    @property
    def norm_weights(self):
        """The norm weights given, by name."""
        return {n: self.options[n] for n in ("q_weight", "k_weight") if n in self.options}

    def arguments(self):
        """packed_fp8_qkv's positional arguments, in the reference's order."""
        w = self.cache[0]
        return (self.x, self.qk_weight, self.v_weight, w.weight_f8, w.weight_f8_t, w.weight_scale,
                self.qkv_scale, self.x_scale, self.grad_scale, self.factor1, self.factor2,
                self.heads, self.paired, self.key_offset, self.rotary_dim, self.x_f8, self.x_f8_t)

    def rope_layout(self, detach=False):
        """qk_norm_rope's layout keywords of this layer (reference.rope takes the same)."""
        layout = dict(num_heads=self.heads, rotary_dim=self.rotary_dim, paired=self.paired,
                      key_offset=self.key_offset, factor1=self.factor1, factor2=self.factor2,
                      **self.options)
        if detach:
            layout = {n: v.detach() if isinstance(v, torch.Tensor) else v
                      for n, v in layout.items()}
        return layout

    def model_forward(self):
        """(q, k, v, qk): SPEC.md sections 6 and 8 in float64, the GEMM rounded to bf16."""
        w = self.cache[0]
        qkv = ref.fp8_gemm(self.x_f8, w.weight_f8, self.x_scale,
                           w.weight_scale * self.qkv_scale.detach()).to(BF16)
        qk_features = (self.heads + self.kv_heads) * self.qk_dim
        qk = qkv[:, :qk_features].reshape(self.tokens, self.heads + self.kv_heads, self.qk_dim)
        v = qkv[:, qk_features:].reshape(self.tokens, self.kv_heads, self.v_dim)
        q, k = ref.rope(qk, **self.rope_layout(detach=True))
        return q, k, v, qk

    def model_backward(self, grad_q, grad_k, grad_v, qk):
        """(grad_x, grad_qk_weight, grad_v_weight, grad_qkv_scale, grad_q_weight, grad_k_weight)
        in float64, with the bf16 roundings the op makes (wgrad output, then its scaling by
        qkv_scale); the norm weights' None where absent."""
        w = self.cache[0]
        grad_row, grad_q_weight, grad_k_weight = ref.rope_grad_row(
            grad_q, grad_k, grad_v, qk, self.grad_scale, **self.rope_layout(detach=True))
        grad_weight = ref.fp8_gemm(grad_row.T.contiguous(), self.x_f8.T.contiguous(),
                                   self.grad_scale, self.x_scale).to(BF16).double()
        qkv_scale = self.qkv_scale.detach()
        grad_x = ref.fp8_gemm(grad_row, w.weight_f8.T.contiguous(), self.grad_scale,
                              w.weight_scale * qkv_scale)
        weight = torch.cat((self.qk_weight, self.v_weight)).detach().double()
        grad_qkv_scale = (grad_weight * weight).sum()
        scaled = (grad_weight * qkv_scale.double()).to(BF16).double()
        rows = self.qk_weight.shape[0]
        return (grad_x, scaled[:rows], scaled[rows:], grad_qkv_scale, grad_q_weight,
                grad_k_weight)
