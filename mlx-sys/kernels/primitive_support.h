// What mlxgate's MLX primitives share: starting an evaluation on the CPU
// command encoder, the CPU-stream check, and turning a C++ exception into
// the C ABI's status and message.
#ifndef MLXGATE_PRIMITIVE_SUPPORT_H
#define MLXGATE_PRIMITIVE_SUPPORT_H

#include <cstddef>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/c/private/stream.h"

namespace mlxgate {

/// Allocates `out` and registers the inputs and the output with `stream`'s
/// encoder, which keeps them alive until the dispatched work has run.
inline mlx::core::cpu::CommandEncoder& begin_eval(
    mlx::core::Stream stream,
    const std::vector<mlx::core::array>& inputs,
    mlx::core::array& out) {
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (const mlx::core::array& input : inputs) {
    encoder.set_input_array(input);
  }
  encoder.set_output_array(out);
  return encoder;
}

/// The stream behind `s`; throws, naming `kernel`, unless it is a CPU stream.
inline const mlx::core::Stream& cpu_stream(const mlx_stream s, const char* kernel) {
  const mlx::core::Stream& stream = mlx_stream_get_(s);
  if (stream.device != mlx::core::Device::cpu) {
    throw std::invalid_argument(std::string(kernel) + " runs on CPU streams only");
  }
  return stream;
}

/// A C entry point's failure: the message into `error` (NUL-terminated,
/// truncated to `error_len`), status 1.
inline int failed(const std::exception& e, char* error, size_t error_len) {
  if (error && error_len) {
    std::snprintf(error, error_len, "%s", e.what());
  }
  return 1;
}

}  // namespace mlxgate

#endif
