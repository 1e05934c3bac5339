// A whole pre-norm decoder layer (Llama's shape) as four MLX graph nodes for few-row steps:
//   h = x + o_proj(attention(rope(q), write(rope(k), v)))     q, k, v = split(qkv_proj(rms_norm(x)))
//   out = h + down_proj(act(gate) * up)                        gate, up = split(gate_up_proj(rms_norm(h)))
// MLX's CPU backend runs a graph node at a time and a decode step of a small model is mostly
// such nodes; here a layer is four: the attention's input (norm, q/k/v, RoPE: q, k, v out), the
// KV write of each pool (write_pool, in place when the graph holds the pool's only reference;
// a node with the pools among several outputs could never be donated them), and the rest of
// the layer (attention to the final residual). Each runs its phases back to back on the
// stream's thread; each matmul and the attention still share their rows out over the pool.
// The maths is that of the per-op kernels (linear.cpp, attention.cpp, fused.cpp): their loops.
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
#include "pool_write.h"
#include "primitive.h"
#include "qdot.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

// Input slots of the two nodes; the projections' parts follow (see LayerParams::first).
enum InSlot : int { kX = 0, kPositions, kNorm1, kFreqs };  // the attention's input
enum OutSlot : int { kResidual = 0, kQueries, kKeyPool, kValuePool, kTables, kContextLens, kStarts, kNorm2 };
enum Proj : int { kQkv = 0, kO, kGateUp, kDown, kNumProj };
// A projection is one matrix or up to kMaxPieces stacked along N (q, k, v of different formats,
// as GGUF files mix them): each piece runs on its own and its columns land in the stacked output.
constexpr int kMaxPieces = 3;

struct LayerParams {
  float eps, mscale, scale, softcap;
  int rope_dims;  // 0: no rotation
  bool traditional;
  int num_heads, num_kv_heads, head_dim, block_size, window, act;
  int pieces[kNumProj];
  int bits[kNumProj][kMaxPieces], group_size[kNumProj][kMaxPieces], first[kNumProj][kMaxPieces];
  bool has_bias[kNumProj][kMaxPieces];

  bool operator==(const LayerParams& o) const {
    bool same = eps == o.eps && mscale == o.mscale && scale == o.scale && softcap == o.softcap &&
                rope_dims == o.rope_dims && traditional == o.traditional && num_heads == o.num_heads &&
                num_kv_heads == o.num_kv_heads && head_dim == o.head_dim && block_size == o.block_size &&
                window == o.window && act == o.act;
    for (int i = 0; i < kNumProj && same; ++i) {
      same = pieces[i] == o.pieces[i];
      for (int j = 0; j < pieces[i] && same; ++j)
        same = bits[i][j] == o.bits[i][j] && group_size[i][j] == o.group_size[i][j] && first[i][j] == o.first[i][j] &&
               has_bias[i][j] == o.has_bias[i][j];
    }
    return same;
  }
};

int scale_code(mx::Dtype dtype) {
  if (dtype == mx::float16) return kScaleF16;
  if (dtype == mx::bfloat16) return kScaleBF16;
  return kScaleF32;
}

using Held = std::vector<std::vector<uint8_t>>;

LinearWeights weights_of(const LayerParams& p, int proj, int piece, const std::vector<mx::array>& in, Held& held) {
  const int at = p.first[proj][piece], bits = p.bits[proj][piece];
  const mx::array& w = in[at];
  const int parts = bits == 0 || is_block(bits) ? 1 : 3;
  const float* bias = p.has_bias[proj][piece] ? static_cast<const float*>(row_major(in[at + parts], held)) : nullptr;
  if (bits == 0) {
    return LinearWeights{0, 0, 0, row_major(w, held), nullptr, nullptr, w.shape(1), 0, w.shape(0), w.shape(1), bias,
                         static_cast<int64_t>(w.nbytes())};
  }
  if (is_block(bits)) {  // ld_codes counts bytes
    return LinearWeights{bits, kQBlock, kScaleF32, row_major(w, held), nullptr, nullptr, w.shape(1), 0,
                         w.shape(0), w.shape(1) / block_bytes(bits) * block_values(bits), bias,
                         static_cast<int64_t>(w.nbytes())};
  }
  const mx::array& s = in[at + 1];
  const mx::array& b = in[at + 2];
  return LinearWeights{bits,
                       p.group_size[proj][piece],
                       scale_code(s.dtype()),
                       row_major(w, held),
                       row_major(s, held),
                       row_major(b, held),
                       w.shape(1),
                       s.shape(1),
                       w.shape(0),
                       static_cast<int>(w.shape(1) * 32 / bits),
                       bias,
                       static_cast<int64_t>(w.nbytes() + s.nbytes() + b.nbytes())};
}

// A float buffer of `count` floats per slot, reused across calls on the stream's thread.
float* buffer(int slot, size_t count) {
  thread_local std::vector<float> storage[5];
  if (storage[slot].size() < count) storage[slot].resize(count);
  return storage[slot].data();
}

// y (tokens, width) = x @ the projection's pieces stacked along N; returns width. A piece of
// several runs into buffer slot 4 and its columns are copied into place.
int project(const LayerParams& p, int proj, const std::vector<mx::array>& in, Held& held, const float* x, int tokens,
            float* y) {
  if (p.pieces[proj] == 1) {
    const LinearWeights w = weights_of(p, proj, 0, in, held);
    linear_forward(w, x, tokens, y);
    return w.N;
  }
  int width = 0;
  for (int j = 0; j < p.pieces[proj]; ++j) width += weights_of(p, proj, j, in, held).N;
  for (int j = 0, column = 0; j < p.pieces[proj]; ++j) {
    const LinearWeights w = weights_of(p, proj, j, in, held);
    float* part = buffer(4, size_t(tokens) * w.N);
    linear_forward(w, x, tokens, part);
    for (int t = 0; t < tokens; ++t)
      std::memcpy(y + int64_t(t) * width + column, part + int64_t(t) * w.N, sizeof(float) * w.N);
    column += w.N;
  }
  return width;
}

// The output width of a projection: its pieces' N summed.
int width_of(const LayerParams& p, int proj, const std::vector<mx::array>& in) {
  int width = 0;
  for (int j = 0; j < p.pieces[proj]; ++j) width += in[p.first[proj][j]].shape(0);
  return width;
}

// The attention's input: q, k, v of x (tokens, hidden), q and k rotated.
void run_attention_in(const LayerParams& p, const std::vector<mx::array>& in, float* q, float* k, float* v) {
  Held held;
  const FusedKernels& fk = active_fused_kernels();
  const int tokens = in[kX].shape(0), hidden = in[kX].shape(1);
  const int qkv_width = width_of(p, kQkv, in);
  float* xn = buffer(0, size_t(tokens) * hidden);
  float* rows = buffer(1, size_t(tokens) * qkv_width);
  const float* x = static_cast<const float*>(row_major(in[kX], held));
  fk.rms_norm(x, static_cast<const float*>(row_major(in[kNorm1], held)), 0.0f, p.eps, hidden, xn, 0, tokens);
  project(p, kQkv, in, held, xn, tokens, rows);
  const int q_width = p.num_heads * p.head_dim, kv_width = p.num_kv_heads * p.head_dim;
  const int32_t* positions = static_cast<const int32_t*>(row_major(in[kPositions], held));
  std::vector<float> inv(p.rope_dims / 2);
  if (p.rope_dims > 0) {
    const float* freqs = static_cast<const float*>(row_major(in[kFreqs], held));
    for (int i = 0; i < p.rope_dims / 2; ++i) inv[i] = 1.0f / freqs[i];
  }
  for (int t = 0; t < tokens; ++t) {
    const float* row = rows + int64_t(t) * qkv_width;
    float* qt = q + int64_t(t) * q_width;
    float* kt = k + int64_t(t) * kv_width;
    if (p.rope_dims > 0) {
      // One token a call: the kernel indexes x and y by token, so each call sees token 0.
      fk.rope(row, positions + t, inv.data(), p.num_heads, p.head_dim, p.rope_dims, p.traditional, p.mscale, qt, 0, 1);
      fk.rope(row + q_width, positions + t, inv.data(), p.num_kv_heads, p.head_dim, p.rope_dims, p.traditional,
              p.mscale, kt, 0, 1);
    } else {
      std::memcpy(qt, row, sizeof(float) * q_width);
      std::memcpy(kt, row + q_width, sizeof(float) * kv_width);
    }
    std::memcpy(v + int64_t(t) * kv_width, row + q_width + kv_width, sizeof(float) * kv_width);
  }
}

void add_rows(float* y, const float* a, const float* b, int64_t count) {
  for (int64_t i = 0; i < count; ++i) y[i] = a[i] + b[i];
}

// The rest of the layer: attention over the written pools, o, residual, MLP, residual.
void run_attention_out(const LayerParams& p, const std::vector<mx::array>& in, float* out) {
  Held held;
  const FusedKernels& fk = active_fused_kernels();
  const int tokens = in[kResidual].shape(0), hidden = in[kResidual].shape(1);
  const int inter = width_of(p, kGateUp, in) / 2;
  float* attn = buffer(0, size_t(tokens) * p.num_heads * p.head_dim);
  float* xn = buffer(1, size_t(tokens) * hidden);
  float* gu = buffer(2, size_t(tokens) * 2 * inter);
  float* act = buffer(3, size_t(tokens) * (inter > hidden ? inter : hidden));
  const mx::array& tables = in[kTables];
  AttentionArgs args;
  args.shape = AttentionShape{p.num_heads, p.num_kv_heads, p.head_dim, p.block_size, tables.shape(1), p.scale,
                              p.softcap,   p.window,       int64_t(p.num_heads) * p.head_dim, p.head_dim};
  args.queries = static_cast<const float*>(row_major(in[kQueries], held));
  args.out = attn;
  args.keys = PoolView{row_major(in[kKeyPool], held), nullptr, nullptr, 0, 0, 0};
  args.values = PoolView{row_major(in[kValuePool], held), nullptr, nullptr, 0, 0, 0};
  args.block_tables = static_cast<const int32_t*>(row_major(tables, held));
  args.context_lens = static_cast<const int32_t*>(row_major(in[kContextLens], held));
  args.query_starts = static_cast<const int32_t*>(row_major(in[kStarts], held));
  check_step_indices(args, in[kContextLens].shape(0), tokens, in[kKeyPool].shape(0));
  attend_step(args, in[kContextLens].shape(0));

  const float* x = static_cast<const float*>(row_major(in[kResidual], held));
  project(p, kO, in, held, attn, tokens, act);
  add_rows(out, x, act, int64_t(tokens) * hidden);  // h = x + o
  fk.rms_norm(out, static_cast<const float*>(row_major(in[kNorm2], held)), 0.0f, p.eps, hidden, xn, 0, tokens);
  project(p, kGateUp, in, held, xn, tokens, gu);
  fk.gated(gu, inter, p.act, act, 0, tokens);
  project(p, kDown, in, held, act, tokens, xn);
  add_rows(out, out, xn, int64_t(tokens) * hidden);
}

// One node of the layer: the attention's input (three outputs) or the rest (one).
class LayerPart : public mx::Primitive {
 public:
  LayerPart(mx::Stream stream, LayerParams params, bool is_input)
      : mx::Primitive(stream), params_(params), is_input_(is_input) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& out : outputs) out.set_data(mx::allocator::malloc(out.nbytes()));
    for (auto& in : inputs) encoder.set_input_array(in);
    for (auto& out : outputs) encoder.set_output_array(out);
    std::vector<mx::array> outs;
    for (auto& out : outputs) outs.push_back(mx::array::unsafe_weak_copy(out));
    // NOTE: the task may run after this primitive is gone, so it holds a copy of the parameters.
    encoder.dispatch([inputs, outs, params = params_, is_input = is_input_]() mutable {
      if (is_input) {
        run_attention_in(params, inputs, outs[0].data<float>(), outs[1].data<float>(), outs[2].data<float>());
      } else {
        run_attention_out(params, inputs, outs[0].data<float>());
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("decoder_layer: the CPU kernel has no GPU path");
  }

  const char* name() const override { return is_input_ ? "BaseLayerAttentionIn" : "BaseLayerAttentionOut"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    auto& o = static_cast<const LayerPart&>(other);
    return is_input_ == o.is_input_ && params_ == o.params_;
  }

 private:
  LayerParams params_;
  bool is_input_;
};

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("decoder_layer: " + what);
}

// Checks one piece's parts (weight, codes/scales/biases or GGUF blocks; then an optional bias)
// and appends them to `inputs`; returns its output width.
int add_piece(const std::vector<mx::array>& parts, int bits, int group_size, int k, LayerParams& p, int proj,
              int piece, std::vector<mx::array>& inputs) {
  const size_t base = bits == 0 || is_block(bits) ? 1 : 3;
  require(parts.size() == base || parts.size() == base + 1,
          "a projection is [weight], [codes, scales, biases] or [GGUF blocks], then an optional bias");
  const mx::array& w = parts[0];
  require(w.ndim() == 2, "projection weights must be 2-D");
  const int n = w.shape(0);
  if (bits == 0) {
    require(w.dtype() == mx::float32 && w.shape(1) == k, "float projection weights must be float32 (N, K)");
  } else if (is_block(bits)) {
    require(k % block_values(bits) == 0 && w.dtype() == mx::uint8 && w.shape(1) == k / block_values(bits) * block_bytes(bits),
            "GGUF blocks must be uint8 (N, K / block values * block bytes)");
    group_size = kQBlock;
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
  p.has_bias[proj][piece] = parts.size() == base + 1;
  if (p.has_bias[proj][piece]) {
    const mx::array& bias = parts[base];
    require(bias.dtype() == mx::float32 && bias.ndim() == 1 && bias.shape(0) == n, "biases must be float32 (N,)");
  }
  p.bits[proj][piece] = bits;
  p.group_size[proj][piece] = bits == 0 ? 0 : group_size;
  p.first[proj][piece] = static_cast<int>(inputs.size());
  inputs.insert(inputs.end(), parts.begin(), parts.end());
  return n;
}

// A projection: one piece ([arrays], bits, group size) or several stacked along N (each a list
// of its arrays, with a list of bits and of group sizes); returns its output width.
int add_linear(const nb::handle& linear, const nb::handle& bits, const nb::handle& group_size, int k, LayerParams& p,
               int proj, std::vector<mx::array>& inputs) try {
  if (nb::isinstance<nb::int_>(bits)) {
    p.pieces[proj] = 1;
    return add_piece(nb::cast<std::vector<mx::array>>(linear), nb::cast<int>(bits), nb::cast<int>(group_size), k, p,
                     proj, 0, inputs);
  }
  auto pieces = nb::cast<std::vector<std::vector<mx::array>>>(linear);
  auto piece_bits = nb::cast<std::vector<int>>(bits), piece_groups = nb::cast<std::vector<int>>(group_size);
  require(!pieces.empty() && pieces.size() <= kMaxPieces && piece_bits.size() == pieces.size() &&
              piece_groups.size() == pieces.size(),
          "a projection of pieces lists 1 to 3 pieces, with one bits and one group size each");
  p.pieces[proj] = static_cast<int>(pieces.size());
  int width = 0;
  for (size_t j = 0; j < pieces.size(); ++j)
    width += add_piece(pieces[j], piece_bits[j], piece_groups[j], k, p, proj, static_cast<int>(j), inputs);
  return width;
} catch (const nb::cast_error&) {
  throw std::invalid_argument(
      "decoder_layer: a projection is a list of arrays with an int bits and group size, or a list of such pieces "
      "with a list of each");
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
  require(key_pool.dtype() == mx::float32 && key_pool.ndim() == 4 && key_pool.shape(0) > 0 && p.block_size > 0,
          "pools must be float32 (num_blocks, block_size, kv_heads, head_dim), at least one block of one row");
  require(value_pool.shape() == key_pool.shape() && value_pool.dtype() == key_pool.dtype(),
          "the key and value pools must have one shape and dtype");
  require(p.head_dim >= 16 && p.head_dim % 16 == 0, "head_dim must be a positive multiple of 16");
  require(p.num_kv_heads > 0 && p.num_heads > 0 && p.num_heads % p.num_kv_heads == 0,
          "heads must be a positive multiple of kv_heads");
  require(x.shape(1) > 0, "x must have a hidden size of at least 1");
}

std::vector<mx::array> decoder_layer(const mx::array& x, const mx::array& positions, const mx::array& slots,
                                     const mx::array& tables, const mx::array& context_lens, const mx::array& starts,
                                     const mx::array& key_pool, const mx::array& value_pool,
                                     const std::vector<mx::array>& norms, const std::vector<nb::object>& linears,
                                     const std::vector<nb::object>& bits, const std::vector<nb::object>& group_sizes,
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

  const int tokens = x.shape(0);
  const int q_width = num_heads * p.head_dim, kv_width = p.num_kv_heads * p.head_dim;
  std::vector<mx::array> in_inputs{x, positions, norms[0], freqs ? *freqs : x};
  require(add_linear(linears[kQkv], bits[kQkv], group_sizes[kQkv], hidden, p, kQkv, in_inputs) ==
              q_width + 2 * kv_width,
          "the qkv projection must have heads * head_dim + 2 * kv_heads * head_dim outputs");
  std::vector<mx::array> out_inputs{x, x, key_pool, value_pool, tables, context_lens, starts, norms[1]};
  require(add_linear(linears[kO], bits[kO], group_sizes[kO], q_width, p, kO, out_inputs) == hidden,
          "o_proj must map heads * head_dim to hidden");
  const int gate_up = add_linear(linears[kGateUp], bits[kGateUp], group_sizes[kGateUp], hidden, p, kGateUp, out_inputs);
  require(gate_up % 2 == 0, "gate_up must have an even number of outputs [gate | up]");
  require(add_linear(linears[kDown], bits[kDown], group_sizes[kDown], gate_up / 2, p, kDown, out_inputs) == hidden,
          "down_proj must map intermediate to hidden");

  const mx::Stream stream = mx::default_stream(mx::Device::cpu);
  auto qkv = mx::array::make_arrays(
      {{tokens, num_heads, p.head_dim}, {tokens, p.num_kv_heads, p.head_dim}, {tokens, p.num_kv_heads, p.head_dim}},
      {mx::float32, mx::float32, mx::float32}, std::make_shared<LayerPart>(stream, p, true), std::move(in_inputs));
  mx::array keys = write_pool(key_pool, qkv[1], slots);
  mx::array values = write_pool(value_pool, qkv[2], slots);
  out_inputs[kQueries] = qkv[0];
  out_inputs[kKeyPool] = keys;
  out_inputs[kValuePool] = values;
  mx::array out(x.shape(), mx::float32, std::make_shared<LayerPart>(stream, p, false), std::move(out_inputs));
  return {out, keys, values};
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
