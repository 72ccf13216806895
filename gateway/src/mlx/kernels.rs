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

/// Whether the kernels cover this quantization: 4 or 8 bits, groups of a
/// multiple of 32, f32 scales (MLX keeps biases in the scales' dtype).
fn covers(scales: &Array, group_size: i32, bits: i32) -> bool {
    (bits == 4 || bits == 8)
        && group_size > 0
        && group_size % 32 == 0
        && scales.dtype() == Dtype::Float32
}

/// Whether this thread should run `x @ W^T` for a quantized W natively.
pub fn quantized_matmul_is_native(x: &Array, scales: &Array, group_size: i32, bits: i32) -> bool {
    thread_choice() == KernelChoice::Native
        && x.dtype() == Dtype::Float32
        && covers(scales, group_size, bits)
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

/// The packed data of an evaluated array: `None` for views and broadcasts,
/// which the raw kernels cannot read.
fn packed_data(array: &Array) -> Option<*const std::ffi::c_void> {
    let mut data = std::ptr::null();
    // SAFETY: `array` is live; the call evaluates it if needed and writes
    // `data` only when it returns 0.
    let status = unsafe { mlx_sys::mlxgate_array_packed_data(array.as_ptr(), &mut data) };
    (status == 0 && !data.is_null()).then_some(data)
}

/// An affine-quantized `[rows, cols]` matrix whose packed buffers the native
/// kernels read in place, outside MLX's graph (the native decode step).
/// Holds its arrays, so the buffers live as long as it does.
pub struct PackedMatrix {
    _arrays: [Array; 3],
    weight: *const u8,
    scales: *const f32,
    biases: *const f32,
    pub rows: usize,
    pub cols: usize,
    group_size: usize,
    bits: usize,
}

// SAFETY: the buffers belong to evaluated MLX arrays, which MLX never
// writes again; every use only reads them.
unsafe impl Send for PackedMatrix {}
unsafe impl Sync for PackedMatrix {}

impl PackedMatrix {
    /// `None` unless the native kernels run here and cover this layout
    /// (4 or 8 bits, groups of a multiple of 32, f32 scales and biases,
    /// packed buffers).
    pub fn new(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        group_size: i32,
        bits: i32,
    ) -> Option<PackedMatrix> {
        let supported = native_available()
            && covers(scales, group_size, bits)
            && weight.dtype() == Dtype::Uint32
            && biases.dtype() == Dtype::Float32
            && weight.ndim() == 2;
        if !supported {
            return None;
        }
        let rows = weight.shape()[0] as usize;
        let cols = weight.shape()[1] as usize * 32 / bits as usize;
        let groups = cols / group_size as usize;
        let group_shape = [rows as i32, groups as i32];
        if scales.shape() != group_shape || biases.shape() != group_shape {
            return None;
        }
        Some(PackedMatrix {
            weight: packed_data(weight)?.cast(),
            scales: packed_data(scales)?.cast(),
            biases: packed_data(biases)?.cast(),
            _arrays: [weight.clone(), scales.clone(), biases.clone()],
            rows,
            cols,
            group_size: group_size as usize,
            bits: bits as usize,
        })
    }

    /// `y[m, rows] = x[m, cols] @ W^T`, on this thread and the kernel pool.
    pub fn matmul(&self, x: &[f32], y: &mut [f32]) {
        PackedMatrix::matmul_many(x, &mut [(self, y)]);
    }

    /// `x @ W^T` for several matrices of the same input width, as one job
    /// for the kernel pool (one hand-off to the workers, not one each):
    /// each `(matrix, y)` gets `y[m, matrix.rows]`.
    pub fn matmul_many(x: &[f32], products: &mut [(&PackedMatrix, &mut [f32])]) {
        let Some(cols) = products.first().map(|(matrix, _)| matrix.cols) else {
            return;
        };
        let m = x.len() / cols;
        assert_eq!(x.len(), m * cols);
        let raw: Vec<mlx_sys::mlxgate_quantized_product> = products
            .iter_mut()
            .map(|(matrix, y)| {
                assert!(matrix.cols == cols && y.len() == m * matrix.rows);
                mlx_sys::mlxgate_quantized_product {
                    y: y.as_mut_ptr(),
                    w: matrix.weight.cast(),
                    scales: matrix.scales,
                    biases: matrix.biases,
                    n: matrix.rows as i64,
                    group_size: matrix.group_size as i32,
                    bits: matrix.bits as i32,
                }
            })
            .collect();
        // SAFETY: every output was checked to hold m x rows floats, every
        // matrix reads `cols` inputs per row, and the outputs are distinct
        // (each is a separate &mut slice).
        let status = unsafe {
            mlx_sys::mlxgate_quantized_matmul_raw_many(
                x.as_ptr(),
                m as i64,
                cols as i64,
                raw.as_ptr(),
                raw.len() as i32,
            )
        };
        assert_eq!(
            status, 0,
            "operands were checked when the matrices were packed"
        );
    }

    /// Row `row` dequantized into `out` (`cols` floats): an embedding lookup.
    pub fn dequantize_row(&self, row: usize, out: &mut [f32]) {
        assert!(row < self.rows && out.len() == self.cols);
        let row_bytes = self.cols * self.bits / 8;
        let groups = self.cols / self.group_size;
        // SAFETY: `row` is in range, so these slices lie inside the buffers.
        let (codes, scales, biases) = unsafe {
            (
                std::slice::from_raw_parts(self.weight.add(row * row_bytes), row_bytes),
                std::slice::from_raw_parts(self.scales.add(row * groups), groups),
                std::slice::from_raw_parts(self.biases.add(row * groups), groups),
            )
        };
        let per_byte = 8 / self.bits;
        let mask = (1u32 << self.bits) - 1;
        for (i, value) in out.iter_mut().enumerate() {
            let byte = u32::from(codes[i / per_byte]);
            let code = (byte >> ((i % per_byte) * self.bits)) & mask;
            let group = i / self.group_size;
            *value = scales[group].mul_add(code as f32, biases[group]);
        }
    }
}

/// The shape of one decode-attention call: see [`decode_attention`].
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Floats between one kv head's first position and the next's.
    pub head_stride: usize,
    pub scale: f32,
}

/// One query position over `positions` cached positions, every query head:
/// `out[h] = softmax(scale * q[h] . K[g]^T) V[g]`, `g = h / (heads / kv_heads)`.
///
/// # Safety
/// `keys` and `values` must be valid for reads of kv head g's positions
/// `[0, positions)` at `g * head_stride + p * head_dim` for every kv head,
/// and nothing may write those floats during the call.
pub unsafe fn decode_attention(
    out: &mut [f32],
    q: &[f32],
    keys: *const f32,
    values: *const f32,
    positions: usize,
    shape: AttentionShape,
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        head_stride,
        scale,
    } = shape;
    assert!(out.len() == heads * head_dim && q.len() == heads * head_dim);
    assert!(head_stride >= positions * head_dim);
    // SAFETY: `out` and `q` were checked; the caller vouches for the cache.
    let status = unsafe {
        mlx_sys::mlxgate_decode_attention(
            out.as_mut_ptr(),
            q.as_ptr(),
            heads as i32,
            kv_heads as i32,
            head_dim as i32,
            keys,
            values,
            head_stride as i64,
            positions as i64,
            scale,
        )
    };
    assert_eq!(status, 0, "decode attention refused its operands");
}
