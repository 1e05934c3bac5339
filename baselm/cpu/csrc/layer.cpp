// A whole pre-norm decoder layer (Llama's shape) as one MLX primitive for few-row steps:
//   h = x + o_proj(attention(rope(q), write(rope(k), v)))     q, k, v = split(qkv_proj(rms_norm(x)))
//   out = h + down_proj(act(gate) * up)                        gate, up = split(gate_up_proj(rms_norm(h)))
// MLX's CPU backend runs a graph node at a time and a decode step of a small model is mostly
// such nodes; here a layer is one node, its phases run back to back on the stream's thread
// and each matmul and the attention still share their rows out over the pool. The maths is
// that of the per-op kernels (linear.cpp, attention.cpp, fused.cpp), whose loops it calls.
// Outputs: the layer's hidden states and the two KV pools with this step's rows written (in
// place when the graph holds the pools' only reference, as write_pool does).
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "attention.h"
#include "fused.h"
#include "kernels.h"
#include "linear.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "primitive.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

// Fixed input slots; the four linears' parts follow (see LayerParams::first).
enum Slot : int {
  kX = 0, kPositions, kSlots, kTables, kContextLens, kStarts, kKeyPool, kValuePool, kNorm1, kNorm2, kFreqs, kFixed
};
enum Proj : int { kQkv = 0, kO, kGateUp, kDown, kNumProj };

struct LayerParams {
  float eps, mscale, scale, softcap;
  int rope_dims;  // 0: no rotation
  bool traditional;
  int num_heads, num_kv_heads, head_dim, block_size, window, act;
  int bits[kNumProj], group_size[kNumProj], first[kNumProj];
  bool has_bias[kNumProj];

  bool operator==(const LayerParams& o) const { return std::memcmp(this, &o, sizeof *this) == 0; }
};

int scale_code(mx::Dtype dtype) {
  if (dtype == mx::float16) return kScaleF16;
  if (dtype == mx::bfloat16) return kScaleBF16;
  return kScaleF32;
}

using Held = std::vector<std::vector<uint8_t>>;

LinearWeights weights_of(const LayerParams& p, int proj, const std::vector<mx::array>& in, Held& held) {
  const int at = p.first[proj];
  const mx::array& w = in[at];
  const int parts = p.bits[proj] == 0 ? 1 : 3;
  const float* bias = p.has_bias[proj] ? static_cast<const float*>(row_major(in[at + parts], held)) : nullptr;
  if (p.bits[proj] == 0) {
    return LinearWeights{0, 0, 0, row_major(w, held), nullptr, nullptr, w.shape(1), 0, w.shape(0), w.shape(1), bias,
                         static_cast<int64_t>(w.nbytes())};
  }
  const mx::array& s = in[at + 1];
  const mx::array& b = in[at + 2];
  return LinearWeights{p.bits[proj],
                       p.group_size[proj],
                       scale_code(s.dtype()),
                       row_major(w, held),
                       row_major(s, held),
                       row_major(b, held),
                       w.shape(1),
                       s.shape(1),
                       w.shape(0),
                       static_cast<int>(w.shape(1) * 32 / p.bits[proj]),
                       bias,
                       static_cast<int64_t>(w.nbytes() + s.nbytes() + b.nbytes())};
}

// The layer's float buffers for `tokens` rows, reused across calls on the stream's thread.
struct Buffers {
  float *xn, *qkv, *q, *attn, *gate_up, *act, *down;
};

Buffers buffers(int tokens, int hidden, int qkv_width, int q_width, int inter) {
  thread_local std::vector<float> storage;
  const size_t sizes[] = {size_t(hidden), size_t(qkv_width), size_t(q_width), size_t(q_width), size_t(2 * inter),
                          size_t(inter), size_t(hidden)};
  size_t total = 0;
  for (size_t s : sizes) total += s * tokens;
  if (storage.size() < total) storage.resize(total);
  float* at = storage.data();
  float* parts[7];
  for (int i = 0; i < 7; ++i) {
    parts[i] = at;
    at += sizes[i] * tokens;
  }
  return Buffers{parts[0], parts[1], parts[2], parts[3], parts[4], parts[5], parts[6]};
}

// Rotates q into b.q and k into the key pool's slots, copies v into the value pool's slots.
void rotate_and_write(const LayerParams& p, const FusedKernels& fk, const std::vector<mx::array>& in, Held& held,
                      const Buffers& b, int tokens, int qkv_width, float* key_pool, float* value_pool,
                      int64_t num_slots) {
  const int q_width = p.num_heads * p.head_dim, kv_width = p.num_kv_heads * p.head_dim;
  const int32_t* positions = static_cast<const int32_t*>(row_major(in[kPositions], held));
  const int32_t* slots = static_cast<const int32_t*>(row_major(in[kSlots], held));
  std::vector<float> inv(p.rope_dims / 2);
  if (p.rope_dims > 0) {
    const float* freqs = static_cast<const float*>(row_major(in[kFreqs], held));
    for (int i = 0; i < p.rope_dims / 2; ++i) inv[i] = 1.0f / freqs[i];
  }
  for (int t = 0; t < tokens; ++t) {
    const float* row = b.qkv + int64_t(t) * qkv_width;
    float* q = b.q + int64_t(t) * q_width;
    const bool stored = slots[t] >= 0 && slots[t] < num_slots;
    float* k = stored ? key_pool + int64_t(slots[t]) * kv_width : nullptr;
    if (p.rope_dims > 0) {
      // One token at a time: the kernel indexes x and y by token, so each call sees token 0.
      fk.rope(row, positions + t, inv.data(), p.num_heads, p.head_dim, p.rope_dims, p.traditional, p.mscale, q, 0, 1);
      if (stored)
        fk.rope(row + q_width, positions + t, inv.data(), p.num_kv_heads, p.head_dim, p.rope_dims, p.traditional,
                p.mscale, k, 0, 1);
    } else {
      std::memcpy(q, row, sizeof(float) * q_width);
      if (stored) std::memcpy(k, row + q_width, sizeof(float) * kv_width);
    }
    if (stored) std::memcpy(value_pool + int64_t(slots[t]) * kv_width, row + q_width + kv_width, sizeof(float) * kv_width);
  }
}

void attend(const LayerParams& p, const std::vector<mx::array>& in, Held& held, const Buffers& b, const float* keys,
            const float* values) {
  const mx::array& tables = in[kTables];
  AttentionArgs args;
  args.shape = AttentionShape{p.num_heads, p.num_kv_heads, p.head_dim, p.block_size, tables.shape(1), p.scale,
                              p.softcap,   p.window,       int64_t(p.num_heads) * p.head_dim, p.head_dim};
  args.queries = b.q;
  args.out = b.attn;
  args.keys = PoolView{keys, nullptr, nullptr, 0, 0, 0};
  args.values = PoolView{values, nullptr, nullptr, 0, 0, 0};
  args.block_tables = static_cast<const int32_t*>(row_major(tables, held));
  args.context_lens = static_cast<const int32_t*>(row_major(in[kContextLens], held));
  args.query_starts = static_cast<const int32_t*>(row_major(in[kStarts], held));
  attend_step(args, in[kContextLens].shape(0));
}

void add_rows(float* y, const float* a, const float* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = a[i] + b[i];
}

// The dispatched task: runs when the inputs' contents exist; the pools' buffers are outputs.
void run_layer(const LayerParams& p, const std::vector<mx::array>& in, float* out, float* key_pool, float* value_pool) {
  Held held;
  const FusedKernels& fk = active_fused_kernels();
  const int tokens = in[kX].shape(0), hidden = in[kX].shape(1);
  const LinearWeights qkv = weights_of(p, kQkv, in, held), o = weights_of(p, kO, in, held);
  const LinearWeights gate_up = weights_of(p, kGateUp, in, held), down = weights_of(p, kDown, in, held);
  const Buffers b = buffers(tokens, hidden, qkv.N, p.num_heads * p.head_dim, gate_up.N / 2);
  const float* x = static_cast<const float*>(row_major(in[kX], held));
  const mx::array& pool = in[kKeyPool];
  const int64_t num_slots = int64_t(pool.shape(0)) * pool.shape(1);

  fk.rms_norm(x, static_cast<const float*>(row_major(in[kNorm1], held)), 0.0f, p.eps, hidden, b.xn, 0, tokens);
  linear_forward(qkv, b.xn, tokens, b.qkv);
  rotate_and_write(p, fk, in, held, b, tokens, qkv.N, key_pool, value_pool, num_slots);
  attend(p, in, held, b, key_pool, value_pool);
  linear_forward(o, b.attn, tokens, b.down);
  add_rows(out, x, b.down, int64_t(tokens) * hidden);  // h

  fk.rms_norm(out, static_cast<const float*>(row_major(in[kNorm2], held)), 0.0f, p.eps, hidden, b.xn, 0, tokens);
  linear_forward(gate_up, b.xn, tokens, b.gate_up);
  fk.gated(b.gate_up, gate_up.N / 2, p.act, b.act, 0, tokens);
  linear_forward(down, b.act, tokens, b.down);
  add_rows(out, out, b.down, int64_t(tokens) * hidden);
}

class DecoderLayer : public mx::Primitive {
 public:
  DecoderLayer(mx::Stream stream, LayerParams params) : mx::Primitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    outputs[0].set_data(mx::allocator::malloc(outputs[0].nbytes()));
    bool shared[2];
    for (int i = 0; i < 2; ++i) {
      const mx::array& pool = inputs[kKeyPool + i];
      if (pool.is_donatable() && pool.flags().row_contiguous) {
        outputs[1 + i].copy_shared_buffer(pool);
      } else {
        outputs[1 + i].set_data(mx::allocator::malloc(outputs[1 + i].nbytes()));
      }
      shared[i] = outputs[1 + i].data_shared_ptr() == pool.data_shared_ptr();
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) encoder.set_output_array(out);
    // NOTE: the task may run after this primitive is gone, so it holds a copy of the parameters.
    encoder.dispatch([inputs, out = mx::array::unsafe_weak_copy(outputs[0]),
                      keys = mx::array::unsafe_weak_copy(outputs[1]), values = mx::array::unsafe_weak_copy(outputs[2]),
                      shared0 = shared[0], shared1 = shared[1], params = params_]() mutable {
      Held held;
      if (!shared0) std::memcpy(keys.data<uint8_t>(), row_major(inputs[kKeyPool], held), keys.nbytes());
      if (!shared1) std::memcpy(values.data<uint8_t>(), row_major(inputs[kValuePool], held), values.nbytes());
      run_layer(params, inputs, out.data<float>(), keys.data<float>(), values.data<float>());
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("decoder_layer: the CPU kernel has no GPU path");
  }

  const char* name() const override { return "BaseDecoderLayer"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return params_ == static_cast<const DecoderLayer&>(other).params_;
  }

 private:
  LayerParams params_;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("decoder_layer: " + what);
}

// Checks one projection's parts (weight, or codes/scales/biases; then an optional bias) and
// appends them to `inputs`; returns its output width.
int add_linear(const std::vector<mx::array>& parts, int bits, int group_size, int k, LayerParams& p, int proj,
               std::vector<mx::array>& inputs) {
  const size_t base = bits == 0 ? 1 : 3;
  require(parts.size() == base || parts.size() == base + 1, "a projection is [weight] or [codes, scales, biases], "
                                                            "then an optional bias");
  const mx::array& w = parts[0];
  require(w.ndim() == 2, "projection weights must be 2-D");
  const int n = w.shape(0);
  if (bits == 0) {
    require(w.dtype() == mx::float32 && w.shape(1) == k, "float projection weights must be float32 (N, K)");
  } else {
    require(bits >= 1 && bits <= 8 && group_size > 0 && k % group_size == 0 && (int64_t(k) * bits) % 32 == 0,
            "quantized projections need K a multiple of group_size and of 32 / bits");
    require(w.dtype() == mx::uint32 && w.shape(1) == k * bits / 32, "codes must be uint32 (N, K * bits / 32)");
    for (int i = 1; i < 3; ++i) {
      const mx::array& s = parts[i];
      bool float_type = s.dtype() == mx::float32 || s.dtype() == mx::float16 || s.dtype() == mx::bfloat16;
      require(float_type && s.dtype() == parts[1].dtype() && s.ndim() == 2 && s.shape(0) == n &&
                  s.shape(1) == k / group_size,
              "scales and biases must be float (N, K / group_size) of one dtype");
    }
  }
  p.has_bias[proj] = parts.size() == base + 1;
  if (p.has_bias[proj]) {
    const mx::array& bias = parts[base];
    require(bias.dtype() == mx::float32 && bias.ndim() == 1 && bias.shape(0) == n, "biases must be float32 (N,)");
  }
  p.bits[proj] = bits;
  p.group_size[proj] = bits == 0 ? 0 : group_size;
  p.first[proj] = static_cast<int>(inputs.size());
  inputs.insert(inputs.end(), parts.begin(), parts.end());
  return n;
}

int activation_code(const std::string& act) {
  if (act == "silu") return kSilu;
  if (act == "gelu_tanh") return kGeluTanh;
  if (act == "gelu") return kGeluErf;
  throw std::invalid_argument("decoder_layer: act must be silu, gelu_tanh or gelu, got " + act);
}

void check_step(const mx::array& x, const mx::array& positions, const mx::array& slots, const mx::array& tables,
                const mx::array& context_lens, const mx::array& starts, const mx::array& key_pool,
                const mx::array& value_pool, const LayerParams& p) {
  require(x.dtype() == mx::float32 && x.ndim() == 2, "x must be float32 (num_tokens, hidden)");
  const int tokens = x.shape(0);
  for (const mx::array* a : {&positions, &slots, &tables, &context_lens, &starts})
    require(a->dtype() == mx::int32, "positions, slots, block tables, context lengths and query starts must be int32");
  require(positions.ndim() == 1 && positions.shape(0) == tokens && slots.ndim() == 1 && slots.shape(0) == tokens,
          "positions and slot_mapping must be (num_tokens,)");
  require(tables.ndim() == 2 && context_lens.ndim() == 1 && starts.ndim() == 1 &&
              tables.shape(0) == context_lens.shape(0) && starts.shape(0) == context_lens.shape(0) + 1,
          "block_tables (num_seqs, max_blocks), context_lens (num_seqs,), query_starts (num_seqs + 1,)");
  require(p.head_dim % 16 == 0, "head_dim must be a multiple of 16");
  require(p.num_kv_heads > 0 && p.num_heads % p.num_kv_heads == 0, "heads must be a multiple of kv_heads");
  for (const mx::array* pool : {&key_pool, &value_pool}) {
    require(pool->dtype() == mx::float32 && pool->ndim() == 4 && pool->shape(1) == p.block_size &&
                pool->shape(2) == p.num_kv_heads && pool->shape(3) == p.head_dim,
            "pools must be float32 (num_blocks, block_size, kv_heads, head_dim)");
  }
}

std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& positions, const mx::array& slots,
                                     const mx::array& tables, const mx::array& context_lens, const mx::array& starts,
                                     const mx::array& key_pool, const mx::array& value_pool,
                                     const std::vector<mx::array>& norms, const std::vector<std::vector<mx::array>>& linears,
                                     const std::vector<int>& bits, const std::vector<int>& group_sizes,
                                     const std::optional<mx::array>& freqs, int rope_dims, bool traditional,
                                     float mscale, int num_heads, float scale, std::optional<float> softcap,
                                     std::optional<int> window, float eps, const std::string& act) {
  LayerParams p{};
  p.eps = eps;
  p.mscale = mscale;
  p.scale = scale;
  p.softcap = softcap.value_or(0.0f);
  p.traditional = traditional;
  p.num_heads = num_heads;
  p.num_kv_heads = key_pool.ndim() == 4 ? key_pool.shape(2) : 0;
  p.head_dim = key_pool.ndim() == 4 ? key_pool.shape(3) : 0;
  p.block_size = key_pool.ndim() == 4 ? key_pool.shape(1) : 0;
  p.window = window.value_or(0);
  p.act = activation_code(act);
  check_step(x, positions, slots, tables, context_lens, starts, key_pool, value_pool, p);
  const int hidden = x.shape(1);
  require(norms.size() == 2, "norms must be [input norm weight, post-attention norm weight]");
  for (auto& w : norms) require(w.dtype() == mx::float32 && w.ndim() == 1 && w.shape(0) == hidden, "norm weights must be float32 (hidden,)");
  require(!freqs || (freqs->dtype() == mx::float32 && freqs->ndim() == 1 && rope_dims > 0 && rope_dims % 2 == 0 &&
                     rope_dims <= p.head_dim && freqs->shape(0) == rope_dims / 2),
          "freqs must be float32 (rope_dims / 2,), rope_dims even and at most head_dim");
  p.rope_dims = freqs ? rope_dims : 0;
  require(linears.size() == kNumProj && bits.size() == kNumProj && group_sizes.size() == kNumProj,
          "linears, bits and group_sizes list qkv, o, gate_up and down");

  std::vector<mx::array> inputs{x, positions, slots, tables, context_lens, starts, key_pool, value_pool, norms[0],
                                norms[1], freqs ? *freqs : x};
  const int q_width = num_heads * p.head_dim, kv_width = p.num_kv_heads * p.head_dim;
  require(add_linear(linears[kQkv], bits[kQkv], group_sizes[kQkv], hidden, p, kQkv, inputs) == q_width + 2 * kv_width,
          "the qkv projection must have heads * head_dim + 2 * kv_heads * head_dim outputs");
  require(add_linear(linears[kO], bits[kO], group_sizes[kO], q_width, p, kO, inputs) == hidden,
          "o_proj must map heads * head_dim to hidden");
  const int gate_up = add_linear(linears[kGateUp], bits[kGateUp], group_sizes[kGateUp], hidden, p, kGateUp, inputs);
  require(gate_up % 2 == 0, "gate_up must have an even number of outputs [gate | up]");
  require(add_linear(linears[kDown], bits[kDown], group_sizes[kDown], gate_up / 2, p, kDown, inputs) == hidden,
          "down_proj must map intermediate to hidden");
  auto prim = std::make_shared<DecoderLayer>(mx::default_stream(mx::Device::cpu), p);
  return mx::array::make_arrays({x.shape(), key_pool.shape(), value_pool.shape()},
                                {mx::float32, mx::float32, mx::float32}, std::move(prim), std::move(inputs));
}

}  // namespace

void register_layer(nb::module_& m) {
  m.def("decoder_layer", &decoder_layer, nb::arg("x"), nb::arg("positions"), nb::arg("slot_mapping"),
        nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("query_starts"), nb::arg("key_pool"),
        nb::arg("value_pool"), nb::arg("norms"), nb::arg("linears"), nb::arg("bits"), nb::arg("group_sizes"),
        nb::arg("freqs").none(), nb::arg("rope_dims"), nb::arg("traditional"), nb::arg("mscale"),
        nb::arg("num_heads"), nb::arg("scale"), nb::arg("softcap").none(), nb::arg("window").none(), nb::arg("eps"),
        nb::arg("act"),
        "A pre-norm decoder layer over float32 pools as one graph node: [hidden out, key pool, value pool].");
}

}  // namespace base_cpu
