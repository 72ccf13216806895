//! Which BLAS serves MLX's CPU float32 matmul, and how fast.
//!
//! `cargo bench -p mlxgate --bench mlx_blas` (OpenBLAS, the default) against
//! `MLXGATE_BLAS=reference cargo bench -p mlxgate --bench mlx_blas` (the
//! reference BLAS bundled in the MLX wheel). Prints medians of 15 runs.

use std::time::Instant;

use mlx_rs::Array;
use mlx_rs::ops::matmul;

fn median_ms(shape: (i32, i32, i32)) -> f64 {
    let (m, k, n) = shape;
    let a = Array::from_slice(&vec![0.5f32; (m * k) as usize], &[m, k]);
    let b = Array::from_slice(&vec![0.25f32; (k * n) as usize], &[k, n]);
    let mut times: Vec<f64> = (0..15)
        .map(|_| {
            let start = Instant::now();
            matmul(&a, &b).and_then(|c| c.eval()).expect("matmul");
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let blas = if maps.contains("libopenblas") {
        "OpenBLAS"
    } else {
        "reference BLAS (MLX wheel)"
    };
    println!("BLAS in use: {blas}");
    for shape in [
        (1, 2048, 8192),
        (1, 576, 1536),
        (64, 576, 1536),
        (512, 576, 576),
    ] {
        println!(
            "f32 matmul {:>4} x {:>4} x {:>4}: {:8.3} ms",
            shape.0,
            shape.1,
            shape.2,
            median_ms(shape)
        );
    }
}
