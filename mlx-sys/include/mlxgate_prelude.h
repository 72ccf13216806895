/*
 * Force-included (`-include`) into every mlx-c translation unit and into the
 * bindgen parse. It fills the gaps between mlx-c (written for macOS/clang) and
 * Linux with g++ 12, without touching mlx-c's own sources.
 */
#ifndef MLXGATE_PRELUDE_H
#define MLXGATE_PRELUDE_H

#ifdef __cplusplus

/* g++ 12's libstdc++ has no <format>; mlx-c only uses std::format("...{}...", ...). */
#if __has_include(<format>)
#include <format>
#else
#include <sstream>
#include <string>
#include <string_view>
namespace std {
namespace mlxgate_format {
inline void write(std::ostringstream& out, std::string_view fmt) { out << fmt; }
template <class T, class... Rest>
void write(std::ostringstream& out, std::string_view fmt, const T& value, const Rest&... rest) {
  auto at = fmt.find("{}");
  if (at == std::string_view::npos) {
    out << fmt;
    return;
  }
  out << fmt.substr(0, at) << value;
  write(out, fmt.substr(at + 2), rest...);
}
} // namespace mlxgate_format
template <class... Args>
std::string format(std::string_view fmt, const Args&... args) {
  std::ostringstream out;
  mlxgate_format::write(out, fmt, args...);
  return out.str();
}
} // namespace std
#endif

/* mlx-c declares float16_t/bfloat16_t only on aarch64; mlx-rs needs the
 * float16/bfloat16 entry points everywhere. Use MLX's own 2-byte types. */
#if !defined(__aarch64__) && __has_include(<mlx/types/half_types.h>)
#include <mlx/types/half_types.h>
typedef mlx::core::float16_t float16_t;
typedef mlx::core::bfloat16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16
#endif

#else /* C: the bindgen parse. Both half types cross the ABI as 16 raw bits. */

#if !defined(__aarch64__)
#include <stdint.h>
typedef uint16_t float16_t;
typedef uint16_t bfloat16_t;
#define HAS_FLOAT16
#define HAS_BFLOAT16
#endif

#endif /* __cplusplus */
#endif /* MLXGATE_PRELUDE_H */
