// The paged-attention primitive: MLX graph node, validation, and the split of a step into
// work items (sequence x KV head x tile of query rows) run on the thread pool.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <mutex>
#include <unordered_map>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>
#include <sys/mman.h>
#include <unistd.h>

#include "attention.h"
#include "pool_write.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "primitive.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

// Query rows x heads per KV head that one work item holds: enough rows to reuse each
// loaded key block, few enough that a long prompt chunk splits over the threads.
constexpr int kTileRows = 48;

// Below this many multiply-adds a step's attention runs on the calling thread: waking the
// pool costs more than it saves for a few short decode rows.
constexpr int64_t kParallelWork = int64_t(1) << 21;

const AttentionKernels& attention_kernels_for(const std::string& isa) {
#if defined(BASE_HAVE_X86_PATHS)
  if (isa == "avx512") return avx512::attention_kernels();
  if (isa == "avx2") return avx2::attention_kernels();
#endif
  return generic::attention_kernels();
}

int dtype_code(mx::Dtype dtype) {
  if (dtype == mx::float32) return 0;
  if (dtype == mx::float16) return 1;
  if (dtype == mx::bfloat16) return 2;
  throw std::invalid_argument("paged_attention: KV pools must be float32, float16 or bfloat16");
}

using Held = std::vector<std::vector<uint8_t>>;

PoolView pool_view(const std::vector<mx::array>& parts, int bits, int group_size, Held& held) {
  if (bits == 0) return PoolView{row_major(parts[0], held), nullptr, nullptr, dtype_code(parts[0].dtype()), 0, 0};
  return PoolView{row_major(parts[0], held), row_major(parts[1], held), row_major(parts[2], held),
                  dtype_code(parts[1].dtype()), bits, group_size};
}

// Work items, the costliest (most rows x keys) first so the threads finish together.
std::vector<AttentionTile> make_tiles(const int32_t* starts, const int32_t* context_lens, int num_seqs,
                                      int num_kv_heads, int group, int window, int64_t& row_keys) {
  const int tile_queries = std::max(1, kTileRows / group);
  std::vector<std::pair<int64_t, AttentionTile>> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = starts[s + 1] - starts[s];
    for (int i0 = 0; i0 < q_len; i0 += tile_queries) {
      const int i1 = std::min(q_len, i0 + tile_queries);
      const int64_t last = context_lens[s] - q_len + i1;
      const int64_t keys = window > 0 ? std::min<int64_t>(last, window + (i1 - i0)) : last;
      for (int h = 0; h < num_kv_heads; ++h) items.push_back({keys * (i1 - i0), AttentionTile{s, h, i0, i1}});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](auto& a, auto& b) { return a.first > b.first; });
  row_keys = 0;
  for (auto& item : items) row_keys += item.first * group;
  std::vector<AttentionTile> tiles;
  tiles.reserve(items.size());
  for (auto& item : items) tiles.push_back(item.second);
  return tiles;
}

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, int block_size, float scale, float softcap, int window, int bits, int group_size)
      : mx::UnaryPrimitive(stream), params_{block_size, scale, softcap, window, bits, group_size} {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    // NOTE: the task may run after this primitive is gone (MLX detaches a graph once it is
    // scheduled), so it captures a copy of the parameters, never `this`.
    dispatch(stream(), inputs, out, [params = params_](const std::vector<mx::array>& ins, mx::array& o) {
      run(params, ins, o);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("paged_attention: the CPU kernel has no GPU path");
  }

  const char* name() const override { return "BasePagedAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& a = params_;
    const Params& b = static_cast<const PagedAttention&>(other).params_;
    return a.block_size == b.block_size && a.scale == b.scale && a.softcap == b.softcap && a.window == b.window &&
           a.bits == b.bits && a.group_size == b.group_size;
  }

 private:
  struct Params {
    int block_size;
    float scale, softcap;
    int window, bits, group_size;
  };

  static void run(const Params& p, const std::vector<mx::array>& ins, mx::array& out) {
    const int per_pool = p.bits == 0 ? 1 : 3;
    const mx::array& q = ins[0];
    std::vector<mx::array> key_parts(ins.begin() + 1, ins.begin() + 1 + per_pool);
    std::vector<mx::array> value_parts(ins.begin() + 1 + per_pool, ins.begin() + 1 + 2 * per_pool);
    const mx::array& tables = ins[1 + 2 * per_pool];
    const mx::array& context_lens = ins[2 + 2 * per_pool];
    const mx::array& starts = ins[3 + 2 * per_pool];
    Held held;  // row-major copies of any strided input, alive until the kernel is done
    AttentionArgs args;
    const int num_kv_heads = key_parts[0].shape(2);
    args.shape = AttentionShape{q.shape(1), num_kv_heads, q.shape(2),     p.block_size,  tables.shape(1),
                                p.scale,    p.softcap,    p.window,       int64_t(q.shape(1)) * q.shape(2), q.shape(2)};
    args.queries = static_cast<const float*>(row_major(q, held));
    args.out = out.data<float>();
    args.keys = pool_view(key_parts, p.bits, p.group_size, held);
    args.values = pool_view(value_parts, p.bits, p.group_size, held);
    args.block_tables = static_cast<const int32_t*>(row_major(tables, held));
    args.context_lens = static_cast<const int32_t*>(row_major(context_lens, held));
    args.query_starts = static_cast<const int32_t*>(row_major(starts, held));
    check_step_indices(args, context_lens.shape(0), q.shape(0), key_parts[0].shape(0));
    attend_step(args, context_lens.shape(0));
  }

  Params params_;
};

[[noreturn]] void fail(const std::string& why) { throw std::invalid_argument("paged_attention: " + why); }

bool is_float(mx::Dtype dtype) { return dtype == mx::float32 || dtype == mx::float16 || dtype == mx::bfloat16; }

// One side's pool: values (num_blocks, block_size, kv_heads, head_dim) of a float dtype, or uint32
// codes (..., head_dim * bits / 32) with float scales and biases (..., head_dim / group_size).
void check_pool(const std::vector<mx::array>& parts, const std::string& side, int head_dim, int block_size, int bits,
                int group_size) {
  if (parts.size() != (bits == 0 ? 1u : 3u)) fail(side + " pool must be one array, or codes, scales and biases");
  const mx::array& p = parts[0];
  const int width = bits == 0 ? head_dim : head_dim * bits / 32;
  if (p.ndim() != 4 || p.shape(3) != width) {
    const std::string last = bits == 0 ? "head_dim)" : "head_dim * bits / 32)";
    fail(side + " pool must be (num_blocks, block_size, kv_heads, " + last + " for head_dim " +
         std::to_string(head_dim));
  }
  if (p.shape(0) < 1 || p.shape(2) < 1) fail(side + " pool needs at least one block and one KV head");
  if (p.shape(1) != block_size)
    fail("block_size is " + std::to_string(block_size) + " but the " + side + " pool's blocks hold " +
         std::to_string(p.shape(1)) + " rows");
  if (bits == 0 && !is_float(p.dtype())) fail("KV pools must be float32, float16 or bfloat16");
  if (bits == 0) return;
  if (p.dtype() != mx::uint32) fail("quantized " + side + " codes must be uint32");
  for (int i = 1; i < 3; ++i) {
    const mx::array& s = parts[i];
    const bool shaped = s.ndim() == 4 && s.shape(0) == p.shape(0) && s.shape(1) == p.shape(1) &&
                        s.shape(2) == p.shape(2) && s.shape(3) == head_dim / group_size;
    if (!shaped || !is_float(s.dtype()) || s.dtype() != parts[1].dtype())
      fail("quantized " + side + " scales and biases must be float (num_blocks, block_size, kv_heads, head_dim / "
           "group_size) of one dtype");
  }
}

void check_same_pools(const std::vector<mx::array>& keys, const std::vector<mx::array>& values) {
  for (size_t i = 0; i < keys.size(); ++i)
    if (keys[i].shape() != values[i].shape() || keys[i].dtype() != values[i].dtype())
      fail("the key and value pools must have one shape and dtype");
}

// NOTE: O(1) reads of shapes and dtypes: everything the kernel's pointer arithmetic assumes that
// is known before the inputs are computed (their contents: check_step_indices, in the task).
void check_inputs(const mx::array& q, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                  const mx::array& tables, const mx::array& context_lens, const mx::array& starts, int block_size,
                  int bits, int group_size) {
  if (q.ndim() != 3 || q.dtype() != mx::float32) fail("queries must be float32 (num_tokens, heads, head_dim)");
  const int head_dim = q.shape(2);
  if (head_dim < 16 || head_dim % 16 != 0) fail("head_dim must be a positive multiple of 16");
  if (block_size < 1) fail("block_size must be at least 1, not " + std::to_string(block_size));
  if (bits != 0 && bits != 4 && bits != 8) fail("bits must be 0 (float pool), 4 or 8");
  if (bits != 0 && (group_size <= 0 || head_dim % group_size != 0))
    fail("a quantized pool's group_size must divide head_dim " + std::to_string(head_dim));
  check_pool(keys, "key", head_dim, block_size, bits, group_size);
  check_pool(values, "value", head_dim, block_size, bits, group_size);
  check_same_pools(keys, values);
  if (q.shape(1) < 1 || q.shape(1) % keys[0].shape(2) != 0) fail("heads must be a positive multiple of kv_heads");
  for (auto* a : {&tables, &context_lens, &starts})
    if (a->dtype() != mx::int32) fail("block tables, context lengths and query starts must be int32");
  if (tables.ndim() != 2 || context_lens.ndim() != 1 || starts.ndim() != 1 ||
      tables.shape(0) != context_lens.shape(0) || starts.shape(0) != context_lens.shape(0) + 1)
    fail("block_tables (num_seqs, max_blocks), context_lens (num_seqs,), query_starts (num_seqs + 1,)");
}

mx::array paged_attention(const mx::array& q, const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                          const mx::array& tables, const mx::array& context_lens, const mx::array& starts,
                          int block_size, float scale, std::optional<float> softcap, std::optional<int> window,
                          int bits, int group_size) {
  check_inputs(q, keys, values, tables, context_lens, starts, block_size, bits, group_size);
  std::vector<mx::array> inputs{q};
  inputs.insert(inputs.end(), keys.begin(), keys.end());
  inputs.insert(inputs.end(), values.begin(), values.end());
  inputs.insert(inputs.end(), {tables, context_lens, starts});
  auto prim = std::make_shared<PagedAttention>(mx::Stream(mx::default_stream(mx::Device::cpu)), block_size, scale,
                                               softcap.value_or(0.0f), window.value_or(0), bits, group_size);
  return mx::array(q.shape(), mx::float32, std::move(prim), std::move(inputs));
}

// The KV write: rows (num_tokens, kv_heads, head_dim) into a float pool at slot_mapping. Like
// MLX's scatter, the output takes over the pool's buffer when the graph holds the only
// reference (LayerKV rebinds its pool to the result), so a step writes in place.
// How many array handles share `a`'s description (graph inputs and Python handles alike). MLX
// keeps the description private; an explicit instantiation may name a private member (the
// standard waives access checks there), which is how its use count is read here.
template <class Tag, auto Member>
struct Expose {
  friend auto member(Tag) { return Member; }
};
struct DescTag {
  friend auto member(DescTag);
};
template struct Expose<DescTag, &mx::array::array_desc_>;

long handles_on(const mx::array& a) { return (a.*member(DescTag{})).use_count(); }

// Buffers zeroed() mapped, each to its mapping (start, length); guarded by the mutex (pools are
// made on one thread, written on MLX's).
std::mutex mapped_mutex;
std::unordered_map<const void*, std::pair<void*, size_t>> mapped_buffers;

// The bytes of zeroed()'s mappings resident in memory (mincore): a pool's pages become resident as
// its blocks are first written.
size_t mapped_resident_bytes() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::lock_guard<std::mutex> lock(mapped_mutex);
  size_t total = 0;
  std::vector<unsigned char> resident;
  for (const auto& [buffer, mapping] : mapped_buffers) {
    resident.resize((mapping.second + page - 1) / page);
    if (mincore(mapping.first, mapping.second, resident.data()) != 0) continue;
    for (unsigned char r : resident) total += (r & 1) ? page : 0;
  }
  return total;
}

bool is_mapped(const mx::array& a) {
  std::lock_guard<std::mutex> lock(mapped_mutex);
  return mapped_buffers.count(a.buffer().ptr()) != 0;
}

// Whether the write may take the pool's buffer: MLX's is_donatable(), or, for a mapped pool
// (which is_donatable() refuses as not its allocator's), the same two conditions it checks
// otherwise: this graph input is the pool's only handle and the buffer has no other array.
bool can_take(const mx::array& pool) {
  if (pool.is_donatable()) return true;
  return handles_on(pool) == 1 && pool.data_shared_ptr().use_count() == 1 && is_mapped(pool);
}

class WritePool : public mx::UnaryPrimitive {
 public:
  explicit WritePool(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& pool = inputs[0];
    if (can_take(pool) && pool.flags().row_contiguous) {
      out.copy_shared_buffer(pool);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (auto& in : inputs) encoder.set_input_array(in);
    encoder.set_output_array(out);
    const bool shared = out.data_shared_ptr() == pool.data_shared_ptr();
    encoder.dispatch([inputs, out = mx::array::unsafe_weak_copy(out), shared]() mutable {
      std::vector<std::vector<uint8_t>> held;
      const mx::array& pool = inputs[0];
      uint8_t* dst = out.data<uint8_t>();
      if (!shared) std::memcpy(dst, row_major(pool, held), pool.nbytes());
      const size_t row_bytes = size_t(pool.shape(2)) * pool.shape(3) * pool.itemsize();
      const int64_t num_slots = int64_t(pool.shape(0)) * pool.shape(1);
      const uint8_t* rows = static_cast<const uint8_t*>(row_major(inputs[1], held));
      const int32_t* slots = static_cast<const int32_t*>(row_major(inputs[2], held));
      for (int t = 0; t < inputs[2].shape(0); ++t) {
        if (slots[t] >= 0 && slots[t] < num_slots) std::memcpy(dst + slots[t] * row_bytes, rows + t * row_bytes, row_bytes);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("write_pool: the CPU kernel has no GPU path");
  }

  const char* name() const override { return "BaseWritePool"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array write_pool(const mx::array& pool, const mx::array& rows, const mx::array& slots) {
  auto fail = [](const std::string& why) { throw std::invalid_argument("write_pool: " + why); };
  if (pool.ndim() != 4) fail("pool must be (num_blocks, block_size, kv_heads, head_dim)");
  if (rows.ndim() != 3 || rows.shape(1) != pool.shape(2) || rows.shape(2) != pool.shape(3))
    fail("rows must be (num_tokens, kv_heads, head_dim) of the pool's row shape");
  if (rows.dtype() != pool.dtype()) fail("rows must have the pool's dtype");
  if (slots.dtype() != mx::int32 || slots.ndim() != 1 || slots.shape(0) != rows.shape(0))
    fail("slot_mapping must be int32 (num_tokens,)");
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<WritePool>(mx::default_stream(mx::Device::cpu)),
                   {pool, rows, slots});
}

// An array of zeros in pages the kernel maps on first touch (an anonymous mapping), not written
// here: a KV pool sized for a whole context costs no time at start and no memory until its
// blocks are used (mx.zeros writes every byte: 4.6 s and all of it resident for a 1.8 GiB pool).
// NOTE: MLX's CPU allocator keeps a buffer's size in the 8 bytes before its data, so the data
// starts one page into the mapping and the size sits just before it.
mx::array zeroed(const mx::Shape& shape, mx::Dtype dtype) {
  size_t count = 1;
  for (int d : shape) {
    if (d < 0) throw std::invalid_argument("zeroed: a negative dimension");
    count *= static_cast<size_t>(d);
  }
  const size_t nbytes = count * mx::size_of(dtype), page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t length = page + nbytes;
  void* mapped = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mapped == MAP_FAILED) throw std::runtime_error("zeroed: could not map " + std::to_string(nbytes) + " bytes");
  auto* header = reinterpret_cast<size_t*>(static_cast<char*>(mapped) + page) - 1;
  *header = nbytes;
  mx::allocator::Data data(mx::allocator::Buffer(header), [mapped, length](mx::allocator::Buffer buffer) {
    {
      std::lock_guard<std::mutex> lock(mapped_mutex);
      mapped_buffers.erase(buffer.ptr());
    }
    munmap(mapped, length);
  });
  {
    std::lock_guard<std::mutex> lock(mapped_mutex);
    mapped_buffers.emplace(header, std::make_pair(mapped, length));
  }
  return mx::array(std::move(data), shape, dtype);
}

mx::Dtype dtype_named(const std::string& name) {
  if (name == "float32") return mx::float32;
  if (name == "float16") return mx::float16;
  if (name == "bfloat16") return mx::bfloat16;
  if (name == "uint32") return mx::uint32;
  if (name == "uint8") return mx::uint8;
  throw std::invalid_argument("zeroed: dtype must be float32, float16, bfloat16, uint32 or uint8, not " + name);
}

void check_step_indices(const AttentionArgs& args, int num_seqs, int64_t num_tokens, int64_t num_blocks) {
  const AttentionShape& a = args.shape;
  const int32_t* starts = args.query_starts;
  if (starts[0] < 0 || starts[num_seqs] > num_tokens)
    fail("query_starts must lie in 0.." + std::to_string(num_tokens) + " (the query rows)");
  for (int s = 0; s < num_seqs; ++s) {
    const int64_t q_len = int64_t(starts[s + 1]) - starts[s], ctx = args.context_lens[s];
    if (q_len < 0 || ctx < q_len || ctx > int64_t(a.max_blocks) * a.block_size)
      fail("sequence " + std::to_string(s) + " has " + std::to_string(q_len) + " query rows and context length " +
           std::to_string(ctx) + ": it needs query_starts ascending and query rows <= context <= max_blocks * "
           "block_size");
    const int32_t* table = args.block_tables + int64_t(s) * a.max_blocks;
    for (int64_t j = 0; j < (ctx + a.block_size - 1) / a.block_size; ++j)
      if (table[j] < 0 || table[j] >= num_blocks)
        fail("block_tables[" + std::to_string(s) + "][" + std::to_string(j) + "] is " + std::to_string(table[j]) +
             ", outside the pool's " + std::to_string(num_blocks) + " blocks");
  }
}

const AttentionKernels& active_attention_kernels() { return attention_kernels_for(active_isa()); }

void attend_step(const AttentionArgs& args, int num_seqs) {
  const int num_kv_heads = args.shape.num_kv_heads;
  int64_t row_keys = 0;
  auto tiles = make_tiles(args.query_starts, args.context_lens, num_seqs, num_kv_heads,
                          args.shape.num_heads / num_kv_heads, args.shape.window, row_keys);
  const AttentionKernels& kernels = attention_kernels_for(active_isa());
  auto work = [&](int begin, int end, int) {
    for (int i = begin; i < end; ++i) kernels.attend(args, tiles[i]);
  };
  const int num_tiles = static_cast<int>(tiles.size());
  if (row_keys * 2 * args.shape.head_dim < kParallelWork) {
    work(0, num_tiles, 0);
  } else {
    parallel_for(num_tiles, work);
  }
}

void register_attention(nb::module_& m) {
  m.def("paged_attention", &paged_attention, nb::arg("queries"), nb::arg("key_parts"), nb::arg("value_parts"),
        nb::arg("block_tables"), nb::arg("context_lens"), nb::arg("query_starts"), nb::arg("block_size"),
        nb::arg("scale"), nb::arg("softcap").none(), nb::arg("window").none(), nb::arg("bits"), nb::arg("group_size"),
        "Paged attention of flattened queries (num_tokens, heads, head_dim) float32 over paged K/V pools.");
  m.def("write_pool", &write_pool, nb::arg("pool"), nb::arg("rows"), nb::arg("slot_mapping"),
        "The pool with rows (num_tokens, kv_heads, head_dim) at the slots; in place when the pool is donated.");
  m.def(
      "zeroed", [](const std::vector<int>& shape, const std::string& dtype) { return zeroed(mx::Shape(shape.begin(), shape.end()), dtype_named(dtype)); },
      nb::arg("shape"), nb::arg("dtype"),
      "An array of zeros whose pages are mapped on first touch (no time or memory until written): for KV pools.");
  m.def("mapped_resident_bytes", &mapped_resident_bytes,
        "Bytes of the pages of zeroed()'s arrays (the KV pools) resident in memory.");
  m.def("attention_isa", [] { return std::string(attention_kernels_for(active_isa()).isa); });
}

}  // namespace base_cpu
