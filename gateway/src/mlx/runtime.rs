//! What MLX this process runs on: version, backend, devices and library path.

use std::ffi::CStr;
use std::fmt;
use std::path::PathBuf;

/// The compute backend MLX was built for (decided by which wheel is installed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        })
    }
}

/// Facts about the MLX library loaded into this process.
#[derive(Debug, Clone)]
pub struct RuntimeInfo {
    pub version: String,
    pub backend: Backend,
    pub cpu_devices: usize,
    pub gpu_devices: usize,
    /// Where the dynamic loader found `libmlx.so`, when it can be told.
    pub library: Option<PathBuf>,
}

impl Backend {
    /// The backend of the MLX loaded into this process.
    pub fn detect() -> Backend {
        if probe(mlx_sys::mlx_cuda_is_available) {
            Backend::Cuda
        } else if probe(mlx_sys::mlx_metal_is_available) {
            Backend::Metal
        } else {
            Backend::Cpu
        }
    }
}

impl RuntimeInfo {
    pub fn detect() -> Self {
        RuntimeInfo {
            version: version(),
            backend: Backend::detect(),
            cpu_devices: device_count(mlx_sys::mlx_device_type__MLX_CPU),
            gpu_devices: device_count(mlx_sys::mlx_device_type__MLX_GPU),
            library: loaded_library_path("libmlx.so"),
        }
    }
}

fn version() -> String {
    // SAFETY: mlx_string is created, filled by mlx_version and freed here; the
    // data pointer is copied before the free.
    unsafe {
        let mut text = mlx_sys::mlx_string_new();
        let status = mlx_sys::mlx_version(&mut text);
        let version = if status == 0 {
            CStr::from_ptr(mlx_sys::mlx_string_data(text))
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".to_owned()
        };
        mlx_sys::mlx_string_free(text);
        version
    }
}

fn probe(check: unsafe extern "C" fn(*mut bool) -> std::os::raw::c_int) -> bool {
    let mut available = false;
    // SAFETY: the probe only writes the bool it is handed.
    let status = unsafe { check(&mut available) };
    status == 0 && available
}

fn device_count(kind: mlx_sys::mlx_device_type) -> usize {
    let mut count = 0;
    // SAFETY: writes one int.
    let status = unsafe { mlx_sys::mlx_device_count(&mut count, kind) };
    if status == 0 {
        count.max(0) as usize
    } else {
        0
    }
}

/// MLX settings read from the environment when its CUDA backend starts, with
/// the values a serving process needs where the user set none. MLX keys its
/// CUDA graph cache by a step's topology, which changes as a continuous
/// batch changes members (each row attends over its own cache): at MLX's
/// default of 400 entries the cache thrashed within a minute of 128 varied
/// streams, and MLX then failed the step (and its requests) with an error.
/// So the cache is larger and its thrashing check, which only throws, off:
/// a thrashing cache is slow, not wrong.
/// (Which attention calls reach cuDNN is decided per call: `attention.rs`.)
pub const CUDA_ENV_DEFAULTS: [(&str, &str); 2] = [
    ("MLX_CUDA_GRAPH_CACHE_SIZE", "4000"),
    ("MLX_ENABLE_CACHE_THRASHING_CHECK", "0"),
];

/// Sets [`CUDA_ENV_DEFAULTS`] that are unset. Call first thing in `main`,
/// before any thread starts (setting the environment is not thread-safe).
pub fn set_process_defaults() {
    for (name, value) in CUDA_ENV_DEFAULTS {
        if std::env::var_os(name).is_none() {
            // SAFETY: called at the top of `main`, while the process has one
            // thread, so nothing reads the environment concurrently.
            unsafe { std::env::set_var(name, value) };
        }
    }
}

/// MLX's buffer cache on a GPU when `MLXGATE_MLX_CACHE_MB` is unset.
pub const GPU_BUFFER_CACHE_MB: usize = 4096;

/// The GPU buffer cache bound in MB: `MLXGATE_MLX_CACHE_MB`, else
/// [`GPU_BUFFER_CACHE_MB`].
pub fn gpu_buffer_cache_mb() -> usize {
    std::env::var("MLXGATE_MLX_CACHE_MB")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(GPU_BUFFER_CACHE_MB)
}

/// Bounds MLX's cache of freed buffers on a GPU (once per process; the CPU
/// keeps MLX's default) to `MLXGATE_MLX_CACHE_MB`, else
/// [`GPU_BUFFER_CACHE_MB`]. By default MLX keeps freed buffers up to its
/// whole memory limit; a continuous batch frees buffers of ever-changing
/// sizes (KV slabs of every width): on an H100 under 128 streams the cache
/// reached 47-70 GB, and from then on every evaluation took 250-500 ms, a
/// step or a prefill, for good (6 ms before); with the bound it did not.
/// Returns the limit set, in bytes.
pub fn limit_gpu_buffer_cache() -> Option<usize> {
    static LIMIT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *LIMIT.get_or_init(|| {
        if Backend::detect() == Backend::Cpu {
            return None;
        }
        let bytes = gpu_buffer_cache_mb() << 20;
        match mlx_rs::memory::set_cache_limit(bytes) {
            Ok(_) => Some(bytes),
            Err(error) => {
                tracing::warn!(%error, "cannot bound MLX's buffer cache");
                None
            }
        }
    })
}

/// Empties MLX's buffer cache on a GPU once it holds more than 7/8 of its
/// bound ([`limit_gpu_buffer_cache`]); call between engine steps.
///
/// Why: at its bound MLX frees a released buffer instead of caching it, and
/// the small arrays a step makes from host data live in unified memory,
/// whose `cudaFree` waits for the whole GPU. A cache left full (big buffers
/// of a prefill or of a grown slab that nothing reuses) would turn the
/// inputs of every decode step into such waits, stalling the step running
/// ahead. Emptied, the cache refills with the step's own buffers, reused
/// each step: on an H100, 1.10x the decode rate at 32 rows, 1.14x at 128
/// (BENCHMARKS.md). `MLXGATE_TRIM_CACHE=0` turns this off.
pub fn trim_gpu_buffer_cache() {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let enabled =
        *ENABLED.get_or_init(|| std::env::var("MLXGATE_TRIM_CACHE").map_or(true, |v| v != "0"));
    let Some(limit) = limit_gpu_buffer_cache().filter(|_| enabled) else {
        return;
    };
    let held = mlx_rs::memory::cache_memory().unwrap_or(0);
    if held <= limit / 8 * 7 {
        return;
    }
    match mlx_rs::memory::clear_cache() {
        // Logged beside the steps, so a step log shows how often it empties.
        Ok(()) => tracing::debug!(
            target: "mlxgate::engine::steps",
            cached_mb = held >> 20,
            "buffer cache emptied"
        ),
        Err(error) => tracing::warn!(%error, "cannot empty MLX's buffer cache"),
    }
}

/// The first CUDA device as the NVIDIA driver describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct CudaDevice {
    pub name: String,
    pub memory_bytes: u64,
    /// The CUDA version the driver supports, e.g. `13.0`.
    pub driver_cuda: String,
}

impl CudaDevice {
    /// Asks the driver (`libcuda.so.1`, which MLX's CUDA backend loads
    /// anyway) about device 0; `None` without a driver or a device.
    pub fn first() -> Option<CudaDevice> {
        type Init = unsafe extern "C" fn(u32) -> i32;
        type Get = unsafe extern "C" fn(*mut i32, i32) -> i32;
        type Name = unsafe extern "C" fn(*mut std::os::raw::c_char, i32, i32) -> i32;
        type Mem = unsafe extern "C" fn(*mut usize, i32) -> i32;
        type Version = unsafe extern "C" fn(*mut i32) -> i32;
        // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast
        // to its documented driver-API signature and called with pointers
        // to live locals of the right types; the library stays loaded.
        unsafe {
            let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if lib.is_null() {
                return None;
            }
            let sym = |name: &CStr| {
                let f = libc::dlsym(lib, name.as_ptr());
                (!f.is_null()).then_some(f)
            };
            let init: Init = std::mem::transmute(sym(c"cuInit")?);
            let get: Get = std::mem::transmute(sym(c"cuDeviceGet")?);
            let name_of: Name = std::mem::transmute(sym(c"cuDeviceGetName")?);
            let mem_of: Mem = std::mem::transmute(sym(c"cuDeviceTotalMem_v2")?);
            let version_of: Version = std::mem::transmute(sym(c"cuDriverGetVersion")?);
            let (mut device, mut memory, mut version) = (0i32, 0usize, 0i32);
            let mut name = [0 as std::os::raw::c_char; 256];
            if init(0) != 0
                || get(&mut device, 0) != 0
                || name_of(name.as_mut_ptr(), name.len() as i32, device) != 0
                || mem_of(&mut memory, device) != 0
                || version_of(&mut version) != 0
            {
                return None;
            }
            Some(CudaDevice {
                name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                memory_bytes: memory as u64,
                driver_cuda: format!("{}.{}", version / 1000, (version % 1000) / 10),
            })
        }
    }
}

/// Finds a shared library mapped into this process (Linux: `/proc/self/maps`).
fn loaded_library_path(file_name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.rsplit('/').next() == Some(file_name))
        .map(PathBuf::from)
}
