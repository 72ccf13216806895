//! Link-time settings for binaries, tests and benches of the gateway crate.
fn main() {
    // Lets binaries find libmlx.so without LD_LIBRARY_PATH.
    if let Ok(libdir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{libdir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
}
