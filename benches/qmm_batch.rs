//! Cost per input of the native quantized matmul at decode batch sizes 1, 4
//! and 8: a SmolLM2 MLP matrix (4-bit, 1536 x 576, f16 scales and biases as
//! Q4_1 loads) and its 8-bit output head (49152 x 576). The figure behind
//! "where decode stops scaling" in BENCHMARKS.md: a batch shares each
//! group's widened codes, but every input still needs its own three
//! multiply-adds per group of 32 weights.
//!
//! `cargo bench -p mlxgate --bench qmm_batch`

use std::time::Instant;

use mlx_rs::ops::quantize;
use mlx_rs::{Array, Dtype};
use mlxgate::mlx::kernels::PackedMatrix;

fn random(shape: &[i32], seed: u64) -> Array {
    let key = mlx_rs::random::key(seed).expect("key");
    mlx_rs::random::normal::<f32>(shape, None, None, &key).expect("normal")
}

/// `a` rounded to f16, as GGUF's scales and biases load.
fn f16_values(a: &Array) -> Array {
    a.as_dtype(Dtype::Float16)
        .and_then(|h| h.as_dtype(Dtype::Float32))
        .expect("cast")
}

fn main() {
    for (rows, cols, bits, what, calls) in [
        (1536usize, 576usize, 4, "4-bit MLP matrix 1536x576", 2000),
        (49152, 576, 8, "8-bit output head 49152x576", 100),
    ] {
        let (codes, scales, biases) =
            quantize(random(&[rows as i32, cols as i32], 1), 32, bits).expect("quantize");
        let packed =
            PackedMatrix::new(&codes, &f16_values(&scales), &f16_values(&biases), 32, bits)
                .expect("packable");
        let mut alone = 0.0;
        for m in [1usize, 4, 8] {
            let x = random(&[m as i32, cols as i32], 2);
            let x = x.as_slice::<f32>();
            let mut y = vec![0.0f32; m * rows];
            for _ in 0..calls / 20 {
                packed.matmul(x, &mut y);
            }
            // Best of 5 rounds: the least disturbed by the machine's noise.
            let best = (0..5)
                .map(|_| {
                    let started = Instant::now();
                    for _ in 0..calls {
                        packed.matmul(x, &mut y);
                    }
                    started.elapsed().as_secs_f64() / calls as f64
                })
                .fold(f64::MAX, f64::min);
            let per_input = best * 1e6 / m as f64;
            if m == 1 {
                alone = per_input;
            }
            println!(
                "{what}, batch {m}: {:.1} us a call, {per_input:.1} us an input ({:.2}x batch 1's)",
                best * 1e6,
                per_input / alone
            );
        }
    }
}
