// mlxgate: MLX's distributed `init` with the exception's text returned
// (mlx-c 0.7.0 reports it only to its error handler), so that a rank that
// cannot join its group says why; and `clear_backends`, which mlx-c lacks,
// so that rank 0 of a served group can form it again after a worker died.
//
// Collectives themselves go through mlx-c (`mlx_distributed_all_sum` ...),
// which bindgen already exposes.

#include <cstdio>
#include <exception>
#include <string>

#include "mlx/c/private/distributed_group.h"
#include "mlx/distributed/distributed.h"
#include "mlxgate_kernels.h"

namespace {

void write_error(char* error, size_t error_len, const char* what) {
  if (error != nullptr && error_len > 0) {
    std::snprintf(error, error_len, "%s", what);
  }
}

} // namespace

extern "C" int mlxgate_distributed_init(
    const char* backend,
    bool strict,
    mlx_distributed_group* res,
    char* error,
    size_t error_len) {
  try {
    std::string name = backend != nullptr ? backend : "any";
    auto group = mlx::core::distributed::init(strict, name);
    mlx_distributed_group_set_(*res, group);
    return 0;
  } catch (const std::exception& e) {
    write_error(error, error_len, e.what());
    return 1;
  } catch (...) {
    write_error(error, error_len, "unknown error in distributed init");
    return 1;
  }
}

extern "C" void mlxgate_distributed_reset(void) {
  try {
    mlx::core::distributed::clear_backends();
  } catch (...) {
    // Nothing to report: the next init says what is wrong.
  }
}
