// Linear layers for few activation rows: x (..., K) @ W(N, K).T (+ bias), W float32 or
// affine-quantized in MLX's layout, each weight byte read once per call.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "kernels.h"
#include "linear.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "primitive.h"
#include "qdot.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

const LinearKernels& kernels() {
  const std::string& isa = active_isa();
#if defined(BASE_HAVE_X86_PATHS)
  if (isa == "avx512") return avx512::linear_kernels();
  if (isa == "avx2") return avx2::linear_kernels();
#endif
  return generic::linear_kernels();
}

// The integer-activation kernels for the active instruction set: the avx512 ones need VNNI.
const QdotKernels& qdot_kernels() {
#if defined(BASE_HAVE_X86_PATHS)
  const std::string& isa = active_isa();
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  if (isa == "avx512" && vnni) return avx512::qdot_kernels();
  if (isa == "avx512" || isa == "avx2") return avx2::qdot_kernels();
#endif
  return generic::qdot_kernels();
}

// Activation rows up to which quantized weights meet integer activations. Past it (prefill) the
// product is compute-bound, and float32 FMA tiles over decoded rows do more multiply-adds per
// instruction than integer blocks that each need their own float scale (SmolLM2's 512-token
// windows: 32 s exact against 124 s on 16-bit activations).
constexpr int kQdotMaxRows = 32;
static_assert(kGemmMinRows == kQdotMaxRows + 1, "the float32 GEMM starts where the integer path ends");

// Which activations quantized weights meet: kExactAuto takes integer ones on every instruction
// set (`generic`'s integer loops are plain C++ the compiler vectorizes: SSE2 on x86-64, NEON on
// ARM). BASE_CPU_EXACT=1 / set_exact(True): always float32 (the exact path); BASE_CPU_EXACT=0 /
// set_exact(False): always integer.
enum Exact : int { kExactAuto = -1, kExactNo = 0, kExactYes = 1 };

std::atomic<int>& exact_slot() {
  static std::atomic<int> exact{[] {
    const char* env = std::getenv("BASE_CPU_EXACT");
    if (env == nullptr || env[0] == '\0') return static_cast<int>(kExactAuto);
    return static_cast<int>(std::strcmp(env, "0") == 0 ? kExactNo : kExactYes);
  }()};
  return exact;
}

// Whether quantized weights meet float32 activations now.
bool exact_now() { return exact_slot().load(std::memory_order_relaxed) == kExactYes; }

// Output rows are handed to threads in chunks of this many weight rows.
constexpr int kChunkRows = 16;

// A large weight's rows go out in larger chunks (the LM head: tens of thousands of rows), about
// claims_per_thread() claims per thread: each claim is a contended atomic and each chunk boundary
// a run of rows the hardware and software read-ahead fetch for nothing.
std::atomic<int>& claims_slot() {
  static std::atomic<int> claims{[] {
    const char* env = std::getenv("BASE_CPU_CLAIMS");
    return env != nullptr && std::atoi(env) >= 0 ? std::atoi(env) : 32;
  }()};
  return claims;
}

// Weight rows a claim takes (a multiple of kChunkRows); claims_per_thread 0: kChunkRows always.
int chunk_rows(int n, size_t bytes) {
  const int claims = claims_slot().load(std::memory_order_relaxed);
  if (claims == 0 || bytes < min_parallel_bytes()) return kChunkRows;  // one thread: no pool to size for
  int rows = n / (num_threads() * claims) / kChunkRows * kChunkRows;
  return rows > kChunkRows ? rows : kChunkRows;
}

mx::Shape out_shape(const mx::array& x, int n) {
  mx::Shape shape = x.shape();
  shape.back() = n;
  return shape;
}

void check_x(const mx::array& x, const char* op) {
  if (x.dtype() != mx::float32) throw std::invalid_argument(std::string(op) + ": x must be float32");
  if (x.ndim() < 1 || x.shape(-1) < 1)
    throw std::invalid_argument(std::string(op) + ": x must have a last axis K >= 1");
}

void check_bias(const std::optional<mx::array>& bias, int n, const char* op) {
  if (!bias) return;
  if (bias->dtype() != mx::float32 || bias->ndim() != 1 || bias->shape(0) != n)
    throw std::invalid_argument(std::string(op) + ": bias must be float32 of shape (N,)");
}

int scale_type(mx::Dtype dtype) {
  if (dtype == mx::float16) return kScaleF16;
  if (dtype == mx::bfloat16) return kScaleBF16;
  return kScaleF32;
}

// One call's integer activations, per calling (stream) thread.
struct QBuffers {
  std::vector<int16_t> q;  // int8 codes use the first half
  std::vector<float> d, sum, qsum, half_sum;
};

// The float sums of each 16 values of M rows of x (row stride K): what Q2_K's minimums, one per 16
// values, meet (the other types' offsets meet the sums of their groups, which quantize() writes).
void half_sums(const float* x, int M, int K, float* out) {
  for (int64_t h = 0; h < static_cast<int64_t>(M) * K / 16; ++h) {
    float total = 0.0f;
    for (int i = 0; i < 16; ++i) total += x[16 * h + i];
    out[h] = total;
  }
}

// Bits per activation code: 16 (default: near-exact, integer products through maddwd/dpwssd)
// or 8 (llama.cpp's choice: fewer operations per weight at many rows, larger logit error).
std::atomic<int>& activation_bits_slot() {
  static std::atomic<int> bits{[] {
    const char* env = std::getenv("BASE_CPU_ACT_BITS");
    return env != nullptr && std::strcmp(env, "8") == 0 ? 8 : 16;
  }()};
  return bits;
}

QActivations quantized_buffers(const QdotKernels& kern, const float* x, int M, int K, int bits, int group_size) {
  thread_local QBuffers buffers;
  // GGUF blocks' codes (Q6_K's carry their scale: up to 4096) meet 16-bit activations only.
  const int width = is_block(bits) ? 16 : activation_bits_slot().load(std::memory_order_relaxed);
  const size_t values = static_cast<size_t>(M) * K, blocks = values / kQBlock;
  if (buffers.q.size() < values) buffers.q.resize(values);
  if (buffers.d.size() < blocks) {
    buffers.d.resize(blocks);
    buffers.sum.resize(blocks);  // groups are at least a block
    buffers.qsum.resize(blocks);
  }
  kern.quantize(x, K, M, K, bits, group_size, width, buffers.q.data(), buffers.d.data(), buffers.sum.data(),
                buffers.qsum.data());
  float* half_sum = nullptr;
  if (bits == kQ2K) {
    if (buffers.half_sum.size() < values / 16) buffers.half_sum.resize(values / 16);
    half_sum = buffers.half_sum.data();
    half_sums(x, M, K, half_sum);
  }
  return QActivations{buffers.q.data(), width, buffers.d.data(), buffers.sum.data(), buffers.qsum.data(), half_sum};
}

// Many rows of x quantized for the integer GEMM (qdot.h's GemmActivations) to activation_bits() codes
// (16-bit ones where the GEMM takes no bytes: AVX2), per calling (stream) thread, the pool's threads
// taking 16 rows at a time.
GemmActivations gemm_buffers(const QdotKernels& kern, const float* x, int M, int K, int type) {
  thread_local std::vector<int16_t> q;
  thread_local std::vector<float> scales;
  // M rounded up to 16, and 16 more where that makes an even number of 64-byte lines: the layout's
  // stride between a row's lane words (rows x 4 bytes) then maps them onto every cache set. A power
  // of two (a 512-row prefill chunk: 2 KiB) left a tile's activations 1/32 of L1's sets and of L2's,
  // and each strip read them again from L3 (the GEMM at 512 rows ran 0.6-0.95x the float one).
  // Up to 8 rows of 16-bit codes on VNNI take the pairs layout (qdot.h): 16 lanes, two a row.
  const int width = kern.gemm_bytes ? activation_bits_slot().load(std::memory_order_relaxed) : 16;
  const bool pairs = kern.gemm_bytes && width == 16 && M <= 8;
  int rows = (M + 15) / 16 * 16;
  if (rows / 16 % 2 == 0 && !pairs) rows += 16;
  const size_t values = static_cast<size_t>(rows) * K;
  if (q.size() < values) q.resize(values);  // 8-bit codes use the first half
  if (scales.size() < values / 8) scales.resize(values / 8);  // d and sum32 (1/32 each), sum16 (1/16)
  float* d = scales.data();
  GemmActivations out{q.data(), width, gemm_code_top(width, type), d, d + values / 32, d + 3 * (values / 32), rows, pairs};
  parallel_for(rows / 16, values, [&](int begin, int end, int) { kern.gemm_quantize(x, K, M, 16 * begin, 16 * end, K, out); });
  return out;
}

// The reordered activations of one affine call, per calling (stream) thread.
float* prepared_buffer(int64_t count) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(count)) buffer.resize(count);
  return buffer.data();
}

// Runs in the dispatched task, when the inputs' contents exist.
void run_dense(const std::vector<mx::array>& in, mx::array& out, bool has_bias) {
  std::vector<std::vector<uint8_t>> held;
  const int k = in[0].shape(-1);
  const int n = in[1].shape(0);
  LinearWeights w{0, 0, 0, row_major(in[1], held), nullptr, nullptr, k, 0, n, k,
                  has_bias ? static_cast<const float*>(row_major(in[2], held)) : nullptr,
                  static_cast<int64_t>(in[1].nbytes())};
  linear_forward(w, static_cast<const float*>(row_major(in[0], held)), static_cast<int>(in[0].size() / k),
                 out.data<float>());
}

void run_affine(const std::vector<mx::array>& in, mx::array& out, int bits, int group_size, bool has_bias) {
  std::vector<std::vector<uint8_t>> held;
  const int k = in[0].shape(-1);
  const int n = in[1].shape(0);
  if (is_block(bits)) {  // inputs x, blocks (N, K / block values * block bytes) uint8 [, bias]
    LinearWeights w{bits, kQBlock, kScaleF32, row_major(in[1], held), nullptr, nullptr, in[1].shape(1), 0, n, k,
                    has_bias ? static_cast<const float*>(row_major(in[2], held)) : nullptr,
                    static_cast<int64_t>(in[1].nbytes())};
    linear_forward(w, static_cast<const float*>(row_major(in[0], held)), static_cast<int>(in[0].size() / k),
                   out.data<float>());
    return;
  }
  LinearWeights w{bits,
                  group_size,
                  scale_type(in[2].dtype()),
                  row_major(in[1], held),
                  row_major(in[2], held),
                  row_major(in[3], held),
                  in[1].shape(1),
                  in[2].shape(1),
                  n,
                  k,
                  has_bias ? static_cast<const float*>(row_major(in[4], held)) : nullptr,
                  static_cast<int64_t>(in[1].nbytes() + in[2].nbytes() + in[3].nbytes())};
  linear_forward(w, static_cast<const float*>(row_major(in[0], held)), static_cast<int>(in[0].size() / k),
                 out.data<float>());
}

class DenseLinear : public mx::UnaryPrimitive {
 public:
  DenseLinear(mx::Stream stream, bool has_bias) : mx::UnaryPrimitive(stream), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    bool has_bias = has_bias_;
    dispatch(stream(), inputs, out,
             [has_bias](const std::vector<mx::array>& in, mx::array& o) { run_dense(in, o, has_bias); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("dense_linear runs on the CPU only");
  }

  const char* name() const override { return "BaseDenseLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const DenseLinear&>(other).has_bias_;
  }

 private:
  bool has_bias_;
};

class AffineLinear : public mx::UnaryPrimitive {
 public:
  AffineLinear(mx::Stream stream, int bits, int group_size, bool has_bias)
      : mx::UnaryPrimitive(stream), bits_(bits), group_size_(group_size), has_bias_(has_bias) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    int bits = bits_, group_size = group_size_;
    bool has_bias = has_bias_;
    dispatch(stream(), inputs, out, [=](const std::vector<mx::array>& in, mx::array& o) {
      run_affine(in, o, bits, group_size, has_bias);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("affine_linear runs on the CPU only");
  }

  const char* name() const override { return "BaseAffineLinear"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const AffineLinear&>(other);
    return bits_ == o.bits_ && group_size_ == o.group_size_ && has_bias_ == o.has_bias_;
  }

 private:
  int bits_;
  int group_size_;
  bool has_bias_;
};

mx::array dense_linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  check_x(x, "dense_linear");
  if (w.dtype() != mx::float32 || w.ndim() != 2 || w.shape(1) != x.shape(-1)) {
    std::ostringstream msg;
    msg << "dense_linear: w must be float32 of shape (N, " << x.shape(-1) << ")";
    throw std::invalid_argument(msg.str());
  }
  check_bias(bias, w.shape(0), "dense_linear");
  std::vector<mx::array> inputs{x, w};
  if (bias) inputs.push_back(*bias);
  return mx::array(out_shape(x, w.shape(0)), mx::float32,
                   std::make_shared<DenseLinear>(mx::default_stream(mx::Device::cpu), bias.has_value()), inputs);
}

mx::array affine_linear(const mx::array& x, const mx::array& codes, const mx::array& scales, const mx::array& biases,
                        int group_size, int bits, const std::optional<mx::array>& bias) {
  check_x(x, "affine_linear");
  int k = x.shape(-1);
  if (bits < 1 || bits > 8 || group_size <= 0 || k % group_size != 0 || (static_cast<int64_t>(k) * bits) % 32 != 0)
    throw std::invalid_argument("affine_linear: K must be a multiple of group_size and of 32 / bits, bits in 1..8");
  if (codes.dtype() != mx::uint32 || codes.ndim() != 2 || codes.shape(1) != k * bits / 32)
    throw std::invalid_argument("affine_linear: codes must be uint32 of shape (N, K * bits / 32)");
  int n = codes.shape(0);
  for (const mx::array* a : {&scales, &biases}) {
    bool float_type = a->dtype() == mx::float32 || a->dtype() == mx::float16 || a->dtype() == mx::bfloat16;
    if (!float_type || a->ndim() != 2 || a->shape(0) != n || a->shape(1) != k / group_size)
      throw std::invalid_argument("affine_linear: scales and biases must be float of shape (N, K / group_size)");
  }
  if (biases.dtype() != scales.dtype())
    throw std::invalid_argument("affine_linear: scales and biases must share one dtype");
  check_bias(bias, n, "affine_linear");
  std::vector<mx::array> inputs{x, codes, scales, biases};
  if (bias) inputs.push_back(*bias);
  auto prim = std::make_shared<AffineLinear>(mx::default_stream(mx::Device::cpu), bits, group_size, bias.has_value());
  return mx::array(out_shape(x, n), mx::float32, std::move(prim), inputs);
}

// The BlockType of a name (GGUF's type name in lower case).
int block_type(const std::string& name) {
  if (name == "q2_k") return kQ2K;
  if (name == "q3_k") return kQ3K;
  if (name == "q4_k") return kQ4K;
  if (name == "q5_k") return kQ5K;
  if (name == "q6_k") return kQ6K;
  if (name == "q4_0") return kQ4_0;
  if (name == "q4_1") return kQ4_1;
  if (name == "q5_0") return kQ5_0;
  if (name == "q5_1") return kQ5_1;
  if (name == "q8_0") return kQ8_0;
  if (name == "iq4_nl") return kIQ4NL;
  if (name == "iq4_xs") return kIQ4XS;
  const std::string runs = "_runs";  // a legacy type in the runs layout (block_runs)
  if (name.size() > runs.size() && name.compare(name.size() - runs.size(), runs.size(), runs) == 0) {
    const int type = block_type(name.substr(0, name.size() - runs.size()));
    if (is_legacy_file_block(type)) return type + kRunsOffset;
  }
  throw std::invalid_argument("unknown block type " + name +
                              ": q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl (each also as q4_0_runs ...), q2_k, q3_k, "
                              "q4_k, q5_k, q6_k or iq4_xs");
}

// blocks (R, K / block values * block bytes) uint8: the row width K they hold, checked.
int block_width(const mx::array& blocks, int type, const char* op) {
  const int bytes = block_bytes(type);
  if (blocks.dtype() != mx::uint8 || blocks.ndim() != 2 || blocks.shape(1) % bytes != 0 || blocks.shape(1) == 0) {
    std::ostringstream msg;
    msg << op << ": blocks must be uint8 of shape (N, K / " << block_values(type) << " * " << bytes << ")";
    throw std::invalid_argument(msg.str());
  }
  return blocks.shape(1) / bytes * block_values(type);
}

mx::array block_linear(const mx::array& x, const mx::array& blocks, const std::string& kind,
                       const std::optional<mx::array>& bias) {
  check_x(x, "block_linear");
  const int type = block_type(kind);
  if (block_width(blocks, type, "block_linear") != x.shape(-1))
    throw std::invalid_argument("block_linear: blocks hold rows of a different K than x's last axis");
  const int n = blocks.shape(0);
  check_bias(bias, n, "block_linear");
  std::vector<mx::array> inputs{x, blocks};
  if (bias) inputs.push_back(*bias);
  auto prim = std::make_shared<AffineLinear>(mx::default_stream(mx::Device::cpu), type, kQBlock, bias.has_value());
  return mx::array(out_shape(x, n), mx::float32, std::move(prim), inputs);
}

class BlockRows : public mx::UnaryPrimitive {
 public:
  BlockRows(mx::Stream stream, int type) : mx::UnaryPrimitive(stream), type_(type) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int type = type_;
    dispatch(stream(), inputs, out, [type](const std::vector<mx::array>& in, mx::array& o) {
      std::vector<std::vector<uint8_t>> held;
      const int k = o.shape(-1);
      kernels().block_rows(type, static_cast<const uint8_t*>(row_major(in[0], held)), in[0].shape(1),
                           in[0].shape(0), k, o.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("block_dequantize runs on the CPU only");
  }

  const char* name() const override { return "BaseBlockRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return type_ == static_cast<const BlockRows&>(other).type_;
  }

 private:
  int type_;
};

// A legacy row's full runs of 8 blocks rewritten field by field (kernels.h's kQ*Runs): per run,
// the 8 blocks' d, then m, then qh fields (each where the type has it), then their qs; a row's last
// blocks as they are. `out` may be `in` (each run is read whole before it is written).
template <int TYPE>
void runs_layout_as(const uint8_t* in, int64_t ld, int64_t rows, int blocks, uint8_t* out) {
  constexpr int bytes = block_bytes(TYPE);
  constexpr int sizes[4] = {2, legacy_has_min(TYPE) ? 2 : 0, legacy_has_high_bits(TYPE) ? 4 : 0,
                            bytes - legacy_qs_at(TYPE)};
  const int full = blocks / 8 * 8;
  // Rows split among the pool's threads (a 0.5B model's weights take a few hundred MB).
  parallel_for(static_cast<int>(rows), static_cast<size_t>(rows) * blocks * bytes, [&](int begin, int end, int) {
    uint8_t run[8 * bytes];
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* src = in + r * ld;
      uint8_t* dst = out + r * static_cast<int64_t>(blocks) * bytes;
      for (int b0 = 0; b0 < full; b0 += 8) {
        std::memcpy(run, src + static_cast<int64_t>(b0) * bytes, sizeof run);
        uint8_t* to = dst + static_cast<int64_t>(b0) * bytes;
        int from = 0;
        for (int size : sizes) {
          for (int j = 0; j < 8; ++j, to += size) std::memcpy(to, run + j * bytes + from, size);
          from += size;
        }
      }
      if (dst != src)
        std::memcpy(dst + static_cast<int64_t>(full) * bytes, src + static_cast<int64_t>(full) * bytes,
                    static_cast<size_t>(blocks - full) * bytes);
    }
  });
}

void runs_layout(int type, const uint8_t* in, int64_t ld, int64_t rows, int blocks, uint8_t* out) {
  switch (type) {
    case kQ4_0: return runs_layout_as<kQ4_0>(in, ld, rows, blocks, out);
    case kQ4_1: return runs_layout_as<kQ4_1>(in, ld, rows, blocks, out);
    case kQ5_0: return runs_layout_as<kQ5_0>(in, ld, rows, blocks, out);
    case kQ5_1: return runs_layout_as<kQ5_1>(in, ld, rows, blocks, out);
    case kIQ4NL: return runs_layout_as<kIQ4NL>(in, ld, rows, blocks, out);
    default: return runs_layout_as<kQ8_0>(in, ld, rows, blocks, out);
  }
}

// block_runs' primitive: the output takes the input's buffer where nothing else holds it (a
// model's weights as they load), so the layout costs no second copy.
class BlockRuns : public mx::UnaryPrimitive {
 public:
  BlockRuns(mx::Stream stream, int type) : mx::UnaryPrimitive(stream), type_(type) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const int type = type_;
    const mx::array& in = inputs[0];
    auto& encoder = mx::cpu::get_command_encoder(stream());
    if (in.flags().row_contiguous && in.is_donatable()) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([in, out, type]() mutable {
      std::vector<std::vector<uint8_t>> held;
      runs_layout(type, static_cast<const uint8_t*>(row_major(in, held)), in.shape(1),
                  in.shape(0), in.shape(1) / block_bytes(type), out.data<uint8_t>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("block_runs runs on the CPU only");
  }

  const char* name() const override { return "BaseBlockRuns"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return type_ == static_cast<const BlockRuns&>(other).type_;
  }

 private:
  int type_;
};

mx::array block_runs(const mx::array& blocks, const std::string& kind) {
  const int type = block_type(kind);
  if (!is_legacy_file_block(type))
    throw std::invalid_argument("block_runs: " + kind +
                                " is not a legacy block type (q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl)");
  block_width(blocks, type, "block_runs");
  return mx::array(blocks.shape(), mx::uint8, std::make_shared<BlockRuns>(mx::default_stream(mx::Device::cpu), type),
                   {blocks});
}

mx::array block_dequantize(const mx::array& blocks, const std::string& kind) {
  const int type = block_type(kind);
  const int k = block_width(blocks, type, "block_dequantize");
  return mx::array({blocks.shape(0), k}, mx::float32,
                   std::make_shared<BlockRows>(mx::default_stream(mx::Device::cpu), type), {blocks});
}

}  // namespace

void linear_forward(const LinearWeights& w, const float* x, int M, float* y) {
  const LinearKernels& kern = kernels();
  const int n = w.N, k = w.K;
  // The pool is woken for calls with at least min_parallel_bytes() of weight reads per activation
  // row, times the rows: several rows make a small weight's call compute-bound (SmolLM2's q/k/v
  // at 8 rows took 400 us on one thread), one row keeps the 512 KiB rule.
  const size_t bytes = static_cast<size_t>(w.bytes) * static_cast<size_t>(M);
  if (w.bits == 0) {
    DenseArgs args{x, k, M, static_cast<const float*>(w.w), k, k, w.bias, y, n};
    const int chunk = chunk_rows(n, bytes);
    parallel_for((n + chunk - 1) / chunk, bytes, [&](int begin, int end, int thread) {
      float* scratch = M >= kGemmMinRows ? thread_scratch(thread, static_cast<size_t>(kAffineScratchRows) * k) : nullptr;
      kern.dense(args, begin * chunk, end * chunk < n ? end * chunk : n, scratch);
    });
    return;
  }
  const QdotKernels& q = qdot_kernels();
  if (M >= q.gemm_min_rows && !exact_now() && q.gemm != nullptr && is_block(w.bits)) {
    GemmArgs args{gemm_buffers(q, x, M, k, w.bits), M, k, static_cast<const uint8_t*>(w.w), w.ld_codes, w.bits, w.bias, y, n};
    const int chunk = chunk_rows(n, bytes);
    parallel_for((n + chunk - 1) / chunk, bytes, [&](int begin, int end, int thread) {
      float* scratch = thread_scratch(thread, static_cast<size_t>(gemm_scratch_floats(k, args.x.rows)));
      q.gemm(args, begin * chunk, end * chunk < n ? end * chunk : n, scratch);
    });
    return;
  }
  if (M <= kQdotMaxRows && !exact_now() && qdot_supports(w.bits, w.group_size, k)) {
    QdotArgs args{quantized_buffers(q, x, M, k, w.bits, w.group_size),
                  M,
                  k,
                  static_cast<const uint8_t*>(w.w),
                  is_block(w.bits) ? w.ld_codes : w.ld_codes * static_cast<int64_t>(sizeof(uint32_t)),
                  w.scales,
                  w.biases,
                  w.ld_scales,
                  w.scale_type,
                  w.bits,
                  w.group_size,
                  w.bias,
                  y,
                  n};
    const int chunk = chunk_rows(n, bytes);
    parallel_for((n + chunk - 1) / chunk, bytes, [&](int begin, int end, int thread) {
      float* scratch = thread_scratch(thread, static_cast<size_t>(qdot_scratch_floats(k)));
      q.matmul(args, begin * chunk, end * chunk < n ? end * chunk : n, scratch);
    });
    return;
  }
  AffineArgs args{x,        k,           M,           static_cast<const uint32_t*>(w.w), w.ld_codes, w.scales,
                  w.biases, w.ld_scales, w.scale_type, w.bits,                            w.group_size, k,
                  w.bias,   y,           n,           nullptr};
  int64_t prepared = kern.affine_prepared_size(args);
  if (prepared > 0) {
    float* xp = prepared_buffer(prepared);
    kern.affine_prepare(args, xp);
    args.xp = xp;
  }
  const int chunk = chunk_rows(n, bytes);
  parallel_for((n + chunk - 1) / chunk, bytes, [&](int begin, int end, int thread) {
    float* scratch = thread_scratch(thread, static_cast<size_t>(kAffineScratchRows) * k);
    kern.affine(args, begin * chunk, end * chunk < n ? end * chunk : n, scratch);
  });
}

// XOR of every 8-byte word of `a`, read by all the pool's threads: a plain forward read of the
// buffer, the memory roofline a decode matmul is held to (`base bench --synthetic`).
uint64_t read_xor(mx::array a) {
  a.eval();
  const uint64_t* words = a.data<uint64_t>();
  const int64_t count = static_cast<int64_t>(a.nbytes() / sizeof(uint64_t));
  constexpr int64_t kChunkWords = 1 << 17;  // 1 MiB a claim
  const int chunks = static_cast<int>((count + kChunkWords - 1) / kChunkWords);
  std::vector<uint64_t> partial(static_cast<size_t>(num_threads()) * 8, 0);  // a line per thread
  parallel_for(chunks, a.nbytes(), [&](int begin, int end, int thread) {
    uint64_t acc[8] = {};
    const int64_t stop = std::min<int64_t>(count, static_cast<int64_t>(end) * kChunkWords);
    int64_t i = static_cast<int64_t>(begin) * kChunkWords;
    for (; i + 8 <= stop; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] ^= words[i + j];
    for (; i < stop; ++i) acc[0] ^= words[i];
    for (int j = 0; j < 8; ++j) partial[static_cast<size_t>(thread) * 8] ^= acc[j];
  });
  uint64_t total = 0;
  for (uint64_t v : partial) total ^= v;
  return total;
}

void register_linear(nb::module_& m) {
  m.def("read_xor", &read_xor, nb::arg("a"),
        "XOR of a's 8-byte words, read forward by every pool thread (a memory bandwidth probe).");
  m.def(
      "set_exact",
      [](std::optional<bool> exact) { exact_slot().store(exact ? (*exact ? kExactYes : kExactNo) : kExactAuto); },
      nb::arg("exact").none(),
      "Quantized matmuls with float32 activations (True, the exact path), integer ones (False), or "
      "integer ones where the ISA has SIMD integer kernels (None, the default).");
  m.def(
      "exact", [] { return exact_now(); }, "Whether quantized matmuls keep float32 activations now.");
  m.def(
      "exact_setting",
      [] {
        int exact = exact_slot().load();
        return exact == kExactAuto ? std::optional<bool>() : std::optional<bool>(exact == kExactYes);
      },
      "What set_exact (or BASE_CPU_EXACT) asked for: True, False, or None (by instruction set).");
  m.def(
      "set_activation_bits",
      [](int bits) {
        if (bits != 8 && bits != 16) throw std::invalid_argument("activation bits must be 8 or 16");
        activation_bits_slot().store(bits);
      },
      nb::arg("bits"),
      "Bits per activation code on the integer path: 16 (default) or 8 (BASE_CPU_ACT_BITS): the affine layers' "
      "and, from block_gemm_min_rows rows, the GGUF blocks' VNNI GEMM (8: a faster prefill, larger logit error).");
  m.def(
      "activation_bits", [] { return activation_bits_slot().load(); }, "Bits per activation code (8 or 16).");
  m.def(
      "set_claims_per_thread", [](int claims) { claims_slot().store(claims < 0 ? 0 : claims); }, nb::arg("claims"),
      "About how many runs of rows each thread claims of a large matmul (BASE_CPU_CLAIMS; 0: 16 rows a claim).");
  m.def(
      "qdot_max_rows", [] { return kQdotMaxRows; },
      "Activation rows up to which quantized matmuls take integer activations (more: float32).");
  m.def(
      "block_gemm_min_rows", [] { return qdot_kernels().gemm_min_rows; },
      "Activation rows from which GGUF block matmuls take the integer GEMM on this instruction set (0: it has none).");
  m.def(
      "integer_gemm", [] { return qdot_kernels().gemm != nullptr; },
      "Whether GGUF block matmuls from block_gemm_min_rows rows (and past qdot_max_rows) take the integer GEMM "
      "(VNNI's: activation_bits() codes; AVX2's: 16-bit ones) on this instruction set, off the exact path; "
      "otherwise they multiply float32 activations past qdot_max_rows.");
  m.def(
      "qdot_isa", [] { return std::string(qdot_kernels().name); },
      "The instruction set of the integer-activation kernels (avx512-vnni, avx2 or generic).");
  m.def("dense_linear", &dense_linear, nb::arg("x"), nb::arg("w"), nb::arg("bias") = nb::none(),
        "x (..., K) @ w(N, K).T (+ bias): float32, each weight row read once per call.");
  m.def("affine_linear", &affine_linear, nb::arg("x"), nb::arg("codes"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("group_size"), nb::arg("bits"), nb::arg("bias") = nb::none(),
        "x (..., K) @ dequantize(codes, scales, biases).T (+ bias), decoding the weight as it streams.");
  m.def("block_linear", &block_linear, nb::arg("x"), nb::arg("blocks"), nb::arg("kind"),
        nb::arg("bias") = nb::none(),
        "x (..., K) @ W.T (+ bias), W rows of GGUF blocks (kind q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_k, q3_k, "
        "q4_k, q5_k, q6_k or iq4_xs; "
        "a legacy kind with _runs: block_runs' layout; uint8 (N, bytes)).");
  m.def("block_runs", &block_runs, nb::arg("blocks"), nb::arg("kind"),
        "Rows of legacy GGUF blocks (kind q4_0 ... q8_0, iq4_nl) in the runs layout the kernels read fastest (kind "
        "q4_0_runs ...): each full run of 8 blocks field by field (8 d, 8 m, 8 qh, 8 qs), the same bytes.");
  m.def("block_dequantize", &block_dequantize, nb::arg("blocks"), nb::arg("kind"),
        "The float32 values (R, K) of R rows of GGUF blocks (uint8 (R, bytes)).");
}

}  // namespace base_cpu
