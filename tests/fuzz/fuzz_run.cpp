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
    const TensorView view = memory.output(name, dtype, sizes, is_rope_op(c.op) ? c.out_offset : 0);
    made.push_back({name, dtype, sizes, view});
    return view;
  };
  const Stream stream = memory.stream();
  const DType bf16 = DType::kBFloat16;
  const DType e4m3 = DType::kFloat8E4M3;

  switch (c.op) {
    case Op::kRopeForward: {
      QkNormRopeParams p;
      p.qk = memory.input(in.qk);
      p.q = output("q", bf16, {c.out_tokens(), c.out_heads(), c.head_dim});
      p.k = output("k", bf16, {c.out_tokens(), c.out_heads(), c.head_dim});
      p.layout = c.layout();
      p.layout.factor1 = memory.input(in.factor1);
      p.layout.factor2 = memory.input(in.factor2);
      p.stream = stream;
      qk_norm_rope(p);
      break;
    }
    case Op::kRopeBackward: {
      QkNormRopeBackwardParams p;
      p.grad_q = memory.input(in.grad_q);
      p.grad_k = memory.input(in.grad_k);
      p.qk = memory.input(in.qk);
      p.grad_qk = output("grad_qk", bf16, {c.tokens, 2 * c.heads, c.head_dim});
      p.layout = c.layout();
      p.layout.factor1 = memory.input(in.factor1);
      p.layout.factor2 = memory.input(in.factor2);
      p.stream = stream;
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
      p.layout = c.layout();
      p.layout.factor1 = memory.input(in.factor1);
      p.layout.factor2 = memory.input(in.factor2);
      p.stream = stream;
      qkv_backward_fp8(p);
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
