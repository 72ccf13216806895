//! Raw bindings to mlx-c, built against an installed MLX on Linux.
//!
//! This crate stands in for the published `mlx-sys` 0.7.0 (which builds only on
//! macOS) so that `mlx-rs` compiles unchanged; see `build.rs` for how MLX and the
//! mlx-c sources are found.
#![allow(non_upper_case_globals)]
#![allow(non_camel_case_types)]
#![allow(non_snake_case)]
#![allow(clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// IEEE half as 16 raw bits; mlx-rs reads it through `.0`.
#[repr(transparent)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct float16_t(pub u16);

/// mlx-rs seeds its default RNG from `mach_approximate_time` (a macOS call it
/// reaches through `mach-sys`). On other systems we provide the symbol: a
/// monotonic nanosecond clock serves the same purpose.
#[cfg(not(target_vendor = "apple"))]
#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    // Offset by wall time so two processes do not share a seed.
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    wall.wrapping_add(start.elapsed().as_nanos() as u64)
}
