//! Builds mlx-c against an installed MLX (the `mlx-cpu` or `mlx-cuda-13` wheel)
//! and generates its bindings.
//!
//! * MLX comes from `$MLX_PREFIX`, else the project-local `.deps/mlx/mlx` that
//!   `scripts/setup.sh` installs, else wherever `python3` finds the `mlx` package.
//! * mlx-c's sources come from the published `mlx-sys` 0.7.0 crate at build time
//!   (cargo's registry cache), never from this repository.
//! * Dependents that link a binary read `DEP_MLX_LIBDIR` to set an rpath, so the
//!   binary runs without `LD_LIBRARY_PATH`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_C_CRATE: &str = "mlx-sys-0.7.0";

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_PREFIX");
    println!("cargo:rerun-if-env-changed=RUSTC_WORKSPACE_WRAPPER");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=include/mlxgate_prelude.h");
    // The whole directory: every source and the headers they include
    // (quantized_matmul.cpp's qmm_*.h parts among them).
    println!("cargo:rerun-if-changed=kernels");

    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let prelude = manifest_dir.join("include/mlxgate_prelude.h");

    let mlx = find_mlx(&manifest_dir);
    let mlx_c = find_mlx_c_sources(&manifest_dir, &out_dir);
    if !under_clippy() {
        compile_mlx_c(&mlx_c, &mlx, &prelude);
        compile_kernels(&manifest_dir.join("kernels"), &mlx_c, &mlx, &prelude);
    }
    link_mlx(&mlx);
    generate_bindings(&mlx_c, &manifest_dir.join("kernels"), &prelude, &out_dir);
}

/// Whether cargo runs this for clippy, which only checks and never links:
/// the C++ objects are then not needed. Clippy's wrapper gives workspace
/// members their own build directory, so compiling them there would repeat
/// the test build's minutes of C++ (CI runs both).
fn under_clippy() -> bool {
    env::var_os("RUSTC_WORKSPACE_WRAPPER").is_some_and(|w| {
        Path::new(&w)
            .file_stem()
            .is_some_and(|s| s == "clippy-driver")
    })
}

/// Where an MLX installation keeps its headers and `libmlx.so`.
struct Mlx {
    include: PathBuf,
    lib: PathBuf,
}

fn find_mlx(manifest_dir: &Path) -> Mlx {
    let local = manifest_dir.join("../.deps/mlx/mlx");
    println!("cargo:rerun-if-changed={}", local.display());
    let prefix = env::var_os("MLX_PREFIX")
        .map(PathBuf::from)
        .or_else(|| local.join("lib/libmlx.so").exists().then_some(local))
        .or_else(python_mlx_prefix)
        .unwrap_or_else(|| {
            panic!(
                "MLX not found. Run `scripts/setup.sh` (installs the mlx-cpu wheel into .deps/mlx), \
                 or set MLX_PREFIX to a directory holding include/mlx and lib/libmlx.so"
            )
        });
    let prefix = prefix.canonicalize().unwrap_or(prefix);
    let mlx = Mlx {
        include: prefix.join("include"),
        lib: prefix.join("lib"),
    };
    assert!(
        mlx.include.join("mlx/mlx.h").exists() && mlx.lib.join("libmlx.so").exists(),
        "{} does not look like an MLX installation (need include/mlx/mlx.h and lib/libmlx.so)",
        prefix.display()
    );
    mlx
}

/// Asks python3 where the `mlx` package (from an `mlx-cpu`/`mlx-cuda-*` wheel) lives.
fn python_mlx_prefix() -> Option<PathBuf> {
    let script = "import importlib.util as u; s = u.find_spec('mlx'); \
                  print(list(s.submodule_search_locations)[0])";
    let out = Command::new("python3").args(["-c", script]).output().ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && path.join("lib/libmlx.so").exists()).then_some(path)
}

/// The mlx-c tree vendored inside the published mlx-sys 0.7.0 crate.
fn find_mlx_c_sources(manifest_dir: &Path, out_dir: &Path) -> PathBuf {
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))
        .expect("neither CARGO_HOME nor HOME is set");
    let registry = cargo_home.join("registry");
    if let Some(found) = lookup_mlx_c(&registry, out_dir) {
        return found;
    }
    // Not downloaded yet: let cargo fetch it (checksum pinned by the helper's Cargo.lock).
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .arg("fetch")
        .arg("--manifest-path")
        .arg(manifest_dir.join("mlx-c-source/Cargo.toml"))
        .status()
        .expect("failed to run `cargo fetch` for the mlx-c sources");
    assert!(
        status.success(),
        "`cargo fetch` of mlx-sys 0.7.0 (mlx-c sources) failed"
    );
    lookup_mlx_c(&registry, out_dir).expect(
        "mlx-sys 0.7.0 was fetched but its mlx-c sources were not found in the cargo registry",
    )
}

fn lookup_mlx_c(registry: &Path, out_dir: &Path) -> Option<PathBuf> {
    let in_each = |dir: &str, name: &str| -> Vec<PathBuf> {
        fs::read_dir(registry.join(dir))
            .into_iter()
            .flatten()
            .flatten()
            .map(|index| index.path().join(name))
            .filter(|path| path.exists())
            .collect()
    };
    if let Some(src) = in_each("src", MLX_C_CRATE).into_iter().next() {
        let root = src.join("src/mlx-c");
        if root.join("CMakeLists.txt").exists() {
            return Some(root);
        }
    }
    // Only the compressed .crate is cached: unpack it into OUT_DIR.
    let archive = in_each("cache", &format!("{MLX_C_CRATE}.crate"))
        .into_iter()
        .next()?;
    let status = Command::new("tar")
        .arg("xzf")
        .arg(&archive)
        .arg("-C")
        .arg(out_dir)
        .status()
        .ok()?;
    let root = out_dir.join(MLX_C_CRATE).join("src/mlx-c");
    (status.success() && root.join("CMakeLists.txt").exists()).then_some(root)
}

/// The `.cpp` files mlx-c's CMakeLists.txt builds (commented-out lines excluded).
fn mlx_c_sources(mlx_c: &Path) -> Vec<PathBuf> {
    let cmake =
        fs::read_to_string(mlx_c.join("CMakeLists.txt")).expect("read mlx-c CMakeLists.txt");
    let sources: Vec<PathBuf> = cmake
        .lines()
        .map(str::trim)
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.strip_prefix("${CMAKE_CURRENT_LIST_DIR}/"))
        .map(|rest| rest.trim_end_matches(')'))
        .filter(|file| file.starts_with("mlx/c/") && file.ends_with(".cpp"))
        .map(|file| mlx_c.join(file))
        .collect();
    assert!(
        sources.len() > 10,
        "unexpected mlx-c CMakeLists.txt: found {} sources",
        sources.len()
    );
    sources
}

fn compile_mlx_c(mlx_c: &Path, mlx: &Mlx, prelude: &Path) {
    let sources = mlx_c_sources(mlx_c);
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .opt_level(2)
        .debug(false)
        .warnings(false)
        .pic(true)
        .include(mlx_c)
        .flag("-isystem")
        .flag(mlx.include.to_str().expect("utf-8 MLX path"))
        .flag("-include")
        .flag(prelude.to_str().expect("utf-8 prelude path"))
        .files(&sources);
    build.compile("mlxc");
}

/// mlxgate's own CPU kernels (MLX primitives, `kernels/`). Built for baseline
/// x86-64: the AVX2 code paths carry `target` attributes and are chosen at run
/// time, so the library still loads on older CPUs.
fn compile_kernels(kernels: &Path, mlx_c: &Path, mlx: &Mlx, prelude: &Path) {
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .opt_level(3)
        .debug(false)
        .warnings(true)
        .pic(true)
        .include(kernels)
        .flag("-isystem")
        .flag(mlx_c.to_str().expect("utf-8 mlx-c path"))
        .flag("-isystem")
        .flag(mlx.include.to_str().expect("utf-8 MLX path"))
        .flag("-include")
        .flag(prelude.to_str().expect("utf-8 prelude path"))
        // One translation unit with its qmm_*.h parts, which it includes.
        .file(kernels.join("quantized_matmul.cpp"))
        .file(kernels.join("attention.cpp"))
        .file(kernels.join("activation.cpp"))
        .file(kernels.join("dense.cpp"))
        .file(kernels.join("encoder_attention.cpp"))
        .file(kernels.join("distributed.cpp"))
        .file(kernels.join("ragged_attention.cpp"))
        .file(kernels.join("decode_matmul.cpp"))
        .file(kernels.join("graph_dot.cpp"))
        .compile("mlxgate_kernels");
}

fn link_mlx(mlx: &Mlx) {
    println!("cargo:rustc-link-search=native={}", mlx.lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    // libmlx.so is built against libstdc++ (cc already links it for mlxc).
    println!("cargo:rustc-link-lib=dylib=stdc++");
    // Read by dependents' build scripts as DEP_MLX_LIBDIR / DEP_MLX_INCLUDE.
    println!("cargo:libdir={}", mlx.lib.display());
    println!("cargo:include={}", mlx.include.display());
}

fn generate_bindings(mlx_c: &Path, kernels: &Path, prelude: &Path, out_dir: &Path) {
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .expect("list mlx-c headers")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "h"))
        .collect();
    headers.sort();
    headers.push(kernels.join("mlxgate_kernels.h"));
    let bindings = headers
        .iter()
        .fold(bindgen::Builder::default(), |builder, header| {
            builder.header(header.to_string_lossy())
        })
        .rust_target("1.73.0".parse().expect("rust target"))
        .clang_arg(format!("-I{}", mlx_c.display()))
        .clang_arg("-include")
        .clang_arg(prelude.to_string_lossy())
        // mlx-rs reads float16_t as a newtype over u16 (lib.rs defines it).
        .blocklist_type("float16_t")
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .generate()
        .expect("bindgen failed on the mlx-c headers (is libclang-dev installed?)");
    bindings
        .write_to_file(out_dir.join("bindings.rs"))
        .expect("write bindings.rs");
}
