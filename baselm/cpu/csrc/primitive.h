// What every kernel primitive needs from MLX: queueing its work on the stream the way MLX's own
// CPU ops do, and row-major views of its inputs.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"

namespace base_cpu {

// A pointer to `a`'s elements in row-major order. Call it from the dispatched task: only
// then are the input's contents computed.
inline const void* row_major(const mlx::core::array& a, std::vector<std::vector<uint8_t>>& held) {
  if (a.flags().row_contiguous) return a.data<uint8_t>();
  const size_t item = a.itemsize();
  const int ndim = a.ndim();
  held.emplace_back(a.size() * item);
  uint8_t* dst = held.back().data();
  const uint8_t* src = a.data<uint8_t>();
  std::vector<int64_t> index(ndim, 0);
  for (size_t i = 0; i < a.size(); ++i) {
    int64_t offset = 0;
    for (int d = 0; d < ndim; ++d) offset += index[d] * a.strides()[d];
    std::memcpy(dst + i * item, src + offset * static_cast<int64_t>(item), item);
    for (int d = ndim - 1; d >= 0; --d) {
      if (++index[d] < a.shape(d)) break;
      index[d] = 0;
    }
  }
  return dst;
}

// Allocates `out`, then queues `task(inputs, out)` on the stream as MLX's own CPU ops do.
template <class Task>
void dispatch(const mlx::core::Stream& stream, const std::vector<mlx::core::array>& inputs, mlx::core::array& out, Task task) {
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  for (auto& in : inputs) encoder.set_input_array(in);
  encoder.set_output_array(out);
  encoder.dispatch([inputs, out, task]() mutable { task(inputs, out); });
}

}  // namespace base_cpu
