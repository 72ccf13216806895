//! mlxgate's own CPU kernels (`mlx-sys/kernels/`): MLX primitives that replace
//! MLX's single-threaded CPU `quantized_matmul` on x86-64 CPUs with AVX2/FMA.
//!
//! The choice is made per thread at run time: on GPU builds, on CPUs without
//! AVX2, for dtypes or layouts the kernels do not cover, or with
//! `MLXGATE_KERNELS=mlx`, MLX's own kernel runs. An engine pins its choice on
//! its thread ([`set_thread_choice`]), so one process can compare both.

use std::cell::Cell;
use std::ffi::CStr;
use std::os::raw::c_char;
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype, Stream};

use super::Backend;

/// Which quantized matmul a thread runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelChoice {
    /// mlxgate's multithreaded AVX2 kernels, where they apply.
    Native,
    /// MLX's own kernels everywhere.
    Mlx,
}

impl KernelChoice {
    /// The process default: `MLXGATE_KERNELS=mlx|native`, else native when
    /// this machine runs them (a CPU backend on an AVX2/FMA CPU).
    pub fn default_for_process() -> KernelChoice {
        static DEFAULT: OnceLock<KernelChoice> = OnceLock::new();
        *DEFAULT.get_or_init(|| {
            let asked = std::env::var("MLXGATE_KERNELS").ok();
            if asked.as_deref() == Some("mlx") || !native_available() {
                KernelChoice::Mlx
            } else {
                KernelChoice::Native
            }
        })
    }

    pub fn label(self) -> &'static str {
        match self {
            KernelChoice::Native => "native",
            KernelChoice::Mlx => "mlx",
        }
    }
}

thread_local! {
    static THREAD_CHOICE: Cell<Option<KernelChoice>> = const { Cell::new(None) };
}

/// Pins this thread's kernel choice (engine threads call it at start).
/// `Native` falls back to `Mlx` where the native kernels cannot run.
pub fn set_thread_choice(choice: KernelChoice) {
    let effective = if native_available() {
        choice
    } else {
        KernelChoice::Mlx
    };
    THREAD_CHOICE.with(|cell| cell.set(Some(effective)));
}

/// Prepares an engine thread: pins its kernel choice and, on native kernels,
/// keeps OpenBLAS to one thread (see [`set_blas_threads`]).
pub fn prepare_engine_thread(choice: KernelChoice) {
    set_thread_choice(choice);
    if thread_choice() == KernelChoice::Native {
        set_blas_threads(1);
    }
}

/// This thread's kernel choice.
pub fn thread_choice() -> KernelChoice {
    THREAD_CHOICE
        .with(Cell::get)
        .unwrap_or_else(KernelChoice::default_for_process)
}

/// Whether the native kernels can run here: an AVX2/FMA x86-64 CPU and MLX on
/// its CPU backend.
pub fn native_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        // SAFETY: a pure query of the CPU's features.
        let cpu = unsafe { mlx_sys::mlxgate_kernels_supported() } == 1;
        cpu && Backend::detect() == Backend::Cpu
    })
}

/// Sets how many threads the native kernels use (0: one per available core);
/// returns the count in effect. `MLXGATE_KERNEL_THREADS` sets the default.
pub fn set_threads(threads: usize) -> usize {
    let asked = i32::try_from(threads).unwrap_or(i32::MAX);
    // SAFETY: reconfigures the kernels' pool; callers in flight finish first.
    let got = unsafe { mlx_sys::mlxgate_kernels_set_threads(asked) };
    usize::try_from(got).unwrap_or(1)
}

/// Sets OpenBLAS's thread count for the whole process; returns the previous
/// count, or `None` when MLX's matmuls do not go through OpenBLAS here.
///
/// Decoding with the native kernels issues many tiny f32 matmuls (attention);
/// OpenBLAS's idle threads spin for a long time after each, taking the cores
/// the kernels need, so engines on native kernels run OpenBLAS on one thread.
/// Large dense matmuls (training) ask for all cores with [`BlasThreads`].
pub fn set_blas_threads(threads: usize) -> Option<usize> {
    let asked = i32::try_from(threads.max(1)).unwrap_or(i32::MAX);
    // SAFETY: calls OpenBLAS's own setter when it is loaded.
    let previous = unsafe { mlx_sys::mlxgate_blas_set_threads(asked) };
    usize::try_from(previous).ok()
}

/// Runs OpenBLAS on every core while alive, then restores the previous count.
pub struct BlasThreads {
    previous: Option<usize>,
}

impl BlasThreads {
    pub fn all_cores() -> BlasThreads {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        BlasThreads {
            previous: set_blas_threads(cores),
        }
    }
}

impl Drop for BlasThreads {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            set_blas_threads(previous);
        }
    }
}

/// Whether this thread should run `x @ W^T` for a quantized W natively.
pub fn quantized_matmul_is_native(x: &Array, scales: &Array, group_size: i32, bits: i32) -> bool {
    thread_choice() == KernelChoice::Native
        && (bits == 4 || bits == 8)
        && group_size > 0
        && group_size % 32 == 0
        && x.dtype() == Dtype::Float32
        && scales.dtype() == Dtype::Float32
}

/// `x @ W^T` for an affine-quantized `W` (`transpose = true` in MLX terms),
/// computed by the native kernel on this thread's stream.
pub fn quantized_matmul(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: &Array,
    group_size: i32,
    bits: i32,
) -> Result<Array, Exception> {
    let stream = Stream::thread_local_or_default();
    let mut error = [0 as c_char; 512];
    // SAFETY: the operands are live arrays; `res` starts empty and on success
    // holds a new array whose ownership passes to `Array::from_ptr`. On
    // failure it is freed here and the message is read from `error`, which
    // the kernel NUL-terminates.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let status = mlx_sys::mlxgate_quantized_matmul(
            &mut res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            group_size,
            bits,
            stream.as_ref().as_ptr(),
            error.as_mut_ptr(),
            error.len(),
        );
        if status == 0 {
            Ok(Array::from_ptr(res))
        } else {
            mlx_sys::mlx_array_free(res);
            let message = CStr::from_ptr(error.as_ptr()).to_string_lossy();
            Err(Exception::custom(message.into_owned()))
        }
    }
}
