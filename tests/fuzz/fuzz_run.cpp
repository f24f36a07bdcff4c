// fuzz_run.cpp: running one case through the public API, and the CPU Memory (see fuzz.hpp).
#include <cstring>
#include <deque>
#include <stdexcept>

#include "fuzz.hpp"

namespace qkvfuse::fuzz {
namespace {

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xa5;

TensorView contiguous_view(void* data, DType dtype, Device device,
                           const std::vector<int64_t>& sizes) {
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.ndim = int(sizes.size());
  int64_t stride = 1;
  for (int d = view.ndim; d-- > 0;) {
    view.sizes[d] = sizes[size_t(d)];
    view.strides[d] = stride;
    stride *= sizes[size_t(d)];
  }
  return view;
}

/// Host outputs: each in its own allocation between guard bytes.
class CpuMemory final : public Memory {
 public:
  Device device() const override { return Device{DeviceType::kCPU, 0}; }
  Stream stream() const override { return nullptr; }
  TensorView input(const HostBuffer& host) override { return host.view(); }

  TensorView output(const std::string& name, DType dtype, std::vector<int64_t> sizes,
                    int64_t offset) override {
    int64_t count = 1;
    for (int64_t s : sizes) count *= s;
    const size_t element = dtype_size(dtype);
    Block block;
    block.name = name;
    block.size = size_t(count) * element;
    block.front = kGuardBytes + size_t(offset) * element;  // the offset is guard bytes too
    block.bytes.assign(block.front + block.size + kGuardBytes, kGuardByte);
    uint8_t* data = block.bytes.data() + block.front;
    for (size_t i = 0; i < block.size; i += element) {
      if (dtype == DType::kBFloat16) {
        std::memcpy(data + i, &kPoisonBF16, 2);
      } else if (dtype == DType::kFloat32) {
        std::memcpy(data + i, &kPoisonF32, 4);
      } else {
        data[i] = kPoisonE4M3;
      }
    }
    blocks_.push_back(std::move(block));
    return contiguous_view(blocks_.back().bytes.data() + blocks_.back().front, dtype, device(),
                           sizes);
  }

  void finish() override {}

  std::vector<uint8_t> read(const TensorView& view) override {
    for (const Block& block : blocks_) {
      if (block.bytes.data() + block.front == view.data) {
        return std::vector<uint8_t>(block.bytes.begin() + long(block.front),
                                    block.bytes.begin() + long(block.front + block.size));
      }
    }
    throw std::logic_error("fuzz: read of an unknown output");
  }

  std::string damaged_guards() override {
    std::string damaged;
    for (const Block& block : blocks_) {
      bool ok = true;
      for (size_t i = 0; i < block.bytes.size(); ++i) {
        const bool guard = i < block.front || i >= block.front + block.size;
        ok = ok && (!guard || block.bytes[i] == kGuardByte);
      }
      if (!ok) damaged += (damaged.empty() ? "" : ", ") + block.name;
    }
    return damaged;
  }

 private:
  struct Block {
    std::string name;
    size_t size = 0;
    size_t front = 0;  ///< guard bytes before the output
    std::vector<uint8_t> bytes;
  };
  std::deque<Block> blocks_;
};

}  // namespace

std::unique_ptr<Memory> make_cpu_memory() { return std::make_unique<CpuMemory>(); }

const Output& find_output(const std::vector<Output>& outputs, const std::string& name) {
  for (const Output& out : outputs) {
    if (out.name == name) return out;
  }
  throw std::logic_error("fuzz: no output named " + name);
}

std::vector<Output> run_case(const Case& c, const Inputs& in, Memory& memory) {
  struct Made {
    std::string name;
    DType dtype;
    std::vector<int64_t> sizes;
    TensorView view;
  };
  std::vector<Made> made;
  const auto output = [&](const std::string& name, DType dtype, std::vector<int64_t> sizes) {
    const int64_t offset = is_rope_op(c.op) && c.op != Op::kPacked ? c.out_offset : 0;
    const TensorView view = memory.output(name, dtype, sizes, offset);
    made.push_back({name, dtype, sizes, view});
    return view;
  };
  const Stream stream = memory.stream();
  const DType bf16 = DType::kBFloat16;
  const DType e4m3 = DType::kFloat8E4M3;

  // The layout: the case's options and its tensors on this memory.
  const auto layout = [&] {
    RopeLayout l = c.layout();
    if (!c.angles) {
      // No angle source (SPEC.md section 9).
    } else if (c.cache) {
      l.cos_sin = memory.input(in.cos_sin);
      l.positions = memory.input(in.positions);
    } else {
      l.factor1 = memory.input(in.factor1);
      l.factor2 = memory.input(in.factor2);
    }
    if (c.q_weight) l.q_weight = memory.input(in.q_weight);
    if (c.k_weight) l.k_weight = memory.input(in.k_weight);
    return l;
  };
  // The norm weights' gradients, present exactly when the weights are.
  const auto weight_grads = [&](TensorView& grad_q_weight, TensorView& grad_k_weight) {
    if (c.q_weight) grad_q_weight = output("grad_q_weight", c.weight_dtype, {c.weight_width(false)});
    if (c.k_weight) grad_k_weight = output("grad_k_weight", c.weight_dtype, {c.weight_width(true)});
  };
  const int64_t heads2 = c.input_heads();
  // The V norm's tensors (SPEC.md section 9): v's shape.
  const std::vector<int64_t> v_shape = {c.tokens, c.kv_heads, c.v_dim};

  switch (c.op) {
    case Op::kRopeForward: {
      QkNormRopeParams p;
      p.qk = memory.input(in.qk);
      p.q = output("q", bf16, {c.out_tokens(), c.q_out_heads(), c.head_dim});
      p.k = output("k", bf16, {c.out_tokens(), c.k_out_heads(), c.head_dim});
      p.layout = layout();
      p.stream = stream;
      if (c.normalize_v) {
        p.v = memory.input(in.v);
        p.v_out = output("v_out", bf16, v_shape);
      }
      qk_norm_rope(p);
      break;
    }
    case Op::kRopeBackward: {
      QkNormRopeBackwardParams p;
      p.grad_q = memory.input(in.grad_q);
      p.grad_k = memory.input(in.grad_k);
      p.qk = memory.input(in.qk);
      p.grad_qk = output("grad_qk", bf16, {c.tokens, heads2, c.head_dim});
      weight_grads(p.grad_q_weight, p.grad_k_weight);
      p.layout = layout();
      p.stream = stream;
      if (c.normalize_v) {
        p.grad_v_out = memory.input(in.grad_v);
        p.v = memory.input(in.v);
        p.grad_v = output("grad_v", bf16, v_shape);
      }
      const int64_t workspace = backward_workspace_size(p);
      if (workspace > 0) p.workspace = output("workspace", DType::kFloat32, {workspace});
      qk_norm_rope_backward(p);
      break;
    }
    case Op::kQkvBackwardFp8: {
      QkvBackwardFp8Params p;
      p.grad_q = memory.input(in.grad_q);
      p.grad_k = memory.input(in.grad_k);
      p.grad_v = memory.input(in.grad_v);
      p.qk = memory.input(in.qk);
      p.grad_scale = memory.input(in.scale);
      p.grad_row = output("grad_row", e4m3, {c.tokens, c.qkv_dim()});
      p.grad_t = output("grad_t", e4m3, {c.qkv_dim(), c.tokens});
      weight_grads(p.grad_q_weight, p.grad_k_weight);
      p.layout = layout();
      p.stream = stream;
      if (c.normalize_v) p.v = memory.input(in.v);
      const int64_t workspace = backward_workspace_size(p);
      if (workspace > 0) p.workspace = output("workspace", DType::kFloat32, {workspace});
      qkv_backward_fp8(p);
      break;
    }
    case Op::kPacked: {
      const int64_t T = c.tokens, C = c.channels, F = c.qkv_dim(), QK = c.qk_features();
      const int64_t V = c.kv_heads * c.v_dim;
      const auto slice = [](TensorView base, int64_t element_offset, std::vector<int64_t> sizes,
                            std::vector<int64_t> strides) {
        TensorView view = base;
        view.data = static_cast<char*>(base.data) + element_offset * int64_t(dtype_size(base.dtype));
        view.ndim = int(sizes.size());
        for (int d = 0; d < view.ndim; ++d) {
          view.sizes[d] = sizes[size_t(d)];
          view.strides[d] = strides[size_t(d)];
        }
        return view;
      };
      PackedQkvForwardParams f;
      f.x_f8 = memory.input(in.x_f8);
      f.weight_f8 = memory.input(in.weight_f8);
      f.x_scale = memory.input(in.x_scale);
      f.weight_scale = memory.input(in.weight_scale);
      f.qkv_scale = memory.input(in.qkv_scale);
      if (c.joined_qkv) {
        const TensorView qkv = output("qkv", bf16, {T, F});
        f.qk = slice(qkv, 0, {T, heads2, c.head_dim}, {F, c.head_dim, 1});
        f.v = slice(qkv, QK, {T, c.kv_heads, c.v_dim}, {F, c.v_dim, 1});
      } else {
        f.qk = output("qk", bf16, {T, heads2, c.head_dim});
        f.v = output("v", bf16, {T, c.kv_heads, c.v_dim});
      }
      f.q = output("q", bf16, {c.out_tokens(), c.q_out_heads(), c.head_dim});
      f.k = output("k", bf16, {c.out_tokens(), c.k_out_heads(), c.head_dim});
      f.layout = layout();
      f.stream = stream;
      if (c.normalize_v) f.v_out = output("v_out", bf16, v_shape);
      packed_qkv_forward(f);

      PackedQkvBackwardParams b;
      b.grad_q = memory.input(in.grad_q);
      b.grad_k = memory.input(in.grad_k);
      b.grad_v = memory.input(in.grad_v);
      b.qk = memory.input(in.qk);
      b.x_f8_t = memory.input(in.x_f8_t);
      b.weight_f8_t = memory.input(in.weight_f8_t);
      b.qk_weight = memory.input(in.qk_weight);
      b.v_weight = memory.input(in.v_weight);
      b.x_scale = f.x_scale;
      b.weight_scale = f.weight_scale;
      b.qkv_scale = f.qkv_scale;
      b.grad_scale = memory.input(in.scale);
      b.grad_row = output("grad_row", e4m3, {T, F});
      b.grad_t = output("grad_t", e4m3, {F, T});
      b.partials = output("partials", DType::kFloat32, {kGradScalePartials});
      weight_grads(b.grad_q_weight, b.grad_k_weight);
      b.grad_x = output("grad_x", bf16, {T, C});
      if (c.joined_weight_grads) {
        const TensorView grad_weight = output("grad_weight", bf16, {F, C});
        b.grad_qk_weight = slice(grad_weight, 0, {QK, C}, {C, 1});
        b.grad_v_weight = slice(grad_weight, QK * C, {V, C}, {C, 1});
      } else {
        b.grad_qk_weight = output("grad_qk_weight", bf16, {QK, C});
        b.grad_v_weight = output("grad_v_weight", bf16, {V, C});
      }
      b.grad_qkv_scale = output("grad_qkv_scale", DType::kFloat32, {});
      b.layout = f.layout;
      b.stream = stream;
      if (c.normalize_v) b.v = memory.input(in.v);
      const int64_t workspace = backward_workspace_size(b);
      if (workspace > 0) b.rope_workspace = output("workspace", DType::kFloat32, {workspace});
      packed_qkv_backward(b);
      break;
    }
    case Op::kQuantize:
    case Op::kQuantizeBatched: {
      QuantizeDualParams p;
      p.src = memory.input(in.src);
      p.scale = memory.input(in.scale);
      if (c.batch == 0) {
        p.row = output("row", e4m3, {c.rows, c.cols});
        p.t = output("t", e4m3, {c.cols, c.rows});
        if (c.with_amax) {
          p.amax = output("amax", DType::kFloat32,
                          c.scale_ndim ? std::vector<int64_t>{1} : std::vector<int64_t>{});
        }
      } else {
        p.row = output("row", e4m3, {c.batch, c.rows, c.cols});
        p.t = output("t", e4m3, {c.batch, c.cols, c.rows});
        if (c.with_amax) p.amax = output("amax", DType::kFloat32, {c.batch});
      }
      p.stream = stream;
      quantize_dual_layout(p);
      break;
    }
    case Op::kWeightBank: {
      QuantizeWeightBankParams p;
      p.src = memory.input(in.src);
      p.scale = output("scale", DType::kFloat32, {c.batch});
      p.row = output("row", e4m3, {c.batch, c.rows, c.cols});
      p.t = output("t", e4m3, {c.batch, c.cols, c.rows});
      p.stream = stream;
      quantize_weight_bank(p);
      break;
    }
  }
  memory.finish();
  std::vector<Output> outputs;
  for (const Made& m : made) outputs.push_back({m.name, m.dtype, m.sizes, memory.read(m.view)});
  return outputs;
}

}  // namespace qkvfuse::fuzz
