//! Link-time settings for the gateway's binaries, tests and benches.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    println!("cargo:rerun-if-env-changed=MLXGATE_BLAS");
    // Lets binaries find libmlx.so without LD_LIBRARY_PATH.
    if let Ok(libdir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    // The mlx-cpu wheel bundles the slow reference BLAS. Linking OpenBLAS into
    // the executable first makes the dynamic loader resolve MLX's BLAS calls to
    // it (see BENCHMARKS.md). `--no-as-needed` keeps the otherwise-unreferenced
    // library. MLXGATE_BLAS=reference opts out, for comparison.
    let reference = std::env::var("MLXGATE_BLAS").is_ok_and(|v| v == "reference");
    if !reference && std::path::Path::new("/usr/lib/x86_64-linux-gnu/libopenblas.so.0").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-l:libopenblas.so.0,--as-needed");
    }
}
