// Attention without a cache, for the vision towers: each query row of a segment over every key
// row of that segment (one segment: the whole sequence), on dense float32 (seq, heads, head_dim)
// inputs, as one MLX primitive. MLX's CPU backend runs the same as a score matrix of the whole
// image per head, a softmax and a matmul, several seconds a layer at 4,096 patches; here the
// keys and values are packed once per call (head_dim zero-padded to a multiple of 16, keys
// transposed 16 at a time), then work items (head x segment x tile of query rows) run the
// instruction set's online-softmax loop (attention_impl.h: attend_dense) on the thread pool.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>

#include "attention.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "primitive.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

// Query rows of one work item: as the paged kernel's tiles, enough to reuse each key panel.
constexpr int kDenseTileRows = 48;
// Below this many multiply-adds the call runs on the calling thread.
constexpr int64_t kDenseParallelWork = int64_t(1) << 21;

using Held = std::vector<std::vector<uint8_t>>;

// An input's (seq, heads, head_dim) rows in place at its strides when its last axis is
// contiguous (a view of a fused projection's output needs no copy), else a row-major copy.
struct Rows {
  const float* data;
  int64_t seq_stride, head_stride;
};

Rows rows_of(const mx::array& a, Held& held) {
  if (a.strides(2) == 1) return {a.data<float>(), a.strides(0), a.strides(1)};
  return {static_cast<const float*>(row_major(a, held)), int64_t(a.shape(1)) * a.shape(2), a.shape(2)};
}

[[noreturn]] void fail(const std::string& why) { throw std::invalid_argument("dense_attention: " + why); }

// segments (num_segments + 1,) must run from 0 to seq_len without descending: every row in one.
std::vector<int64_t> first_panels(const int32_t* segments, int num_segments, int seq_len, int64_t& panels_per_head) {
  if (segments[0] != 0 || segments[num_segments] != seq_len)
    fail("segments must start at 0 and end at the sequence length " + std::to_string(seq_len));
  std::vector<int64_t> first(num_segments);
  panels_per_head = 0;
  for (int s = 0; s < num_segments; ++s) {
    const int len = segments[s + 1] - segments[s];
    if (len < 0) fail("segment boundaries must not descend");
    first[s] = panels_per_head;
    panels_per_head += (len + 15) / 16;
  }
  return first;
}

// Keys as panels (heads, panels_per_head, padded_dim, 16) and values as (heads, seq, padded_dim),
// zero-padded, one head per chunk of the pool.
void pack(const DenseAttentionArgs& a, const Rows& k, const Rows& v, int num_segments, float* panels, float* values) {
  const int dim = a.padded_dim;
  parallel_for(a.num_heads, [&](int h0, int h1, int) {
    for (int h = h0; h < h1; ++h) {
      for (int s = 0; s < num_segments; ++s) {
        const int first_row = a.segments[s], len = a.segments[s + 1] - first_row;
        float* panel = panels + (int64_t(h) * a.panels_per_head + a.first_panel[s]) * dim * 16;
        for (int c = 0; c < len; c += 16, panel += int64_t(dim) * 16) {
          std::fill(panel, panel + int64_t(dim) * 16, 0.0f);
          for (int j = 0; j < std::min(16, len - c); ++j) {
            const float* src = k.data + int64_t(first_row + c + j) * k.seq_stride + int64_t(h) * k.head_stride;
            for (int d = 0; d < a.head_dim; ++d) panel[d * 16 + j] = src[d];
          }
        }
      }
      for (int i = 0; i < a.seq_len; ++i) {
        const float* src = v.data + int64_t(i) * v.seq_stride + int64_t(h) * v.head_stride;
        float* dst = values + (int64_t(h) * a.seq_len + i) * dim;
        std::copy(src, src + a.head_dim, dst);
        std::fill(dst + a.head_dim, dst + dim, 0.0f);
      }
    }
  });
}

// Work items, the costliest (longest segment) first so the threads finish together.
std::vector<DenseTile> make_dense_tiles(const int32_t* segments, int num_segments, int num_heads, int64_t& work) {
  std::vector<std::pair<int64_t, DenseTile>> items;
  for (int s = 0; s < num_segments; ++s) {
    const int len = segments[s + 1] - segments[s];
    for (int r = segments[s]; r < segments[s + 1]; r += kDenseTileRows) {
      const int end = std::min(segments[s + 1], r + kDenseTileRows);
      for (int h = 0; h < num_heads; ++h) items.push_back({int64_t(len) * (end - r), DenseTile{h, s, r, end}});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](auto& x, auto& y) { return x.first > y.first; });
  work = 0;
  std::vector<DenseTile> tiles;
  tiles.reserve(items.size());
  for (auto& item : items) {
    work += item.first;
    tiles.push_back(item.second);
  }
  return tiles;
}

void run_dense(float scale, const std::vector<mx::array>& ins, mx::array& out) {
  Held held;
  const mx::array &q = ins[0], &k = ins[1], &v = ins[2], &segments = ins[3];
  DenseAttentionArgs a{};
  a.seq_len = q.shape(0);
  a.num_heads = q.shape(1);
  a.head_dim = q.shape(2);
  a.padded_dim = (a.head_dim + 15) / 16 * 16;
  a.scale = scale;
  const Rows qr = rows_of(q, held), kr = rows_of(k, held), vr = rows_of(v, held);
  a.queries = qr.data;
  a.q_seq_stride = qr.seq_stride;
  a.q_head_stride = qr.head_stride;
  a.out = out.data<float>();
  const int num_segments = segments.shape(0) - 1;
  a.segments = static_cast<const int32_t*>(row_major(segments, held));
  const std::vector<int64_t> first = first_panels(a.segments, num_segments, a.seq_len, a.panels_per_head);
  a.first_panel = first.data();
  std::vector<float> panels(size_t(a.num_heads) * a.panels_per_head * a.padded_dim * 16);
  std::vector<float> values(size_t(a.num_heads) * a.seq_len * a.padded_dim);
  a.key_panels = panels.data();
  a.values = values.data();
  pack(a, kr, vr, num_segments, panels.data(), values.data());
  int64_t work = 0;
  const std::vector<DenseTile> tiles = make_dense_tiles(a.segments, num_segments, a.num_heads, work);
  const AttentionKernels& kernels = active_attention_kernels();
  auto each = [&](int begin, int end, int) {
    for (int i = begin; i < end; ++i) kernels.attend_dense(a, tiles[i]);
  };
  if (work * 2 * a.padded_dim < kDenseParallelWork) {
    each(0, int(tiles.size()), 0);
  } else {
    parallel_for(int(tiles.size()), each);
  }
}

class DenseAttention : public mx::UnaryPrimitive {
 public:
  DenseAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    // NOTE: the task may outlive this primitive, so it holds a copy of the scale, never `this`.
    dispatch(stream(), inputs, out,
             [scale = scale_](const std::vector<mx::array>& ins, mx::array& o) { run_dense(scale, ins, o); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("dense_attention: the CPU kernel has no GPU path");
  }

  const char* name() const override { return "BaseDenseAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const DenseAttention&>(other).scale_;
  }

 private:
  float scale_;
};

// NOTE: O(1) reads of shapes and dtypes; the segments' contents are checked in the task.
mx::array dense_attention(const mx::array& q, const mx::array& k, const mx::array& v, float scale,
                          const mx::array& segments) {
  for (const mx::array* a : {&q, &k, &v})
    if (a->ndim() != 3 || a->dtype() != mx::float32)
      fail("queries, keys and values must be float32 (seq, heads, head_dim)");
  if (k.shape() != q.shape() || v.shape() != q.shape()) fail("queries, keys and values must have one shape");
  if (q.shape(0) < 1 || q.shape(1) < 1 || q.shape(2) < 1) fail("every dimension must be at least 1");
  if (segments.dtype() != mx::int32 || segments.ndim() != 1 || segments.shape(0) < 2)
    fail("segments must be int32 (num_segments + 1,) boundaries");
  auto prim = std::make_shared<DenseAttention>(mx::default_stream(mx::Device::cpu), scale);
  return mx::array(q.shape(), mx::float32, std::move(prim), {q, k, v, segments});
}

}  // namespace

void register_dense_attention(nb::module_& m) {
  m.def("dense_attention", &dense_attention, nb::arg("queries"), nb::arg("keys"), nb::arg("values"), nb::arg("scale"),
        nb::arg("segments"),
        "softmax(q k^T * scale) v within each segment of rows, for float32 (seq, heads, head_dim) queries, keys "
        "and values; segments: int32 (num_segments + 1,) boundaries from 0 to seq. Returns (seq, heads, head_dim).");
}

}  // namespace base_cpu
