// RMSNorm, RoPE, the MLP's gated activation, LayerNorm and a plain activation as single MLX
// primitives (see fused.h).
#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "fused.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "primitive.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace base_cpu {

namespace {

// Below this many elements an op runs on the calling thread (waking the pool costs more).
constexpr int64_t kParallelElements = int64_t(1) << 18;

const FusedKernels& fused_kernels_for(const std::string& isa) {
#if defined(BASE_HAVE_X86_PATHS)
  if (isa == "avx512") return avx512::fused_kernels();
  if (isa == "avx2") return avx2::fused_kernels();
#endif
  return generic::fused_kernels();
}

// fn(begin, end) over [0, rows), on the pool when rows * width is large.
template <class F>
void over_rows(int rows, int64_t width, F fn) {
  if (int64_t(rows) * width < kParallelElements || rows < 2) {
    fn(0, rows);
    return;
  }
  const int chunk = std::max<int>(1, int(kParallelElements / std::max<int64_t>(width, 1)) / 4);
  const int num_chunks = (rows + chunk - 1) / chunk;
  parallel_for(num_chunks, [&](int begin, int end, int) { fn(begin * chunk, std::min(rows, end * chunk)); });
}

enum class Op { kRmsNorm, kRope, kGated, kLayerNorm, kActivate };

struct Params {
  Op op;
  float eps = 0.0f, weight_offset = 0.0f, mscale = 1.0f;
  int dims = 0, act = 0;
  bool traditional = false;
};

void run(const Params& p, const std::vector<mx::array>& in, mx::array& out) {
  std::vector<std::vector<uint8_t>> held;
  const FusedKernels& k = fused_kernels_for(active_isa());
  const float* x = static_cast<const float*>(row_major(in[0], held));
  float* y = out.data<float>();
  if (p.op == Op::kRmsNorm) {
    const int d = in[0].shape(-1);
    const int rows = int(in[0].size() / d);
    const float* w = static_cast<const float*>(row_major(in[1], held));
    over_rows(rows, d, [&](int r0, int r1) { k.rms_norm(x, w, p.weight_offset, p.eps, d, y, r0, r1); });
  } else if (p.op == Op::kRope) {
    const int tokens = in[0].shape(0), heads = in[0].shape(1), head_dim = in[0].shape(2);
    const int32_t* positions = static_cast<const int32_t*>(row_major(in[1], held));
    const float* freqs = static_cast<const float*>(row_major(in[2], held));
    std::vector<float> inv(p.dims / 2);
    for (int i = 0; i < p.dims / 2; ++i) inv[i] = 1.0f / freqs[i];
    over_rows(tokens, int64_t(heads) * head_dim, [&](int t0, int t1) {
      k.rope(x, positions, inv.data(), heads, head_dim, p.dims, p.traditional, p.mscale, y, t0, t1);
    });
  } else if (p.op == Op::kLayerNorm) {
    const int d = in[0].shape(-1);
    const int rows = int(in[0].size() / d);
    const float* w = in.size() > 1 ? static_cast<const float*>(row_major(in[1], held)) : nullptr;
    const float* b = in.size() > 2 ? static_cast<const float*>(row_major(in[2], held)) : nullptr;
    over_rows(rows, d, [&](int r0, int r1) { k.layer_norm(x, w, b, p.eps, d, y, r0, r1); });
  } else if (p.op == Op::kActivate) {
    // rows of 4,096 values: whole vectors, and chunks the pool shares out
    const int64_t size = int64_t(in[0].size()), width = 4096;
    over_rows(int((size + width - 1) / width), width,
              [&](int r0, int r1) { k.activate(x, p.act, y, r0 * width, std::min(size, r1 * width)); });
  } else {
    const int n = in[0].shape(-1) / 2;
    const int rows = int(in[0].size() / (2 * int64_t(n)));
    over_rows(rows, 2 * int64_t(n), [&](int r0, int r1) { k.gated(x, n, p.act, y, r0, r1); });
  }
}

class FusedOp : public mx::UnaryPrimitive {
 public:
  FusedOp(mx::Stream stream, Params params) : mx::UnaryPrimitive(stream), params_(params) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    // NOTE: the task may outlive this primitive, so it holds a copy of the parameters.
    dispatch(stream(), inputs, out, [params = params_](const std::vector<mx::array>& in, mx::array& o) {
      run(params, in, o);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("the fused CPU ops have no GPU path");
  }

  const char* name() const override {
    switch (params_.op) {
      case Op::kRmsNorm: return "BaseRmsNorm";
      case Op::kRope: return "BaseRope";
      case Op::kGated: return "BaseGatedActivation";
      case Op::kLayerNorm: return "BaseLayerNorm";
      default: return "BaseActivation";
    }
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Params& a = params_;
    const Params& b = static_cast<const FusedOp&>(other).params_;
    return a.op == b.op && a.eps == b.eps && a.weight_offset == b.weight_offset && a.mscale == b.mscale &&
           a.dims == b.dims && a.act == b.act && a.traditional == b.traditional;
  }

 private:
  Params params_;
};

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, float weight_offset) {
  require(x.dtype() == mx::float32 && weight.dtype() == mx::float32, "rms_norm: x and weight must be float32");
  require(x.ndim() >= 1 && x.shape(-1) > 0 && weight.ndim() == 1 && weight.shape(0) == x.shape(-1),
          "rms_norm: weight must be (D,) for x (..., D), D at least 1");
  Params p{Op::kRmsNorm};
  p.eps = eps;
  p.weight_offset = weight_offset;
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedOp>(cpu_stream(), p), {x, weight});
}

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& freqs, int dims, bool traditional,
               float mscale) {
  require(x.dtype() == mx::float32 && x.ndim() == 3, "rope: x must be float32 (num_tokens, heads, head_dim)");
  require(positions.dtype() == mx::int32 && positions.ndim() == 1 && positions.shape(0) == x.shape(0),
          "rope: positions must be int32 (num_tokens,)");
  require(dims > 0 && dims % 2 == 0 && dims <= x.shape(2), "rope: dims must be even and at most head_dim");
  require(freqs.dtype() == mx::float32 && freqs.ndim() == 1 && freqs.shape(0) == dims / 2,
          "rope: freqs must be float32 (dims / 2,)");
  Params p{Op::kRope};
  p.dims = dims;
  p.traditional = traditional;
  p.mscale = mscale;
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedOp>(cpu_stream(), p), {x, positions, freqs});
}

int activation_named(const std::string& act, const std::string& op) {
  if (act == "silu") return kSilu;
  if (act == "gelu_tanh") return kGeluTanh;
  if (act == "gelu") return kGeluErf;
  throw std::invalid_argument(op + ": act must be silu, gelu_tanh or gelu, got " + act);
}

mx::array gated_activation(const mx::array& gate_up, const std::string& act) {
  require(gate_up.dtype() == mx::float32 && gate_up.ndim() >= 1 && gate_up.shape(-1) > 0 && gate_up.shape(-1) % 2 == 0,
          "gated_activation: gate_up must be float32 (..., 2 * N), N at least 1");
  Params p{Op::kGated};
  p.act = activation_named(act, "gated_activation");
  mx::Shape shape = gate_up.shape();
  shape.back() /= 2;
  return mx::array(shape, mx::float32, std::make_shared<FusedOp>(cpu_stream(), p), {gate_up});
}

mx::array activation(const mx::array& x, const std::string& act) {
  require(x.dtype() == mx::float32, "activation: x must be float32");
  Params p{Op::kActivate};
  p.act = activation_named(act, "activation");
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedOp>(cpu_stream(), p), {x});
}

mx::array layer_norm(const mx::array& x, std::optional<mx::array> weight, std::optional<mx::array> bias, float eps) {
  require(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) > 0,
          "layer_norm: x must be float32 (..., D), D at least 1");
  require(weight.has_value() || !bias.has_value(), "layer_norm: a bias needs a weight (pass ones)");
  std::vector<mx::array> inputs{x};
  for (auto* part : {&weight, &bias}) {
    if (!part->has_value()) break;
    require(part->value().dtype() == mx::float32 && part->value().ndim() == 1 && part->value().shape(0) == x.shape(-1),
            "layer_norm: weight and bias must be float32 (D,) for x (..., D)");
    inputs.push_back(part->value());
  }
  Params p{Op::kLayerNorm};
  p.eps = eps;
  return mx::array(x.shape(), mx::float32, std::make_shared<FusedOp>(cpu_stream(), p), std::move(inputs));
}

}  // namespace

const FusedKernels& active_fused_kernels() { return fused_kernels_for(active_isa()); }

void register_fused(nb::module_& m) {
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"), nb::arg("weight_offset") = 0.0f,
        "x * rsqrt(mean(x^2, -1) + eps) * (weight + weight_offset), float32.");
  m.def("rope", &rope, nb::arg("x"), nb::arg("positions"), nb::arg("freqs"), nb::arg("dims"), nb::arg("traditional"),
        nb::arg("mscale") = 1.0f,
        "Rotary embedding of x (num_tokens, heads, head_dim) at per-token positions; freqs are the periods "
        "(dims / 2,) as mx.fast.rope takes them; the rotated part is scaled by mscale.");
  m.def("gated_activation", &gated_activation, nb::arg("gate_up"), nb::arg("act"),
        "act(gate) * up for gate_up = [gate | up] along the last axis (silu, gelu_tanh or gelu).");
  m.def("activation", &activation, nb::arg("x"), nb::arg("act"),
        "act(x) elementwise, float32 (silu, gelu_tanh or gelu).");
  m.def("layer_norm", &layer_norm, nb::arg("x"), nb::arg("weight").none(), nb::arg("bias").none(), nb::arg("eps"),
        "(x - mean(x, -1)) * rsqrt(var(x, -1) + eps) * weight + bias, float32 (weight, bias (D,) or None).");
  m.def("fused_isa", [] { return std::string(fused_kernels_for(active_isa()).isa); });
}

}  // namespace base_cpu
