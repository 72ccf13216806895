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

/// Whether the kernels cover this quantization of rows `cols` wide: 4 or 8
/// bits; groups of a multiple of 32, or of 16 at 8 bits (Q6_K's scale
/// blocks, which MLX's own kernels lack); rows of whole 32-weight chunks;
/// f32 scales (MLX keeps biases in the scales' dtype).
fn covers(scales: &Array, group_size: i32, bits: i32, cols: i32) -> bool {
    let groups = (group_size > 0 && group_size % 32 == 0) || (group_size == 16 && bits == 8);
    (bits == 4 || bits == 8)
        && groups
        && cols % group_size == 0
        && cols % 32 == 0
        && scales.dtype() == Dtype::Float32
}

/// Whether MLX's own quantized kernels take this group size.
pub fn mlx_takes_group_size(group_size: i32) -> bool {
    [32, 64, 128].contains(&group_size)
}

/// Whether this thread should run `x @ W^T` for a quantized W natively.
pub fn quantized_matmul_is_native(x: &Array, scales: &Array, group_size: i32, bits: i32) -> bool {
    let cols = x.shape().last().copied().unwrap_or(0);
    thread_choice() == KernelChoice::Native
        && x.dtype() == Dtype::Float32
        && covers(scales, group_size, bits, cols)
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
    // SAFETY: the operands are live arrays and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_quantized_matmul(
            res,
            x.as_ptr(),
            w.as_ptr(),
            scales.as_ptr(),
            biases.as_ptr(),
            group_size,
            bits,
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// Whether the native attention kernels (prefill and decode) take heads this
/// wide: they work 8 floats at a time.
pub fn attention_takes_head_dim(head_dim: usize) -> bool {
    head_dim.is_multiple_of(8)
}

/// Whether this thread should run prefill attention natively (float32
/// queries, a head width the kernel takes).
pub fn causal_attention_is_native(q: &Array, head_dim: usize) -> bool {
    thread_choice() == KernelChoice::Native
        && q.dtype() == Dtype::Float32
        && attention_takes_head_dim(head_dim)
}

/// Causal attention of `q` `[1, heads, queries, head_dim]` over `k`/`v`
/// `[1, kv_heads, keys, head_dim]`, by the native kernel on this thread's
/// stream: query i sits at key index `first_query + i` and sees keys up to
/// it, within `window` positions when `window > 0`. Returns
/// `[1, queries, heads, head_dim]` (positions first, ready to merge heads).
pub fn causal_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    first_query: usize,
    window: usize,
) -> Result<Array, Exception> {
    // SAFETY: the operands are live arrays and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_causal_attention(
            res,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            scale,
            first_query as i64,
            window as i64,
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// Whether this thread should run SwiGLU's `silu(gate) * up` natively
/// (float32 operands of one shape).
pub fn silu_multiply_is_native(gate: &Array, up: &Array) -> bool {
    thread_choice() == KernelChoice::Native
        && gate.dtype() == Dtype::Float32
        && up.dtype() == Dtype::Float32
        && gate.shape() == up.shape()
}

/// `silu(gate) * up`, SwiGLU's gated activation, by the native kernel on
/// this thread's stream. It has no gradient: training uses MLX's ops.
pub fn silu_multiply(gate: &Array, up: &Array) -> Result<Array, Exception> {
    // SAFETY: the operands are live arrays and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_silu_multiply(
            res,
            gate.as_ptr(),
            up.as_ptr(),
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// One decode step's attention over a GPU batch's key/value slab, each row
/// reading only its own columns, `starts[row] ..= end[0]`, of `keys` and
/// `values` (`[rows, kv_heads, columns, head_dim]`, in place): `queries`
/// `[rows, heads * head_dim]` in, the same shape out. A CUDA kernel MLX
/// compiles at first use (GPU streams only): MLX's fused decode attention
/// takes no mask, and its unfused fallback read every row's columns
/// rounded up to a bucket, with copies.
///
/// With `new_column` (this step's key and value, `[rows, kv_heads, 1,
/// head_dim]`), the kernel first writes them into column `end` of `keys`
/// and `values` in place: those arrays change under MLX, so only a caller
/// that owns them, and whose other readers never read that column, may
/// ask (the slab: `transformer::slab`).
pub fn ragged_decode_attention(
    queries: &Array,
    keys: &Array,
    values: &Array,
    new_column: Option<(&Array, &Array)>,
    (starts, end, scale): (&Array, &Array, &Array),
    heads: usize,
) -> Result<Array, Exception> {
    let none = mlx_sys::mlx_array {
        ctx: std::ptr::null_mut(),
    };
    let (new_keys, new_values) = new_column.map_or((none, none), |(k, v)| (k.as_ptr(), v.as_ptr()));
    // SAFETY: the operands are live arrays (or null, which the kernel reads
    // as none) and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_ragged_decode_attention(
            res,
            queries.as_ptr(),
            keys.as_ptr(),
            values.as_ptr(),
            starts.as_ptr(),
            end.as_ptr(),
            scale.as_ptr(),
            new_keys,
            new_values,
            heads as i32,
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// The most rows [`decode_matmul`] takes (its kernel's limit).
const DECODE_MATMUL_MAX_ROWS: usize = 8;

/// The most rows of `x` that [`decode_matmul`] serves on CUDA:
/// `MLXGATE_DECODE_MATMUL_ROWS` (0 turns it off; at most
/// [`DECODE_MATMUL_MAX_ROWS`]), 4 unless set; 0 on other backends. On an
/// H100 (8B shapes) its matmuls took 5.8 / 5.7 ms a step at 2 / 4 rows
/// against MLX's (cuBLAS) 8.1 / 9.2, the same at 1 row (MLX's own kernel)
/// and at 8.
pub fn decode_matmul_rows() -> usize {
    static ROWS: OnceLock<usize> = OnceLock::new();
    *ROWS.get_or_init(|| {
        let rows = std::env::var("MLXGATE_DECODE_MATMUL_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(4usize)
            .min(DECODE_MATMUL_MAX_ROWS);
        if Backend::detect() == Backend::Cuda {
            rows
        } else {
            0
        }
    })
}

/// Whether `x @ weight^T` should run [`decode_matmul`]: on CUDA, `x` of at
/// most [`decode_matmul_rows`] rows, both bfloat16 or float16, the inner
/// size a multiple of 8 (16-byte loads).
pub fn decode_matmul_applies(x: &Array, weight: &Array) -> bool {
    let inner = weight.shape()[1] as usize;
    matches!(x.dtype(), Dtype::Bfloat16 | Dtype::Float16)
        && x.dtype() == weight.dtype()
        && inner.is_multiple_of(8)
        && x.size() <= decode_matmul_rows() * inner
}

/// `x @ weight^T` for a decode step's few rows (`x` `[..., K]`, `weight`
/// `[N, K]`): a CUDA kernel MLX compiles at first use, per shape and row
/// count (inputs traced for a gradient take MLX's matmul). A step of few
/// rows reads every weight once, so its speed is the memory bandwidth its
/// matmuls reach; MLX hands 2-8 rows to cuBLAS, which reaches much less of
/// it there.
pub fn decode_matmul(x: &Array, weight: &Array) -> Result<Array, Exception> {
    decode_matmul_launch(x, weight, false)
}

/// An MLP's `silu(x @ gate^T) * (x @ up^T)` in one launch of
/// [`decode_matmul`]'s kernel, `gate_up` being gate and up stacked (`[2N,
/// K]`, gate's rows first): where [`decode_matmul_applies`] to `x` and
/// `gate_up`. A GPU's decode step pays per launch (the host encodes each);
/// this saves two a layer: up's matmul and the activation.
pub fn decode_gated_matmul(x: &Array, gate_up: &Array) -> Result<Array, Exception> {
    decode_matmul_launch(x, gate_up, true)
}

fn decode_matmul_launch(x: &Array, weight: &Array, gated: bool) -> Result<Array, Exception> {
    // SAFETY: the operands are live arrays and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_decode_matmul(
            res,
            x.as_ptr(),
            weight.as_ptr(),
            i32::from(gated),
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// Compiles [`decode_matmul`] now for each distinct shape among `weights`
/// that it will serve, and [`decode_gated_matmul`] for `gated` (stacked
/// gate and up), at every row count, so that no step waits for it (~0.5-2 s
/// a compile; a first 4-request window once lost seconds).
pub fn warm_up_decode_matmul<'a>(
    weights: impl IntoIterator<Item = &'a Array>,
    gated: impl IntoIterator<Item = &'a Array>,
) -> Result<(), Exception> {
    let mut seen = std::collections::HashSet::new();
    let kinds = weights.into_iter().map(|w| (w, false));
    for (weight, is_gated) in kinds.chain(gated.into_iter().map(|w| (w, true))) {
        let key = (weight.shape().to_vec(), weight.dtype(), is_gated);
        if weight.ndim() != 2 || !seen.insert(key) {
            continue;
        }
        for rows in 1..=decode_matmul_rows() {
            let x = mlx_rs::ops::zeros_dtype(&[rows as i32, weight.shape()[1]], weight.dtype())?;
            if decode_matmul_applies(&x, weight) {
                decode_matmul_launch(&x, weight, is_gated)?.eval()?;
            }
        }
    }
    Ok(())
}

/// Output columns per panel of a weight packed for [`dense`].
pub const DENSE_PANEL: usize = 32;

/// Whether this thread should run float32 dense layers natively (an
/// AVX-512 CPU; `out` a multiple of [`DENSE_PANEL`]).
pub fn dense_is_native(out: usize) -> bool {
    // SAFETY: a pure query of the CPU's features.
    thread_choice() == KernelChoice::Native
        && out.is_multiple_of(DENSE_PANEL)
        && unsafe { mlx_sys::mlxgate_dense_supported() } == 1
}

/// `x W^T + b` by the native kernel on this thread's stream: `x` `[M, K]`,
/// `panels` the weight packed by [`dense_panels`], `bias` `[N]`.
pub fn dense(x: &Array, panels: &Array, bias: &Array) -> Result<Array, Exception> {
    // SAFETY: the operands are live arrays and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_dense(
            res,
            x.as_ptr(),
            panels.as_ptr(),
            bias.as_ptr(),
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// A weight `[N, K]` packed for [`dense`]: `[N / 32, K, 32]`, panel p's row
/// k holding `W[32p .. 32p + 32, k]`.
pub fn dense_panels(weight: &Array) -> Result<Array, Exception> {
    let (n, k) = (weight.shape()[0], weight.shape()[1]);
    let panel = DENSE_PANEL as i32;
    weight
        .reshape(&[n / panel, panel, k])?
        .transpose_axes(&[0, 2, 1])?
        .contiguous()
}

/// Whether this thread should run an encoder's attention natively (an
/// AVX-512 CPU, heads 16, 32 or 64 wide).
pub fn encoder_attention_is_native(head_dim: usize) -> bool {
    let width = i32::try_from(head_dim).unwrap_or(0);
    // SAFETY: a pure query of the CPU's features.
    thread_choice() == KernelChoice::Native
        && unsafe { mlx_sys::mlxgate_encoder_attention_supported(width) } == 1
}

/// Bidirectional attention of packed inputs by the native kernel on this
/// thread's stream: `qkv` `[tokens, 3 * hidden]` (queries, keys, values),
/// input i the next `lengths[i]` tokens, attending over its own. Returns
/// `[tokens, hidden]`.
pub fn encoder_attention(
    qkv: &Array,
    lengths: &[usize],
    heads: usize,
    scale: f32,
) -> Result<Array, Exception> {
    let lengths: Vec<i64> = lengths.iter().map(|&n| n as i64).collect();
    // SAFETY: the operands are live; the kernel copies `lengths`.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_encoder_attention(
            res,
            qkv.as_ptr(),
            lengths.as_ptr(),
            lengths.len() as i64,
            heads as i32,
            scale,
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// Whether this thread should run the exact GELU natively (float32).
pub fn gelu_is_native(x: &Array) -> bool {
    thread_choice() == KernelChoice::Native && x.dtype() == Dtype::Float32
}

/// `x / 2 * (1 + erf(x / sqrt 2))` by the native kernel on this thread's
/// stream (erf within 1.5e-7 of exact). No gradient.
pub fn gelu(x: &Array) -> Result<Array, Exception> {
    // SAFETY: the operand is a live array and the stream outlives the call.
    new_array(|res, error, len| unsafe {
        mlx_sys::mlxgate_gelu(
            res,
            x.as_ptr(),
            Stream::thread_local_or_default().as_ref().as_ptr(),
            error,
            len,
        )
    })
}

/// Runs a kernel constructor of the form `f(&mut res, error, error_len)`:
/// on 0, the new array in `res`; else the message it wrote into `error`.
fn new_array(
    make: impl FnOnce(*mut mlx_sys::mlx_array, *mut c_char, usize) -> i32,
) -> Result<Array, Exception> {
    let mut error = [0 as c_char; 512];
    // SAFETY: `res` starts empty and on success holds a new array whose
    // ownership passes to `Array::from_ptr`; on failure it is freed here and
    // the message is read from `error`, which the kernels NUL-terminate.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if make(&mut res, error.as_mut_ptr(), error.len()) == 0 {
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

/// An affine-quantized `[rows, cols]` matrix as the native kernels read it
/// outside MLX's graph (the native decode step). Holds its arrays, so the
/// buffers it reads in place live as long as it does.
///
/// Decoding is bound by memory bandwidth and by the instructions spent per
/// weight, so it stores the matrix as tightly as stays exact: f16 scales and
/// biases where every one is an f16 (weights from Q4_0, Q4_1, Q5_0, Q8_0
/// files), and no biases where each is a fixed multiple of its scale
/// (symmetric types: Q4_0, Q5_0, Q8_0). Q4_1 weights then read 5 bits per
/// weight instead of 6, Q5_0 and Q8_0 8.5 instead of 10. 4-bit codes are
/// stored split (weights l and l + 16 of each 32 share a byte), which
/// unpacks in fewer instructions than MLX's order (~6% faster decode).
/// Symmetric codes that fit 5 bits (Q5_0) are packed six to a 32-bit lane
/// on CPUs with AVX-512 (see [`Codes::FiveBit`]): ~5.9 bits per weight
/// instead of 8.5. MLX's graph (prefill) keeps reading its own arrays.
///
/// Tried and left out: 5-bit codes unpacked through table lookups
/// (`vpermt2ps`, `vpermb`) or byte shuffles, on AVX2 and AVX-512: they cost
/// more than the bytes saved (Qwen2.5 decode 25-31 against 30-36 tok/s).
pub struct PackedMatrix {
    _arrays: [Array; 3],
    codes: Codes,
    groups: GroupValues,
    pub rows: usize,
    pub cols: usize,
    group_size: usize,
    /// Bits per stored code: 4, 5 or 8.
    bits: usize,
}

/// A matrix's codes: MLX's buffer in place; 4-bit codes split (per 32
/// weights, 16 bytes whose byte l holds weight l in its low nibble and
/// weight l + 16 in its high one); or, for symmetric 8-bit matrices, signed
/// codes `q - offset`, each weight `scale * code`.
enum Codes {
    InPlace(*const u8),
    Split(Vec<u8>),
    Signed(Vec<u8>),
    /// Signed codes in [-16, 15] (groups of 32), `code + 16` packed per
    /// row: each 96 weights in 64 bytes whose 32-bit lane i holds weight
    /// 16j + i at bits 5j (j = 0..5); a last 32 weights as 16 u16 lanes, a
    /// last 64 as 16 u32 lanes. A code leaves its lane exactly by a mask
    /// into a float's mantissa and a subtraction (no shuffles, no
    /// conversions), and each lane's 16 weights meet 16 consecutive inputs.
    FiveBit(Vec<u8>),
}

/// Per-group values, as the kernels read them.
enum Values {
    F32(*const f32),
    F16(Vec<u16>),
}

struct GroupValues {
    scales: Values,
    /// `None`: every bias is `-offset * scale` (in f32).
    biases: Option<Values>,
    offset: f32,
}

// SAFETY: the raw buffers belong to evaluated MLX arrays, which MLX never
// writes again; every use only reads them.
unsafe impl Send for PackedMatrix {}
unsafe impl Sync for PackedMatrix {}

// The repacking below runs over every weight of a model at load, so it is
// written as plain indexed loops: unoptimised (debug builds, every test that
// loads a model) iterator adapters made loading SmolLM2 ~10x slower than in
// release, most of a test's start-up.

/// `values` as exact f16s, or `None` when one of them is not an f16.
fn exact_f16(values: &[f32]) -> Option<Vec<u16>> {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let mut bits = vec![0u16; values.len()];
    let halves: &mut [half::f16] = bits.reinterpret_cast_mut();
    halves.convert_from_f32_slice(values);
    let mut back = vec![0f32; values.len()];
    halves.convert_to_f32_slice(&mut back);
    // Exact when every value comes back (a NaN never does).
    (back == values).then_some(bits)
}

/// The `offset` with `bias == scale * -offset` (f32) for every group, if any.
fn symmetric_offset(scales: &[f32], biases: &[f32]) -> Option<f32> {
    let (scale, bias) = scales.iter().zip(biases).find(|(s, _)| **s != 0.0)?;
    let offset = -bias / scale;
    let derives = |(s, b): (&f32, &f32)| s * -offset == *b;
    scales.iter().zip(biases).all(derives).then_some(offset)
}

impl GroupValues {
    /// `offset`: every bias is `-offset * scale` (then none are stored).
    /// `compact`: f16 copies where exact. The slices are MLX's buffers,
    /// which the F32 form keeps reading.
    fn new(scales: &[f32], biases: &[f32], offset: Option<f32>, compact: bool) -> GroupValues {
        // The kernels read scales and stored biases in one dtype.
        let halves = compact
            .then(|| exact_f16(scales))
            .flatten()
            .and_then(|halved| match offset {
                Some(_) => Some((halved, None)),
                None => exact_f16(biases).map(|biases| (halved, Some(biases))),
            });
        let (scales, biases) = match halves {
            Some((scales, biases)) => (Values::F16(scales), biases.map(Values::F16)),
            None => (
                Values::F32(scales.as_ptr()),
                offset.is_none().then_some(Values::F32(biases.as_ptr())),
            ),
        };
        GroupValues {
            scales,
            biases,
            offset: offset.unwrap_or(0.0),
        }
    }

    fn f16(&self) -> bool {
        matches!(self.scales, Values::F16(_))
    }

    fn get(&self, g: usize) -> (f32, f32) {
        let value = |values: &Values| match values {
            // SAFETY: callers keep `g` below the group count.
            Values::F32(p) => unsafe { *p.add(g) },
            Values::F16(h) => half::f16::from_bits(h[g]).to_f32(),
        };
        let scale = value(&self.scales);
        let bias = self.biases.as_ref().map_or(scale * -self.offset, value);
        (scale, bias)
    }
}

impl Values {
    fn as_ptr(&self) -> *const std::ffi::c_void {
        match self {
            Values::F32(p) => p.cast(),
            Values::F16(h) => h.as_ptr().cast(),
        }
    }
}

/// MLX-order 4-bit codes (code i in nibble i % 2 of byte i / 2) in the
/// split layout of [`Codes`].
fn split_codes(bytes: &[u8]) -> Vec<u8> {
    let mut split = vec![0u8; bytes.len() / 16 * 16];
    let out = split.as_mut_slice();
    for chunk in (0..out.len()).step_by(16) {
        // MLX's byte b of the chunk holds codes 2b (low nibble) and 2b + 1
        // (high); byte 8 + b codes 2b + 16 and 2b + 17. Split byte l holds
        // code l (low) and code l + 16 (high).
        for b in 0..8 {
            let (first, second) = (bytes[chunk + b], bytes[chunk + 8 + b]);
            out[chunk + 2 * b] = (first & 15) | (second & 15) << 4;
            out[chunk + 2 * b + 1] = (first >> 4) | (second & 0xf0);
        }
    }
    split
}

/// Bytes of one row of `cols` weights in the layout of [`Codes::FiveBit`].
fn five_bit_row_bytes(cols: usize) -> usize {
    let tail = match cols % 96 {
        32 => 32,
        64 => 64,
        _ => 0,
    };
    cols / 96 * 64 + tail
}

/// Where weight `i` of a five-bit row sits: its lane's byte offset, the
/// lane's width in bytes, and the code's bit offset in the lane.
fn five_bit_place(cols: usize, i: usize) -> (usize, usize, usize) {
    let (block, within) = (i / 96, i % 96);
    let (slot, lane) = (within / 16, within % 16);
    let lane_bytes = if block == cols / 96 && cols % 96 == 32 {
        2
    } else {
        4
    };
    (block * 64 + lane * lane_bytes, lane_bytes, 5 * slot)
}

/// Signed codes (`rows x cols` bytes) in the layout of [`Codes::FiveBit`],
/// when every one is in [-16, 15]. Written lane by lane: this runs over
/// every Q5_0 weight at load (250 million for Qwen2.5-0.5B).
fn five_bit_codes(signed: &[u8], cols: usize) -> Option<Vec<u8>> {
    // `code + 16` as a byte: below 32 exactly when the code fits.
    let biased = |code: u8| u32::from(code.wrapping_add(16));
    if !signed.iter().all(|&code| biased(code) < 32) {
        return None;
    }
    // Lane i of `codes` (16 weights per field): field j holds weight 16j + i.
    let lane = |codes: &[u8], i: usize| {
        (0..codes.len() / 16).fold(0u32, |word, j| word | biased(codes[16 * j + i]) << (5 * j))
    };
    let row_bytes = five_bit_row_bytes(cols);
    let mut packed = Vec::with_capacity(signed.len() / cols * row_bytes);
    for row in signed.chunks_exact(cols) {
        let mut blocks = row.chunks_exact(96);
        for block in &mut blocks {
            for i in 0..16 {
                packed.extend_from_slice(&lane(block, i).to_le_bytes());
            }
        }
        let tail = blocks.remainder();
        match tail.len() {
            32 => (0..16)
                .for_each(|i| packed.extend_from_slice(&(lane(tail, i) as u16).to_le_bytes())),
            64 => (0..16).for_each(|i| packed.extend_from_slice(&lane(tail, i).to_le_bytes())),
            _ => {}
        }
    }
    Some(packed)
}

/// Code `i` of a five-bit row (see [`Codes::FiveBit`]).
fn five_bit_code(row: &[u8], cols: usize, i: usize) -> i32 {
    let (at, width, shift) = five_bit_place(cols, i);
    let mut lane = [0u8; 4];
    lane[..width].copy_from_slice(&row[at..at + width]);
    ((u32::from_le_bytes(lane) >> shift) & 31) as i32 - 16
}

/// Whether five-bit products of rows of `cols` weights in groups of
/// `group_size` run here (AVX-512, groups of 32): where they do, symmetric
/// matrices whose codes fit 5 bits (Q5_0) are packed to them.
pub fn five_bit_takes(cols: usize, group_size: usize) -> bool {
    let (Ok(cols), Ok(group_size)) = (i64::try_from(cols), i32::try_from(group_size)) else {
        return false;
    };
    // SAFETY: a pure query of the CPU's features and the operands' sizes.
    native_available() && unsafe { mlx_sys::mlxgate_kernels_five_bit_takes(cols, group_size) } == 1
}

/// 8-bit codes minus `offset` as signed bytes, when each fits.
fn signed_codes(bytes: &[u8], offset: f32) -> Option<Vec<u8>> {
    if offset.fract() != 0.0 || !(0.0..=255.0).contains(&offset) {
        return None;
    }
    let offset = offset as i16;
    let mut signed = vec![0u8; bytes.len()];
    let out = signed.as_mut_slice();
    for i in 0..bytes.len() {
        let code = bytes[i] as i16 - offset;
        // Fits an i8 exactly when the cast keeps it.
        if code as i8 as i16 != code {
            return None;
        }
        out[i] = code as i8 as u8;
    }
    Some(signed)
}

impl PackedMatrix {
    /// `None` unless the native kernels run here and cover this layout
    /// (see `covers`; f32 scales and biases, packed buffers).
    pub fn new(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        group_size: i32,
        bits: i32,
    ) -> Option<PackedMatrix> {
        PackedMatrix::build(weight, scales, biases, group_size, bits, true)
    }

    /// The matrix read in place, without compact copies: for an embedding
    /// table that only serves row lookups (one row per token), where
    /// repacking the whole table would cost start-up time and memory for
    /// nothing.
    pub fn in_place(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        group_size: i32,
        bits: i32,
    ) -> Option<PackedMatrix> {
        PackedMatrix::build(weight, scales, biases, group_size, bits, false)
    }

    fn build(
        weight: &Array,
        scales: &Array,
        biases: &Array,
        group_size: i32,
        bits: i32,
        compact: bool,
    ) -> Option<PackedMatrix> {
        let supported = native_available()
            && (bits == 4 || bits == 8)
            && weight.dtype() == Dtype::Uint32
            && biases.dtype() == Dtype::Float32
            && weight.ndim() == 2;
        if !supported {
            return None;
        }
        let rows = weight.shape()[0] as usize;
        let cols = weight.shape()[1] as usize * 32 / bits as usize;
        if !covers(scales, group_size, bits, cols as i32) {
            return None;
        }
        let groups = cols / group_size as usize;
        let group_shape = [rows as i32, groups as i32];
        if scales.shape() != group_shape || biases.shape() != group_shape {
            return None;
        }
        let weight_data: *const u8 = packed_data(weight)?.cast();
        // SAFETY: a [rows, cols] weight of `bits` holds rows * cols * bits / 8 bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(weight_data, rows * cols * bits as usize / 8) };
        let count = rows * groups;
        // SAFETY: scales and biases were checked to be [rows, groups] f32.
        let (scales_f32, biases_f32) = unsafe {
            (
                std::slice::from_raw_parts(packed_data(scales)?.cast::<f32>(), count),
                std::slice::from_raw_parts(packed_data(biases)?.cast::<f32>(), count),
            )
        };
        let offset = compact
            .then(|| symmetric_offset(scales_f32, biases_f32))
            .flatten();
        let (codes, offset) = match (bits, offset) {
            _ if !compact => (Codes::InPlace(weight_data), None),
            (4, _) => (Codes::Split(split_codes(bytes)), offset),
            (_, Some(offset)) => match signed_codes(bytes, offset) {
                Some(signed) => {
                    let five_bits = five_bit_takes(cols, group_size as usize)
                        .then(|| five_bit_codes(&signed, cols))
                        .flatten();
                    (
                        five_bits.map_or(Codes::Signed(signed), Codes::FiveBit),
                        Some(offset),
                    )
                }
                None => (Codes::InPlace(weight_data), None),
            },
            _ => (Codes::InPlace(weight_data), None),
        };
        let groups = GroupValues::new(scales_f32, biases_f32, offset, compact);
        let bits = match codes {
            Codes::FiveBit(_) => 5,
            _ => bits as usize,
        };
        Some(PackedMatrix {
            codes,
            groups,
            _arrays: [weight.clone(), scales.clone(), biases.clone()],
            rows,
            cols,
            group_size: group_size as usize,
            bits,
        })
    }

    /// Bytes the kernels read per weight, in bits: codes, scales, biases.
    pub fn bits_per_weight(&self) -> f64 {
        let value_bits = if self.groups.f16() { 16.0 } else { 32.0 };
        let per_group = if self.groups.biases.is_some() {
            2.0
        } else {
            1.0
        };
        8.0 * self.row_bytes() as f64 / self.cols as f64
            + per_group * value_bits / self.group_size as f64
    }

    /// Bytes of one row's codes.
    fn row_bytes(&self) -> usize {
        match self.codes {
            Codes::FiveBit(_) => five_bit_row_bytes(self.cols),
            _ => self.cols * self.bits / 8,
        }
    }

    /// Bytes the kernels read for the whole matrix.
    pub fn bytes(&self) -> usize {
        (self.rows as f64 * self.cols as f64 * self.bits_per_weight() / 8.0) as usize
    }

    /// The buffer of codes the kernels read.
    fn code_bytes(&self) -> *const u8 {
        match &self.codes {
            Codes::InPlace(p) => *p,
            Codes::Split(v) | Codes::Signed(v) | Codes::FiveBit(v) => v.as_ptr(),
        }
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
                let groups = &matrix.groups;
                mlx_sys::mlxgate_quantized_product {
                    y: y.as_mut_ptr(),
                    w: matrix.code_bytes().cast(),
                    scales: groups.scales.as_ptr(),
                    biases: groups
                        .biases
                        .as_ref()
                        .map_or(std::ptr::null(), Values::as_ptr),
                    n: matrix.rows as i64,
                    group_size: matrix.group_size as i32,
                    bits: matrix.bits as i32,
                    scales_f16: i32::from(groups.f16()),
                    bias_offset: groups.offset,
                    split: i32::from(matches!(matrix.codes, Codes::Split(_))),
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
        let row_bytes = self.row_bytes();
        let groups = self.cols / self.group_size;
        // SAFETY: `row` is in range, so this slice lies inside the buffer.
        let codes = unsafe {
            std::slice::from_raw_parts(self.code_bytes().add(row * row_bytes), row_bytes)
        };
        let code = |i: usize| -> f32 {
            match &self.codes {
                Codes::InPlace(_) if self.bits == 4 => {
                    f32::from((codes[i / 2] >> (4 * (i % 2))) & 15)
                }
                Codes::InPlace(_) => f32::from(codes[i]),
                Codes::Signed(_) => f32::from(codes[i] as i8),
                Codes::FiveBit(_) => five_bit_code(codes, self.cols, i) as f32,
                // byte l of each 16 holds weights l and l + 16
                Codes::Split(_) => {
                    f32::from((codes[i / 32 * 16 + i % 16] >> (4 * (i % 32 / 16))) & 0xf)
                }
            }
        };
        for (i, value) in out.iter_mut().enumerate() {
            let (scale, bias) = self.groups.get(row * groups + i / self.group_size);
            *value = match self.codes {
                Codes::Signed(_) | Codes::FiveBit(_) => scale * code(i),
                _ => scale.mul_add(code(i), bias),
            };
        }
    }
}

/// The shape every row of a [`decode_attention_many`] call shares.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

/// One sequence's part of [`decode_attention_many`]: one query position
/// (`[heads, head_dim]`) over `positions` cached positions, every query
/// head: `out[h] = softmax(scale * q[h] . K[g]^T) V[g]`,
/// `g = h / (heads / kv_heads)`.
#[derive(Clone, Copy)]
pub struct AttentionRow(mlx_sys::mlxgate_attention_row);

impl AttentionRow {
    /// # Safety
    /// `keys` and `values` must be valid for reads of kv head g's positions
    /// `[0, positions)` at `g * head_stride + p * head_dim` for every kv
    /// head, unwritten during the call; `out` and `q` (each
    /// `heads * head_dim` floats) must outlive the row's use and `out` must
    /// not be read or written elsewhere meanwhile.
    pub unsafe fn new(
        out: &mut [f32],
        q: &[f32],
        keys: *const f32,
        values: *const f32,
        positions: usize,
        head_stride: usize,
    ) -> AttentionRow {
        AttentionRow(mlx_sys::mlxgate_attention_row {
            out: out.as_mut_ptr(),
            q: q.as_ptr(),
            keys,
            values,
            head_stride: head_stride as i64,
            positions: positions as i64,
        })
    }
}

/// Decode attention for several sequences of one layer as one job for the
/// kernel pool (one call per row and layer was a pool dispatch for a few
/// microseconds of work), each row's result exactly as alone. Panics unless [`attention_takes_head_dim`] and
/// every row's operands are sound.
///
/// # Safety
/// Every row's promises ([`AttentionRow::new`]) hold during the call, and
/// no two rows share an `out`.
pub unsafe fn decode_attention_many(rows: &[AttentionRow], shape: AttentionShape) {
    let raw: Vec<mlx_sys::mlxgate_attention_row> = rows.iter().map(|r| r.0).collect();
    // SAFETY: the caller vouches for each row's buffers.
    let status = unsafe {
        mlx_sys::mlxgate_decode_attention_many(
            raw.as_ptr(),
            raw.len() as i64,
            shape.heads as i32,
            shape.kv_heads as i32,
            shape.head_dim as i32,
            shape.scale,
        )
    };
    assert_eq!(status, 0, "decode attention refused its operands");
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_rs::random;

    /// The load-time repacking, against the definitions its comments give.
    #[test]
    fn repacked_codes_and_halves_follow_their_layouts() {
        let bytes: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
        // MLX order: code i in nibble i % 2 of byte i / 2.
        let mlx_code = |chunk: usize, i: usize| (bytes[16 * chunk + i / 2] >> (4 * (i % 2))) & 15;
        let split = split_codes(&bytes);
        assert_eq!(split.len(), 64);
        for chunk in 0..4 {
            for l in 0..16 {
                let byte = split[16 * chunk + l];
                assert_eq!(
                    (byte & 15, byte >> 4),
                    (mlx_code(chunk, l), mlx_code(chunk, l + 16))
                );
            }
        }

        assert_eq!(signed_codes(&[0, 128, 255], 128.0), Some(vec![128, 0, 127]));
        assert_eq!(signed_codes(&[0, 200], 0.0), None, "200 is no i8");
        assert_eq!(signed_codes(&[1], 0.5), None, "offsets are whole");

        let halves = [1.0f32, -0.5, 65504.0, 6.1035156e-5, 0.0];
        let want: Vec<u16> = halves
            .iter()
            .map(|&v| half::f16::from_f32(v).to_bits())
            .collect();
        assert_eq!(exact_f16(&halves), Some(want));
        assert_eq!(exact_f16(&[1.0, 0.1]), None, "0.1 is no f16");
        assert_eq!(exact_f16(&[f32::NAN]), None);
        assert_eq!(exact_f16(&[70000.0]), None, "beyond f16's range");
    }

    /// Normal values times `scale`, in bfloat16.
    fn bf16_normal(shape: &[i32], seed: u64, scale: f32) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, Some(&key))
            .unwrap()
            .multiply(Array::from_f32(scale))
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap()
    }

    fn float32(a: &Array) -> Array {
        a.as_dtype(Dtype::Float32).unwrap()
    }

    /// The largest `|got - want| / (|want| + floor)`.
    fn worst_relative(got: &Array, want: &Array, floor: f32) -> f32 {
        got.subtract(want)
            .unwrap()
            .abs()
            .unwrap()
            .divide(want.abs().unwrap().add(Array::from_f32(floor)).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .item_exact::<f32>()
    }

    /// On CUDA the decode matmul serves one-row bfloat16 steps and matches
    /// MLX's matmul; elsewhere it never applies (MLX's matmul runs).
    #[test]
    fn decode_matmul_matches_mlx_where_it_applies() {
        // A partial last block of weight rows, two passes over K.
        let weight = bf16_normal(&[1030, 4096 + 512], 1, 1.0);
        let x = bf16_normal(&[1, 1, 4096 + 512], 2, 1.0);
        if Backend::detect() != Backend::Cuda {
            assert!(!decode_matmul_applies(&x, &weight));
            return;
        }
        assert!(decode_matmul_applies(&x, &weight));
        let row = float32(&x).reshape(&[1, 4096 + 512]).unwrap();
        let want = row
            .matmul(float32(&weight).t())
            .unwrap()
            .reshape(&[1, 1, 1030])
            .unwrap();
        let got = float32(&decode_matmul(&x, &weight).unwrap());
        assert_eq!(got.shape(), &[1, 1, 1030]);
        // Rounded to bfloat16 at the end (8 bits): relative error ~0.4%.
        let worst = worst_relative(&got, &want, 1.0);
        assert!(worst < 0.01, "{worst}");
    }

    /// On CUDA the gated decode matmul equals `silu(x @ gate^T) * (x @
    /// up^T)` within bfloat16 rounding; elsewhere it never applies.
    #[test]
    fn decode_gated_matmul_matches_the_separate_ops_where_it_applies() {
        // Gate's 1030 rows then up's: a partial last block, two passes over K.
        let gate_up = bf16_normal(&[2 * 1030, 4096 + 512], 5, 0.05);
        for rows in [1, 3] {
            let x = bf16_normal(&[rows, 1, 4096 + 512], 6, 0.05);
            if Backend::detect() != Backend::Cuda {
                assert!(!decode_matmul_applies(&x, &gate_up));
                return;
            }
            let y = float32(&x)
                .reshape(&[rows, 4096 + 512])
                .unwrap()
                .matmul(float32(&gate_up).t())
                .unwrap();
            let (gate, up) = (y.index((.., ..1030)), y.index((.., 1030..)));
            let want = gate
                .multiply(mlx_rs::ops::sigmoid(&gate).unwrap())
                .unwrap()
                .multiply(&up)
                .unwrap()
                .reshape(&[rows, 1, 1030])
                .unwrap();
            let got = float32(&decode_gated_matmul(&x, &gate_up).unwrap());
            assert_eq!(got.shape(), &[rows, 1, 1030]);
            // Gate and up rounded to bfloat16, then the product: ~1% at most.
            let worst = worst_relative(&got, &want, 1.0);
            assert!(worst < 0.02, "{rows} rows: {worst}");
        }
    }

    /// Traced for a gradient (fine-tuning's few target rows through the
    /// output head), the decode matmul gives MLX's matmul's gradient: its
    /// CUDA kernel has none, so the op must not run it there (on a CPU the
    /// kernel cannot run at all, so a traced call that reached it fails).
    #[test]
    fn decode_matmul_under_a_gradient_has_matmuls_gradient() {
        let key = |seed| random::key(seed).unwrap();
        let weight = random::normal::<f32>(&[48, 64], None, None, Some(&key(3)))
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let x = random::normal::<f32>(&[2, 64], None, None, Some(&key(4)))
            .unwrap()
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let gradient = |through_kernel: bool| {
            let weight = weight.clone();
            let f = move |params: &[Array]| -> Result<Vec<Array>, Exception> {
                let y = if through_kernel {
                    decode_matmul(&params[0], &weight)?
                } else {
                    params[0].matmul(weight.t())?
                };
                Ok(vec![y.as_dtype(Dtype::Float32)?.square()?.sum(None)?])
            };
            let mut vg = mlx_rs::transforms::value_and_grad_with_argnums(f, &[0][..]);
            let (_, grads) = vg(std::slice::from_ref(&x)).unwrap();
            grads[0].as_dtype(Dtype::Float32).unwrap()
        };
        let (got, want) = (gradient(true), gradient(false));
        assert_eq!(got.shape(), &[2, 64]);
        assert_eq!(got.as_slice::<f32>(), want.as_slice::<f32>());
    }
}
