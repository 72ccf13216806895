// A graph's unevaluated nodes written in Graphviz dot (MLX's
// `export_to_dot`, which mlx-c lacks), so that a decode step's graph can be
// compared node for node with Python mlx-lm's (`mx.export_to_dot` there):
// on a GPU each node is a kernel launch or a view, and a step with more of
// them costs more host and GPU time at the same weights.

#include <exception>
#include <fstream>
#include <vector>

#include "mlx/c/private/array.h"
#include "mlx/graph_utils.h"
#include "mlxgate_kernels.h"

namespace mx = mlx::core;

extern "C" int mlxgate_export_to_dot(const mlx_array* outputs, size_t count, const char* path) {
  try {
    std::vector<mx::array> arrays;
    arrays.reserve(count);
    for (size_t i = 0; i < count; ++i) {
      arrays.push_back(mlx_array_get_(outputs[i]));
    }
    std::ofstream file(path);
    mx::export_to_dot(file, arrays);
    return file.good() ? 0 : 1;
  } catch (std::exception&) {
    return 1;
  }
}
