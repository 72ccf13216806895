//! Link-time settings for the gateway's binaries, tests and benches, and
//! the web console's files embedded into the binary.
use std::fmt::Write as _;
use std::path::Path;

fn main() {
    embed_console();
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

/// Writes `$OUT_DIR/console_assets.rs`: every servable file of `console/`
/// and `console/vendor/` as `(path, bytes, etag)`, sorted by path, for
/// `http::console`. The ETag is a hash of the bytes, so a browser revalidates
/// cheaply and never keeps a stale copy after an upgrade.
fn embed_console() {
    let root = Path::new(&std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("console");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut files = Vec::new();
    for sub in ["", "vendor"] {
        let Ok(entries) = std::fs::read_dir(root.join(sub)) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let servable = ["html", "js", "mjs", "css", "svg", "png", "ico"]
                .iter()
                .any(|ext| name.ends_with(&format!(".{ext}")));
            if servable && e.path().is_file() {
                let url = if sub.is_empty() {
                    name
                } else {
                    format!("{sub}/{name}")
                };
                files.push((url, e.path()));
            }
        }
    }
    files.sort();
    let mut out = String::from("&[\n");
    for (url, path) in &files {
        let bytes = std::fs::read(path).unwrap();
        // FNV-1a, 64 bits: a cache validator, not a security check.
        let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        });
        writeln!(
            out,
            "    ({url:?}, include_bytes!({:?}), \"\\\"{hash:016x}\\\"\"),",
            path.display().to_string()
        )
        .unwrap();
    }
    out.push(']');
    let dest = Path::new(&std::env::var("OUT_DIR").unwrap()).join("console_assets.rs");
    std::fs::write(dest, out).unwrap();
}
